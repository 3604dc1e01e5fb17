"""Collectives over a mesh axis as autograd-correct functions that appear as nodes in stage graphs.

Terms:
  axis      -- a mesh axis name ("tp"); a graph names the axis, not a process group, so plans stay
               pure.  The runtime binds each axis to its process group with ``bind_axis_groups``.
  copy      -- Megatron's "f": identity forward, all-reduce of the gradient backward.  Placed where a
               replicated activation feeds column-parallel layers.
  all_reduce-- Megatron's "g": sum of partial results forward, identity backward (the gradient of a
               sum is the same on every rank).  Placed after row-parallel layers.
  all_gather / reduce_scatter -- along a tensor dim, each the other's backward (sequence parallelism).
  counters  -- ``COUNTS[(name, "fwd"|"bwd")]`` counts calls, so tests can check the communication
               per block is Megatron's minimum.

Every wait goes through the bound Watchdog (deadline, failure of another rank) when one is bound.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

_GROUPS: dict[str, object] = {}
_WATCHDOG = [None]
COUNTS: Counter = Counter()


def bind_axis_groups(groups: dict[str, object], watchdog=None) -> None:
    """Tell the collectives which process group each axis name means (called by the runtime)."""
    _GROUPS.update(groups)
    _WATCHDOG[0] = watchdog


def _group(axis: str):
    if axis not in _GROUPS:
        raise RuntimeError(f"this stage runs tensor-parallel collectives over axis '{axis}', but no process "
                           f"group is bound to it: run stage modules under autosplit.parallelize")
    return _GROUPS[axis]


def _wait(work, what: str) -> None:
    if _WATCHDOG[0] is not None:
        _WATCHDOG[0].wait(work, what)
    else:
        work.wait()


def _all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    x = x.contiguous().clone()
    _wait(dist.all_reduce(x, group=_group(axis), async_op=True), f"all_reduce over {axis}")
    return x


def _all_gather(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    group = _group(axis)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    _wait(dist.all_gather(parts, x.contiguous(), group=group, async_op=True), f"all_gather over {axis}")
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    group = _group(axis)
    n = dist.get_world_size(group)
    total = _all_reduce(x, axis)       # gloo has no reduce_scatter; NCCL would, same result
    return total.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        COUNTS[("copy", "fwd")] += 1
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        COUNTS[("copy", "bwd")] += 1
        return _all_reduce(grad, ctx.axis), None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        COUNTS[("all_reduce", "fwd")] += 1
        return _all_reduce(x, axis)

    @staticmethod
    def backward(ctx, grad):
        COUNTS[("all_reduce", "bwd")] += 1
        return grad, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis):
        ctx.dim, ctx.axis = dim, axis
        COUNTS[("all_gather", "fwd")] += 1
        return _all_gather(x, dim, axis)

    @staticmethod
    def backward(ctx, grad):
        COUNTS[("reduce_scatter", "bwd")] += 1
        return _reduce_scatter(grad, ctx.dim, ctx.axis), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis):
        ctx.dim, ctx.axis = dim, axis
        COUNTS[("reduce_scatter", "fwd")] += 1
        return _reduce_scatter(x, dim, axis)

    @staticmethod
    def backward(ctx, grad):
        COUNTS[("all_gather", "bwd")] += 1
        return _all_gather(grad, ctx.dim, ctx.axis), None, None


def reduce_grad(grad: torch.Tensor, axis: str) -> torch.Tensor:
    """Sum a parameter's partial gradient over the axis (a tensor hook, not a graph node)."""
    COUNTS[("grad_all_reduce", "bwd")] += 1
    return _all_reduce(grad, axis)


def copy_to_axis(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Replicated activation entering column-parallel layers: identity forward, all-reduce backward."""
    return x if x.device.type == "meta" else _Copy.apply(x, axis)


def all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Partial sums -> replicated: all-reduce forward, identity backward."""
    return x.clone() if x.device.type == "meta" else _AllReduce.apply(x, axis)


def all_gather(x: torch.Tensor, dim: int, axis: str, n: int) -> torch.Tensor:
    """Shard(dim) over n ranks -> replicated: all-gather forward, reduce-scatter backward."""
    if x.device.type == "meta":
        return torch.cat([x] * n, dim=dim)
    return _AllGather.apply(x, dim, axis)


def reduce_scatter(x: torch.Tensor, dim: int, axis: str, n: int) -> torch.Tensor:
    """Partial sums -> Shard(dim) over n ranks: reduce-scatter forward, all-gather backward."""
    if x.device.type == "meta":
        return x.chunk(n, dim=dim)[0].clone()
    return _ReduceScatter.apply(x, dim, axis)


def local_slice(x: torch.Tensor, dim: int, axis: str, n: int) -> torch.Tensor:
    """Replicated -> Shard(dim) over n ranks: this rank's slice; the backward all-gathers the gradient."""
    if x.device.type == "meta":
        return x.chunk(n, dim=dim)[0].clone()
    group = _group(axis)
    return _Slice.apply(x, dim, axis, n, dist.get_rank(group))


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis, n, rank):
        ctx.dim, ctx.axis = dim, axis
        return x.chunk(n, dim=dim)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.axis), None, None, None, None


COLLECTIVES = (copy_to_axis, all_reduce, all_gather, reduce_scatter, local_slice)
# What each costs, forward and backward, for the cost model (which reads ``comm_kind``).
for _fn, _kind in ((copy_to_axis, (None, "all_reduce")), (all_reduce, ("all_reduce", None)),
                   (all_gather, ("all_gather", "reduce_scatter")), (reduce_scatter, ("reduce_scatter", "all_gather")),
                   (local_slice, (None, "all_gather"))):
    _fn.comm_kind = _kind
