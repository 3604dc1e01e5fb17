"""Run on every rank of a test pool (tests/test_batch_norm.py): BatchNorm models under pp, tp and dp
against their single-device reference.

Terms:
  reference -- gradient accumulation on one device over the same microbatches, in the order the
               pipeline runs them: each microbatch forwarded on its own in training mode (its own
               batch statistics, running statistics updated once per microbatch), loss / (dp * m),
               one AdamW step per global batch.  Under dp every replica starts the step from the same
               buffers and the buffers after the step are replica 0's (DDP's broadcast_buffers).
"""
from __future__ import annotations

import copy

import torch

import autosplit
from tests.checks_numerics import accumulation_reference
from tests.dist_checks import batches, train_steps
from tests.models_bn import BN_VARIANTS

STATS = ("running_mean", "running_var", "num_batches_tracked")


def _diff(a: dict, b: dict, keys) -> float:
    keys = list(keys)
    return max(((a[k].double() - b[k].double()).abs().max().item() for k in keys), default=0.0)


def train_matches_accumulation(name: str, mesh, microbatches: int = 2, batch: int = 8, steps: int = 3,
                               lr: float = 1e-2, dtype=torch.float64, **kw) -> dict:
    """``steps`` AdamW steps of ``BN_VARIANTS[name]`` on ``mesh`` against accumulation_reference, then
    one eval-mode predict (which reads the running statistics) against the reference's.

    In float64 by default: these models have parameters whose gradient is exactly zero (a bias right
    before a BatchNorm, which subtracts it again; the key part of a qkv bias, which softmax ignores),
    and AdamW turns float32 rounding noise in such a gradient (1e-9) into steps of lr; in float64 that
    noise is 1e-17 and the comparison can be tight."""
    torch.manual_seed(0)
    model = BN_VARIANTS[name]().to(dtype)
    xs, ys = batches(steps, batch)
    xs = xs.to(dtype)
    dp = mesh[2]
    ref_losses, ref_state = accumulation_reference(copy.deepcopy(model), xs, ys, dp, microbatches, lr,
                                                  torch.optim.AdamW)
    pm = autosplit.parallelize(model, mesh=mesh, loss_fn=torch.nn.CrossEntropyLoss(),
                               num_microbatches=microbatches, example_input=xs[0, : batch // dp // microbatches],
                               **kw)
    rows = slice(pm.dp_rank * batch // dp, (pm.dp_rank + 1) * batch // dp)
    losses = train_steps(pm, torch.optim.AdamW(pm.parameters(), lr=lr), xs, ys, rows)
    state = pm.full_state_dict()
    ref = BN_VARIANTS[name]().to(dtype)
    ref.load_state_dict(ref_state)
    with torch.no_grad():                              # eval mode normalizes with the running statistics
        eval_diff = (pm.eval().predict(xs[0][rows]) - ref.eval()(xs[0][rows])).abs().max().item()
    assert set(state) == set(ref_state), set(state) ^ set(ref_state)
    stats = [k for k in state if k.rsplit(".", 1)[-1] in STATS]
    params = [k for k in state if k not in stats]
    return {"loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "param_diff": _diff(state, ref_state, params), "stats_diff": _diff(state, ref_state, stats),
            "eval_diff": eval_diff, "n_stats": len(stats)}


def parallelize_warnings(name: str = "levit", mesh=(2, 1, 1)) -> dict:
    """The BatchNorm warnings one ``parallelize`` gives on this rank, through a provisional plan (the
    model declares its input size; no example_input) and the first step's re-plan."""
    import warnings

    from autosplit.passes.batch_norm import BatchNormStatisticsWarning
    torch.manual_seed(0)
    model = BN_VARIANTS[name]()
    model.default_cfg = {"input_size": (3, 32, 32)}
    xs, ys = batches(1, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = autosplit.parallelize(model, mesh=mesh, num_microbatches=2)
        list(pm.parameters())                      # the provisional plan (microbatch of 2: BatchNorm)
        provisional = pm.plan.example_shapes[0][0]
        pm.step(xs[0], ys[0])                      # re-planned for microbatches of 4
    return {"warnings": [str(w.message) for w in caught if issubclass(w.category, BatchNormStatisticsWarning)],
            "summary": pm.plan.summary(), "rank": pm.world.rank,
            "rows": (provisional, pm.plan.example_shapes[0][0])}
