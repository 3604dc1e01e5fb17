"""Run on every rank of a test pool: one traced step (runtime/pipeline/trace_step.py)."""
from __future__ import annotations

import torch

import autosplit
from autosplit.schedule import build_schedule, lower
from tests.dist_checks import batches
from tests.models import VARIANTS


def traced_step(path: str, mesh=(2, 2, 1), schedule: str = "1f1b", microbatches: int = 4) -> dict:
    """A (2,2,1) step traced into ``path``; returns this rank's lowered list as text and the report."""
    torch.manual_seed(0)
    pm = autosplit.parallelize(VARIANTS["timm_cls"](), mesh=mesh, num_microbatches=microbatches,
                               schedule=schedule, sequence_parallel=True)
    xs, ys = batches(2, 8)
    pm.step(xs[0], ys[0])                                   # plan and warm up outside the trace
    report = pm.trace_step(xs[1], ys[1], path)
    items = lower(build_schedule(schedule, mesh[0], microbatches))[pm.pp_rank]
    return {"rank": pm.world.rank, "items": [str(i) for i in items], "table": report.table(),
            "stages": report.stages, "step_time": report.step_time, "predicted": report.predicted_step}
