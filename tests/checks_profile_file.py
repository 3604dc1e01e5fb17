"""Run on every rank of a test pool: the collectives of a job measured per node span, and the public
``autosplit.measure_profile`` in a live job."""
from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def _world():
    from autosplit.runtime.faults.deadlines import Watchdog
    from autosplit.runtime.parallel.world import init_world
    world = init_world((1, 1, -1))
    watchdog = Watchdog(world.store, world.rank, world.mesh, world.timeout_s, world.backend)
    try:
        yield world, watchdog
    finally:
        world.barrier(watchdog, "end of the check")
        world.close()
        watchdog.close()


def comm_records(local: int) -> list:
    """This rank's comm_bench.measure_comm records with ``local`` ranks per node (1: every rank its own node)."""
    from autosplit.profiling.comm_bench import measure_comm
    with _world() as (world, watchdog):
        return measure_comm(world, watchdog, reps=3, sizes=(4 << 10, 256 << 10), local=local)


def public_measure(path: str, seconds: float) -> dict:
    """``autosplit.measure_profile(path)`` in this job: the profile every rank got, as JSON values."""
    import autosplit
    from autosplit.cost_model import profile_file
    import torch.distributed as dist
    groups = len(dist.distributed_c10d._world.pg_map)
    profile = autosplit.measure_profile(path, seconds=seconds, save=False)
    return {"profile": profile_file.to_dict(profile), "groups_left": len(dist.distributed_c10d._world.pg_map) - groups}


def parallelize_with_file(path: str) -> dict:
    """``parallelize(..., device=path)``: the profile it planned with, and whether the log named the file."""
    import logging

    import torch

    import autosplit
    from tests.models import VARIANTS
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    log = logging.getLogger("autosplit")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        torch.manual_seed(0)
        with autosplit.parallelize(VARIANTS["timm_cls"](), mesh=(2, 1, 1), num_microbatches=2, device=path,
                                   example_input=torch.randn(2, 3, 32, 32)) as pm:
            name = pm.plan.profile.name
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return {"planned_with": name, "named": any(path in r.getMessage() for r in records)}
