"""Functions run on every rank of a test pool for tests/test_tp2d.py (see dist_pool.py)."""
from __future__ import annotations

import copy

import torch

import autosplit
from tests.models import VARIANTS


def load_round_trip(name: str, mesh=(1, 4, 1)) -> dict:
    """load_full_state_dict puts each rank's 2D blocks in place: full_state_dict gives the loaded values
    back, and the loss equals the source model's on one batch."""
    torch.manual_seed(0)
    model = VARIANTS[name]()
    torch.manual_seed(1)
    other = VARIANTS[name]()                     # other values, same keys and shapes
    x, y = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(2)), torch.arange(4) % 7
    pm = autosplit.parallelize(model, mesh=mesh, num_microbatches=1, tp_mode="2d", example_input=x)
    pm.load_full_state_dict(other.state_dict())
    back = pm.full_state_dict()
    diff = max((back[k] - v).abs().max().item() for k, v in other.state_dict().items())
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(other(x), y).item()
    pm.eval()
    loss = torch.nn.functional.cross_entropy(pm.predict(x), y).item()
    return {"state_diff": diff, "loss_diff": abs(loss - ref)}


def clip_norm_matches(name: str, mesh=(1, 4, 1)) -> dict:
    """clip_grad_norm_ returns the single-device gradient norm: every parameter counted once, including
    those 2D splits over tp_col only (a 10-class head's bias: 5 per column, whole over tp_row)."""
    torch.manual_seed(0)
    model = VARIANTS[name]()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()])).item()
    pm = autosplit.parallelize(model, mesh=mesh, num_microbatches=2, tp_mode="2d", example_input=x[:4])
    pm.step(x, y)
    return {"norm_diff": abs(pm.clip_grad_norm_(1e9) - want), "norm": want}
