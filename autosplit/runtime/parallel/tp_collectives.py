"""The runtime half of tensor-parallel collectives: process groups, waits and autograd functions.

Terms: see autosplit/tp/ops.py (the graph vocabulary: axis, copy, all_reduce, all_gather, gather,
reduce_scatter, local_slice).  ``bind_axis_groups`` tells the ops which process group each axis
means and installs this module as their backend; every wait goes through the Watchdog.
  counters -- ``COUNTS[(name, "fwd"|"bwd")]`` counts calls, so tests can check the communication per
              block is Megatron's minimum.
  overlap  -- the backward of ``copy_to_axis`` (all-reduce of an entry's input gradient) and of
              ``all_gather`` (its reduce-scatter) launch the collective, let the weight-gradient GEMMs
              queued so far run (``DEFERRED.run_while_communicating``, autosplit/weight_grad.py), then
              wait: Megatron's async gradient all-reduce.  Every tp rank runs the same backward, so
              the collectives keep one order on every rank of the group (NCCL-safe); the GEMMs in
              between communicate nothing.  ``OVERLAP_BACKWARD = False`` (before building the
              ParallelModule) keeps the fused backward, for measuring what the overlap hides.
  in flight -- ``all_reduce_start`` launches and returns its tensor; ``wait`` finds the launch by that
              tensor's identity (``_IN_FLIGHT``) and waits through the Watchdog.  Both are graph nodes
              (passes/tp_overlap.py), so every rank launches and waits in one order.
  EXPOSED  -- seconds the calling thread spent waiting in tp collectives: ``EXPOSED["input_grad"]``
              for the entries' input-gradient collectives (the ones the overlap hides), ``"other"``
              for the rest: the communication nothing hid.
"""
from __future__ import annotations

import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.profiler import record_function

from autosplit.tp import ops
from autosplit.tp.ops import pad, shard
from autosplit.weight_grad import DEFERRED

_GROUPS: dict[str, object] = {}
_IN_FLIGHT: dict[int, tuple] = {}     # id(tensor) -> (tensor, work, what): launched, not yet waited
_WATCHDOG = [None]
COUNTS: Counter = Counter()
EXPOSED: Counter = Counter()
OVERLAP_BACKWARD = True


def bind_axis_groups(groups: dict[str, object], watchdog=None) -> None:
    """Tell the collectives which process group each axis name means, and make this module the ops'
    backend (called by the runtime when it builds a rank's stages)."""
    _GROUPS.update(groups)
    _WATCHDOG[0] = watchdog
    ops.bind(_Backend())


def unbind_groups(groups) -> None:
    """Forget every axis bound to one of ``groups`` (they are about to be destroyed)."""
    ids = {id(g) for g in groups}
    for axis in [a for a, g in _GROUPS.items() if id(g) in ids]:
        del _GROUPS[axis]


def _group(axis: str):
    if axis not in _GROUPS:
        raise RuntimeError(f"this stage runs tensor-parallel collectives over axis '{axis}', but no process "
                           f"group is bound to it: run stage modules under autosplit.parallelize")
    return _GROUPS[axis]


def _wait(work, what: str, kind: str = "other") -> None:
    t0 = time.perf_counter()
    # a profiler range per collective wait ("autosplit::all_reduce over tp"): pm.trace_step's
    # communication lane (runtime/pipeline/trace_step.py)
    with record_function(f"autosplit::{what}"):
        if _WATCHDOG[0] is not None:
            _WATCHDOG[0].wait(work, what)
        else:
            work.wait()
    EXPOSED[kind] += time.perf_counter() - t0


def _launch_all_reduce(x: torch.Tensor, axis: str):
    """(the tensor being reduced in place, the Work): ``x`` itself, or a contiguous copy of it."""
    x = x.contiguous()
    return x, dist.all_reduce(x, group=_group(axis), async_op=True)


def _all_reduce_overlapped(x: torch.Tensor, axis: str) -> torch.Tensor:
    """``_all_reduce`` of a backward gradient, with the queued weight-gradient GEMMs run while it is in
    flight (see *overlap* in the module docstring)."""
    x, work = _launch_all_reduce(x, axis)
    DEFERRED.run_while_communicating()
    _wait(work, f"all_reduce over {axis}", "input_grad")
    return x


