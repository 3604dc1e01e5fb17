"""Padded sequence-parallel splits stay finite: models and checks run on every rank of a test pool
(tests/test_sp_padding.py).

Terms:
  padded split -- a dim split over tp ranks that tp does not divide (a class token's 17 tokens on 2 or
                  4 ranks): each rank holds ceil(17 / tp) rows, the last rank's ending in padding rows.
  ghost row    -- a padding row.  Its values reach no output, but a row-wise op computes on it, and a
                  parameter's gradient sums over every row, ghost rows included: a ghost row that is
                  not finite makes the real gradients NaN (0 * inf in the backward).
  zero-unsafe  -- a row-wise op that is not finite on a zero row: ``x * rsqrt(mean(x**2))`` and
                  ``x / x.norm()``, written by hand without an epsilon ("rsqrt", "normdiv").
"""
from __future__ import annotations

import copy
import math
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autosplit
from autosplit.runtime.parallel import tp_collectives as T
from autosplit.runtime.parallel import traceable_collectives as TC
from tests.dist_checks import batches, reference_training, train_steps

AXIS = "sp_padding"          # an axis name no ParallelModule binds (the check binds and unbinds it)


def scale_rows(x: torch.Tensor, norm: str, g: torch.Tensor) -> torch.Tensor:
    """A zero-unsafe normalisation of each row (B, N, C) -> (B, N, C), with a gain g (C,)."""
    if norm == "rsqrt":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * g
    return x / x.norm(dim=-1, keepdim=True) * g


class _Scale(nn.Module):
    def __init__(self, dim: int, norm: str):
        super().__init__()
        self.norm, self.g = norm, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return scale_rows(x, self.norm, self.g)


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, norm: str):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = _Scale(dim, norm), _Scale(dim, norm)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):                                                  # (B, N, C)
        B, N, C = x.shape
        q, k, v = self.qkv(self.n1(x)).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4) \
            .unbind(0)                                                     # (B, H, N, d)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.n2(x))))


