"""Functions run on every rank of a test pool (see dist_pool.py) for the numerics checks of
tests/test_numerics.py: gradient accumulation under tp x dp, train/eval mode, dropout under tp,
fp16 loss scaling, buffers under dp.  Each returns plain data to assert on."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autosplit
from tests.models import VARIANTS


def _data(steps: int, batch: int, seed: int = 1, classes: int = 7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(steps, batch, 3, 32, 32, generator=g), torch.randint(0, classes, (steps, batch), generator=g)


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


# ---- item 1: no_sync accumulation with tp > 1 and dp > 1 -----------------------------------------
def accumulate_tp_dp(name: str, mesh=(1, 2, 2), micro_steps: int = 3, updates: int = 2, batch: int = 8,
                     lr: float = 0.5, **kw):
    """``updates`` optimizer steps, each accumulating ``micro_steps`` calls of ``pm.step`` (all but the
    last under ``no_sync``), against single-device accumulation of the same batches."""
    torch.manual_seed(0)
    model = VARIANTS[name]()
    ref = copy.deepcopy(model)
    xs, ys = _data(micro_steps * updates, batch)
    dp = mesh[2]
    pm = autosplit.parallelize(model, mesh=mesh, num_microbatches=2,
                               example_input=xs[0, : batch // dp // 2], **kw)
    rows = slice(pm.dp_rank * batch // dp, (pm.dp_rank + 1) * batch // dp)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=lr), torch.optim.SGD(ref.parameters(), lr=lr)
    for u in range(updates):
        for k in range(micro_steps):
            i = u * micro_steps + k
            if k < micro_steps - 1:
                with pm.no_sync():
                    pm.step(xs[i][rows], ys[i][rows])
            else:
                pm.step(xs[i][rows], ys[i][rows])
            F.cross_entropy(ref(xs[i]), ys[i]).backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"param_diff": _max_diff(pm.full_state_dict(), ref.state_dict())}
