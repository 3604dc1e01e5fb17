"""Functions run on every rank of a test pool (see dist_pool.py) for tests/test_search.py:
``parallelize(mesh="auto")`` against single-device training.  Each returns plain data."""
from __future__ import annotations


import torch

import autosplit
from tests.dist_checks import batches, logged, reference_training
from tests.models import VARIANTS


def auto_mesh_matches_single_device(name: str = "timm_cls", batch: int = 8, steps: int = 3, lr: float = 0.1):
    """Losses and parameters after SGD steps with the search's choice vs one device, and what was logged."""
    records = []
    with logged(records):
        torch.manual_seed(0)
        model = VARIANTS[name]()
        xs, ys = batches(steps, batch)
        ref_losses, ref_state = reference_training(model, xs, ys, lr)
        pm = autosplit.parallelize(model, mesh="auto", global_batch=batch, device="h100",
                                   loss_fn=torch.nn.CrossEntropyLoss())
        opt = torch.optim.SGD(pm.parameters(), lr=lr)
        rows = batch // pm.dp_size
        losses = []
        for x, y in zip(xs, ys):
            sl = slice(pm.dp_rank * rows, (pm.dp_rank + 1) * rows)
            losses.append(pm.step(x[sl], y[sl]))
            opt.step()
            opt.zero_grad()
        state = pm.full_state_dict()
    return {"loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "param_diff": max((state[k] - ref_state[k]).abs().max().item() for k in ref_state),
            "mesh": (pm.plan.mesh.pp, pm.plan.mesh.tp, pm.plan.mesh.dp), "schedule": pm.plan.schedule, "m": pm.plan.num_microbatches,
            "logged": [r for r in records if "strategy search" in r]}


def auto_mesh_errors():
    """mesh='auto' without global_batch, and on CPU without device=: clear errors on every rank."""
    from tests.dist_checks import error_of
    model = VARIANTS["timm_cls"]()
    return [error_of(autosplit.parallelize, model, "auto"),
            error_of(lambda: autosplit.parallelize(model, mesh="auto", global_batch=8))]
