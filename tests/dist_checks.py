"""Functions run on every rank of a test pool (see dist_pool.py); each returns plain data to assert on."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import autosplit
from tests.models import VARIANTS


def _data(steps: int, batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(steps, batch, 3, 32, 32, generator=g)
    ys = torch.randint(0, 7, (steps, batch), generator=g)
    return xs, ys


def reference_training(model, xs, ys, lr):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in zip(xs, ys):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def train_matches_single_device(name: str, mesh, schedule: str, chunks: int, microbatches: int = 4,
                                batch: int = 8, steps: int = 3, lr: float = 0.1, lazy: bool = False):
    """Losses and full_state_dict after `steps` SGD steps vs single-device training (max abs diffs)."""
    torch.manual_seed(0)
    model = VARIANTS[name]()
    xs, ys = _data(steps, batch)
    ref_losses, ref_state = reference_training(model, xs, ys, lr)
    dp = mesh[2] if mesh[2] > 0 else dist.get_world_size() // (mesh[0] * mesh[1])
    example = None if lazy else xs[0, : batch // dp // microbatches]
    pm = autosplit.parallelize(model, mesh=mesh, loss_fn=torch.nn.CrossEntropyLoss(),
                               num_microbatches=microbatches, schedule=schedule, chunks_per_rank=chunks,
                               example_input=example)
    opt = torch.optim.SGD(pm.parameters(), lr=lr)
    rows = batch // pm.dp_size
    losses = []
    for x, y in zip(xs, ys):
        sl = slice(pm.dp_rank * rows, (pm.dp_rank + 1) * rows)
        losses.append(pm.step(x[sl], y[sl]))
        opt.step()
        opt.zero_grad()
    state = pm.full_state_dict()
    assert set(state) == set(ref_state)
    param_diff = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    return {"loss_diff": loss_diff, "param_diff": param_diff, "losses": losses}
