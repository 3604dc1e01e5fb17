"""Run on every rank of a test pool: measure the profile in the live world, then plan with it."""
from __future__ import annotations

import os

import torch

import autosplit
from autosplit.cost_model import profile_cache
from tests.models import VARIANTS


def measured_then_cached(directory: str) -> dict:
    os.environ["AUTOSPLIT_PROFILE_DIR"] = directory
    from autosplit.runtime.faults.deadlines import Watchdog
    from autosplit.profiling.measure_profile import measure_profile
    from autosplit.runtime.parallel.world import init_world
    world = init_world((1, 1, -1))
    watchdog = Watchdog(world.store, world.rank, world.mesh, world.timeout_s, world.backend)
    state = torch.get_rng_state()
    profile = measure_profile(world, watchdog, compute_budget=0.3)
    same_stream = torch.equal(state, torch.get_rng_state())
    torch.manual_seed(0)
    pm = autosplit.parallelize(VARIANTS["timm_cls"](), mesh=(2, 1, 1), num_microbatches=2,
                               example_input=torch.randn(2, 3, 32, 32))
    os.environ.pop("AUTOSPLIT_PROFILE_DIR")
    return {"profile": profile_cache.to_dict(profile), "planned_with": pm.profile.name,
            "same_stream": same_stream, "fwd": [s.fwd_time for s in pm.plan.stages]}


def pipeline_measured() -> list:
    """pipeline_bench.measure_pipeline over this live world's ranks as one host."""
    from autosplit.runtime.faults.deadlines import Watchdog
    from autosplit.profiling.pipeline_bench import measure_pipeline
    from autosplit.runtime.parallel.world import init_world
    world = init_world((1, 1, -1))
    watchdog = Watchdog(world.store, world.rank, world.mesh, world.timeout_s, world.backend)
    return measure_pipeline(world, watchdog, world.size)


def wake_measured() -> float:
    """sharing_bench.measure_wake in this live world (every rank gets the host's figure)."""
    from autosplit.runtime.faults.deadlines import Watchdog
    from autosplit.profiling.sharing_bench import measure_wake
    from autosplit.runtime.parallel.world import init_world
    world = init_world((1, 1, -1))
    watchdog = Watchdog(world.store, world.rank, world.mesh, world.timeout_s, world.backend)
    return measure_wake(world, watchdog, world.size, trips=20)
