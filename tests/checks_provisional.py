"""Checks run on a pool by tests/test_provisional_rows.py: a grid tp mode's provisional plan (no
example_input) and the first step's re-plan."""
from __future__ import annotations

import torch

import autosplit
from tests.dist_checks import error_of, train_matches_single_device
from tests.models import VARIANTS


def grid_without_example(mesh, tp_mode: str, **kw):
    """``train_matches_single_device`` with no example_input: ``parameters()`` plans provisionally from
    the model's declared input size, the first step re-plans for its microbatches (4 rows here)."""
    return train_matches_single_device("tp_timm", mesh, "1f1b", 1, microbatches=2, batch=8, steps=2,
                                       lazy=True, tp_mode=tp_mode, device="h100", **kw)


def grid_wrong_rows(mesh, tp_mode: str):
    """A provisional grid plan, then a step whose microbatches (3 rows) do not divide by q: the clear
    error on every rank; then a step of rows that do divide still trains."""
    torch.manual_seed(0)
    pm = autosplit.parallelize(VARIANTS["tp_timm"](), mesh=mesh, num_microbatches=2, tp_mode=tp_mode, device="h100")
    list(pm.parameters())                 # plans provisionally, as an optimizer built over them does
    out = {"provisional": [tuple(s) for s in pm.plan.example_shapes],
           "wrong": error_of(pm.step, torch.randn(6, 3, 32, 32), torch.randint(0, 10, (6,))),
           "ok_after": pm.step(torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))}
    pm.close()
    return out