def _all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Sum ``x`` over the axis *in place* (no copy, as Megatron does) and return it.

    Callers own ``x``: the partial sum a row-parallel GEMM just produced, whose only reader is the
    reduction (the tp rewrite routes every other user to the reduced result), or a gradient the
    autograd engine hands over for this backward alone.  A non-contiguous input is reduced in a copy.
    """
    x, work = _launch_all_reduce(x, axis)
    _wait(work, f"all_reduce over {axis}")
    return x


def _all_gather(x: torch.Tensor, dim: int, axis: str, full: int) -> torch.Tensor:
    group = _group(axis)
    x = x.contiguous()          # the received parts must be row-major like what is sent (empty_like keeps strides)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    _wait(dist.all_gather(parts, x, group=group, async_op=True), f"all_gather over {axis}")
    out = torch.cat(parts, dim=dim)
    # a fresh tensor, never a view: a model may write the gathered tensor in place (autograd forbids
    # in-place writes to a custom Function's view output); the padded case drops the padding by copy
    return out if full is None or out.shape[dim] == full else out.narrow(dim, 0, full).clone()


def _reduce_scatter(x: torch.Tensor, dim: int, axis: str, backward: bool = False) -> torch.Tensor:
    """``backward``: an entry's input gradient; the queued weight-gradient GEMMs overlap it."""
    group = _group(axis)
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if dist.get_backend(group) == "nccl":
        chunks = pad(x, dim, n).movedim(dim, 0).contiguous()
        out = torch.empty_like(chunks.chunk(n)[0])
        work = dist.reduce_scatter_tensor(out, chunks, group=group, async_op=True)
        if backward:
            DEFERRED.run_while_communicating()
        _wait(work, f"reduce_scatter over {axis}", "input_grad" if backward else "other")
        return out.movedim(0, dim).contiguous()
    if backward:                                                 # gloo has no reduce_scatter
        return shard(_all_reduce_overlapped(x.clone(), axis), dim, n, rank)
    return shard(_all_reduce(x.clone(), axis), dim, n, rank)


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, owned=False):
        ctx.axis, ctx.owned = axis, owned
        COUNTS[("copy", "fwd")] += 1
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        COUNTS[("copy", "bwd")] += 1
        # in place only where the graph says the gradient is this op's alone (``owned``: every reader
        # computes a fresh input gradient, a GEMM's, as Megatron's f before a column-parallel linear).
        # Otherwise autograd may hand the same gradient to other readers (an add passes its one gradient
        # to both operands; a one-row expand or a slice of a cat hands a view of it), and an in-place
        # sum would change what they read (2.5D's cls token: its gradient summed twice).
        return _all_reduce_overlapped(grad if ctx.owned else grad.clone(), ctx.axis), None, None


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


class _AllReduceStart(_AllReduce):
    """``_AllReduce`` launched, not waited (its backward, identity, is inherited)."""

    @staticmethod
    def forward(ctx, x, axis):
        COUNTS[("all_reduce", "fwd")] += 1
        out, work = _launch_all_reduce(x, axis)     # in place, as _all_reduce (the caller owns x)
        _IN_FLIGHT[id(out)] = (out, work, f"all_reduce over {axis}")
        if out is x:
            ctx.mark_dirty(x)
        return out


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        entry = _IN_FLIGHT.pop(id(x), None)
        if entry is None or entry[0] is not x:
            raise RuntimeError("tp wait: this tensor has no all_reduce_start in flight (the graph must wait on "
                               "the tensor all_reduce_start returned, once)")
        _wait(entry[1], entry[2])
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis, full):
        ctx.dim, ctx.axis = dim, axis
        COUNTS[("all_gather", "fwd")] += 1
        return _all_gather(x, dim, axis, full)

    @staticmethod
    def backward(ctx, grad):
        COUNTS[("all_gather", "bwd")] += 1          # runs a reduce-scatter
        return _reduce_scatter(grad, ctx.dim, ctx.axis, backward=True), None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis, full):
        group = _group(axis)
        ctx.dim, ctx.n, ctx.rank = dim, dist.get_world_size(group), dist.get_rank(group)
        COUNTS[("gather", "fwd")] += 1
        return _all_gather(x, dim, axis, full)

    @staticmethod
    def backward(ctx, grad):
        return shard(grad, ctx.dim, ctx.n, ctx.rank), None, None, None


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
        return shard(x, dim, dist.get_world_size(group), dist.get_rank(group))

    @staticmethod
    def backward(ctx, grad):
        COUNTS[("local_slice", "bwd")] += 1         # runs an all-gather
        return _all_gather(grad, ctx.dim, ctx.axis, ctx.full), None, None


def reduce_grad(grad: torch.Tensor, axis: str) -> torch.Tensor:
    """Sum a parameter's partial gradient over the axis (a tensor hook, not a graph node)."""
    COUNTS[("grad_all_reduce", "bwd")] += 1
    return _all_reduce(grad, axis)




class _Backend:
    """What ``autosplit.tp.ops`` calls on real tensors."""

    @staticmethod
    def axis_rank(axis: str) -> int:
        return dist.get_rank(_group(axis))

    copy_to_axis = staticmethod(_Copy.apply)
    all_reduce = staticmethod(_AllReduce.apply)
    all_reduce_start = staticmethod(_AllReduceStart.apply)
    wait = staticmethod(_Wait.apply)
    all_gather = staticmethod(_AllGather.apply)
    gather = staticmethod(_Gather.apply)
    reduce_scatter = staticmethod(_ReduceScatter.apply)
    local_slice = staticmethod(_Slice.apply)