class ClassTokenViT(nn.Module):
    """A 32 px ViT with a class token (16 patches + 1 = 17 tokens: no tp divides them) whose every norm
    is the zero-unsafe ``norm``; the head reads the class token."""

    def __init__(self, norm: str, img: int = 32, patch: int = 8, dim: int = 32, depth: int = 2, heads: int = 4,
                 classes: int = 7):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (img // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(_Block(dim, heads, norm) for _ in range(depth))
        self.norm, self.head = _Scale(dim, norm), nn.Linear(dim, classes)

    def forward(self, x):                                                  # (B, 3, H, W)
        x = self.embed(x).flatten(2).transpose(1, 2)                       # (B, 16, C)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos   # (B, 17, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])                               # (B, classes)


def sp_training(norm: str, mesh, steps: int = 3, batch: int = 8, microbatches: int = 2, lr: float = 0.1,
                backend: str | None = None) -> dict:
    """``steps`` SGD steps of ClassTokenViT(norm) with sequence parallelism vs one device: the largest
    loss and parameter differences, the losses, and whether every loss was finite.  ``backend``: compile
    the stages with that torch.compile backend (the traceable collectives)."""
    if backend is not None:
        torch._dynamo.reset()                 # no graphs (and their fake tensors) of an earlier check
    torch.manual_seed(0)
    model = ClassTokenViT(norm)
    xs, ys = batches(steps, batch)
    ref_losses, ref_state = reference_training(model, xs, ys, lr)
    pm = autosplit.parallelize(copy.deepcopy(model), mesh=mesh, loss_fn=nn.CrossEntropyLoss(),
                               num_microbatches=microbatches, example_input=xs[0, : batch // microbatches],
                               sequence_parallel=True,
                               compile_stages={"backend": backend} if backend is not None else False)
    losses = train_steps(pm, torch.optim.SGD(pm.parameters(), lr=lr), xs, ys, slice(None))
    state = pm.full_state_dict()
    pm.close()
    if backend is not None:
        torch._dynamo.reset()
    return {"loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "param_diff": max((state[k] - ref_state[k]).abs().max().item() for k in ref_state),
            "losses": losses, "finite": all(math.isfinite(v) for v in losses)}


def _through(be, x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, norm: str, path: str, n: int, rank: int):
    """One rank's padded region: x (B, N, C) enters split on dim 1 by ``path`` ("slice": a slice of the
    replicated x, left by a gather; "scatter": reduce-scattered from partial sums x * c_rank, left by
    an all-gather into a column-parallel consumer), goes through ``scale_rows``: the loss, and the
    region's local output (B, ceil(N / n), C), ghost rows included."""
    N = x.shape[1]
    if path == "slice":
        part = be.local_slice(x, 1, AXIS)                                  # (B, ceil(N/n), C)
        y = scale_rows(part, norm, g)
        return (be.gather(y, 1, AXIS, N) * w).sum(), y
    c = (rank + 1) / (n * (n + 1) / 2)                                     # the ranks' c sum to 1
    part = be.reduce_scatter(x * c, 1, AXIS)                               # (B, ceil(N/n), C)
    y = scale_rows(part, norm, g)
    # every rank's consumer reads the whole gathered tensor: its gradient is 1/n of the loss's on each
    return (be.all_gather(y, 1, AXIS, N) * w).sum() / n, y


def padded_collectives(norm: str, traceable: bool, nccl_branch: bool = False, tokens: int = 17) -> dict:
    """Each padded collective of one backend (eager ``tp_collectives`` or ``traceable_collectives`` run
    eagerly) forward and backward against one process: the largest differences of the loss and of
    the gradients of x and g, whether the ghost rows are finite, and whether they equal the last real
    row.  ``nccl_branch``: the reduce-scatter takes its NCCL branch (``reduce_scatter_tensor`` of the
    padded partial sums, which gloo also runs) instead of gloo's all-reduce and slice."""
    n, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(n)))
    T.bind_axis_groups({AXIS: group})
    be = TC.TraceableBackend() if traceable else T._Backend()
    real = get_backend = dist.get_backend
    if nccl_branch:
        get_backend = lambda g=None: "nccl" if g is group else real(g)    # noqa: E731
    g0 = torch.Generator().manual_seed(3)
    x0, w = torch.randn(2, tokens, 8, generator=g0), torch.randn(2, tokens, 8, generator=g0)
    gain0 = torch.rand(8, generator=g0) + 0.5
    out = {}
    try:
        with mock.patch.object(T.dist, "get_backend", get_backend):
            for path in ("slice", "scatter"):
                x, g = x0.clone().requires_grad_(), gain0.clone().requires_grad_()
                loss, y = _through(be, x, g, w, norm, path, n, rank)
                loss.backward()
                rx, rg = x0.clone().requires_grad_(), gain0.clone().requires_grad_()
                ref = (scale_rows(rx, norm, rg) * w).sum()
                ref.backward()
                # a slice's x gradient is whole on every rank; a scatter's is its share c_rank of it
                dx = x.grad if path == "slice" else x.grad.clone()
                dg = g.grad.clone()
                dist.all_reduce(dg, group=group)      # each rank's gain gradient: its own rows' part
                if path == "scatter":
                    dist.all_reduce(dx, group=group)
                local = -(-tokens // n)
                ghost = y[:, min(local, max(0, tokens - rank * local)):]       # this rank's padding rows
                last = scale_rows(x0[:, -1:], norm, gain0)                     # (B, 1, C): the last real row's
                whole = loss.item() * (n if path == "scatter" else 1)          # the scatter's loss is 1/n
                out[path] = {"loss": abs(whole - ref.item()),
                             "dx": (dx - rx.grad).abs().max().item(), "dg": (dg - rg.grad).abs().max().item(),
                             "ghost_rows": ghost.shape[1], "ghost_finite": bool(ghost.isfinite().all()),
                             "ghost_copies": torch.allclose(ghost, last.expand_as(ghost), atol=1e-6)}
    finally:
        T.unbind_groups([group])
        dist.destroy_process_group(group)
    return out
