"""Collectives over a mesh axis as autograd-correct functions that appear as nodes in stage graphs.

Terms:
  axis      -- a mesh axis name ("tp"); a graph names the axis, not a process group, so plans stay
               pure.  The runtime binds each axis to its process group with ``bind_axis_groups``.
  copy      -- Megatron's "f": identity forward, all-reduce of the gradient backward.  Placed where a
               replicated activation feeds column-parallel layers.
  all_reduce-- Megatron's "g": sum of partial results forward, identity backward.
  all_gather / reduce_scatter / local_slice -- along a tensor dim (the token dim in sequence
               parallelism); each one's backward is another of them.  ``all_gather`` feeds
               column-parallel layers, whose input gradients are partial sums (so its backward
               reduce-scatters); ``gather`` feeds replicated ops, whose gradients are already whole
               (so its backward only slices).  ``full`` is the unsharded size
               of that dim: when it does not divide by n, shards are ceil(full / n) long and the last
               rank's is padded with zeros (padding never reaches the unsharded tensor).
  counters  -- ``COUNTS[(name, "fwd"|"bwd")]`` counts calls, so tests can check the communication
               per block is Megatron's minimum.
On meta tensors every collective only computes its output's shape (used while planning).
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F

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


def _pad(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    extra = -x.shape[dim] % n
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return F.pad(x, pad)


def _shard(x: torch.Tensor, dim: int, n: int, rank: int) -> torch.Tensor:
    return _pad(x, dim, n).chunk(n, dim=dim)[rank].contiguous()


def _all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Sum ``x`` over the axis *in place* (no copy, as Megatron does) and return it.

    Callers own ``x``: the partial sum a row-parallel GEMM just produced, whose only reader is the
    reduction (the tp rewrite routes every other user to the reduced result), or a gradient the
    autograd engine hands over for this backward alone.  A non-contiguous input is reduced in a copy.
    """
    x = x.contiguous()
    _wait(dist.all_reduce(x, group=_group(axis), async_op=True), f"all_reduce over {axis}")
    return x


def _all_gather(x: torch.Tensor, dim: int, axis: str, full: int) -> torch.Tensor:
    group = _group(axis)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    _wait(dist.all_gather(parts, x.contiguous(), group=group, async_op=True), f"all_gather over {axis}")
    return torch.cat(parts, dim=dim).narrow(dim, 0, full)


def _reduce_scatter(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    group = _group(axis)
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if dist.get_backend(group) == "nccl":
        chunks = _pad(x, dim, n).movedim(dim, 0).contiguous()
        out = torch.empty_like(chunks.chunk(n)[0])
        _wait(dist.reduce_scatter_tensor(out, chunks, group=group, async_op=True), f"reduce_scatter over {axis}")
        return out.movedim(0, dim).contiguous()
    return _shard(_all_reduce(x.clone(), axis), dim, n, rank)     # gloo has no reduce_scatter


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
        out = _all_reduce(x, axis)
        if out is x:
            ctx.mark_dirty(x)     # reduced in place: autograd must know x changed
        return out

    @staticmethod
    def backward(ctx, grad):
        COUNTS[("all_reduce", "bwd")] += 1
        return grad, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis, full):
        ctx.dim, ctx.axis = dim, axis
        COUNTS[("all_gather", "fwd")] += 1
        return _all_gather(x, dim, axis, full)

    @staticmethod
    def backward(ctx, grad):
        COUNTS[("all_gather", "bwd")] += 1          # runs a reduce-scatter
        return _reduce_scatter(grad, ctx.dim, ctx.axis), None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis, full):
        group = _group(axis)
        ctx.dim, ctx.n, ctx.rank = dim, dist.get_world_size(group), dist.get_rank(group)
        COUNTS[("gather", "fwd")] += 1
        return _all_gather(x, dim, axis, full)

    @staticmethod
    def backward(ctx, grad):
        return _shard(grad, ctx.dim, ctx.n, ctx.rank), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis):
        ctx.dim, ctx.axis, ctx.full = dim, axis, x.shape[dim]
        COUNTS[("reduce_scatter", "fwd")] += 1
        return _reduce_scatter(x, dim, axis)

    @staticmethod
    def backward(ctx, grad):
        COUNTS[("reduce_scatter", "bwd")] += 1      # runs an all-gather
        return _all_gather(grad, ctx.dim, ctx.axis, ctx.full), None, None


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis):
        group = _group(axis)
        ctx.dim, ctx.axis, ctx.full = dim, axis, x.shape[dim]
        COUNTS[("local_slice", "fwd")] += 1
        return _shard(x, dim, dist.get_world_size(group), dist.get_rank(group))

    @staticmethod
    def backward(ctx, grad):
        COUNTS[("local_slice", "bwd")] += 1         # runs an all-gather
        return _all_gather(grad, ctx.dim, ctx.axis, ctx.full), None, None


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


def all_gather(x: torch.Tensor, dim: int, axis: str, n: int, full: int) -> torch.Tensor:
    """Shard(dim) over n ranks -> replicated, ``full`` long: all-gather forward, reduce-scatter backward."""
    if x.device.type == "meta":
        return torch.cat([x] * n, dim=dim).narrow(dim, 0, full).clone()
    return _AllGather.apply(x, dim, axis, full)


def gather(x: torch.Tensor, dim: int, axis: str, n: int, full: int) -> torch.Tensor:
    """Shard(dim) -> replicated for replicated consumers (a classifier head): all-gather forward; the
    gradient is already whole on every rank, so the backward only keeps this rank's slice."""
    if x.device.type == "meta":
        return torch.cat([x] * n, dim=dim).narrow(dim, 0, full).clone()
    return _Gather.apply(x, dim, axis, full)


def reduce_scatter(x: torch.Tensor, dim: int, axis: str, n: int) -> torch.Tensor:
    """Partial sums -> Shard(dim) over n ranks: reduce-scatter forward, all-gather backward."""
    if x.device.type == "meta":
        return _shard(x, dim, n, 0).clone()
    return _ReduceScatter.apply(x, dim, axis)


def local_slice(x: torch.Tensor, dim: int, axis: str, n: int) -> torch.Tensor:
    """Replicated -> Shard(dim) over n ranks: this rank's slice forward, all-gather backward."""
    if x.device.type == "meta":
        return _shard(x, dim, n, 0).clone()
    return _Slice.apply(x, dim, axis)


# What each costs, forward and backward, for the cost model (which reads ``comm_kind``).
for _fn, _kind in ((copy_to_axis, (None, "all_reduce")), (all_reduce, ("all_reduce", None)),
                   (all_gather, ("all_gather", "reduce_scatter")), (reduce_scatter, ("reduce_scatter", "all_gather")),
                   (local_slice, (None, "all_gather")), (gather, ("all_gather", None))):
    _fn.comm_kind = _kind
