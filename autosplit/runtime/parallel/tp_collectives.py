"""The runtime half of tensor-parallel collectives: process groups, waits, and the eager transport of
the autograd functions (written once for both backends in runtime/parallel/tp_functions.py).

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

from autosplit.runtime.parallel.tp_functions import functions
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


def _all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, axis: str, full: int | None,
                backward: bool = False) -> torch.Tensor:
    """``x``'s ``split_dim`` cut in n (padded first where n does not divide it: an activation with copies of
    its last row, a gradient with zeros, as ``ops.pad``), piece j to rank j; the pieces received joined
    along ``cat_dim`` (``full`` long: the sender's padding dropped)."""
    group = _group(axis)
    n = dist.get_world_size(group)
    parts = [c.contiguous() for c in pad(x, split_dim, n, "zero" if backward else "copy").chunk(n, dim=split_dim)]
    received = [torch.empty_like(parts[0]) for _ in range(n)]
    _wait(dist.all_to_all(received, parts, group=group, async_op=True), f"all_to_all over {axis}")
    out = torch.cat(received, dim=cat_dim)
    return out if full is None or out.shape[cat_dim] == full else out.narrow(cat_dim, 0, full).clone()


def _reduce_scatter(x: torch.Tensor, dim: int, axis: str, backward: bool = False) -> torch.Tensor:
    """``backward``: an entry's input gradient; the queued weight-gradient GEMMs overlap it, and a padded
    split pads it with zeros (an activation with copies of its last row: ``ops.pad``)."""
    group = _group(axis)
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    fill = "zero" if backward else "copy"
    if dist.get_backend(group) == "nccl":
        # each rank pads its partial sum with copies of its last row: their sum is the summed last row
        chunks = pad(x, dim, n, fill).movedim(dim, 0).contiguous()
        out = torch.empty_like(chunks.chunk(n)[0])
        work = dist.reduce_scatter_tensor(out, chunks, group=group, async_op=True)
        if backward:
            DEFERRED.run_while_communicating()
        _wait(work, f"reduce_scatter over {axis}", "input_grad" if backward else "other")
        return out.movedim(0, dim).contiguous()
    if backward:                                                 # gloo has no reduce_scatter
        return shard(_all_reduce_overlapped(x.clone(), axis), dim, n, rank, fill)
    return shard(_all_reduce(x.clone(), axis), dim, n, rank, fill)


class Eager:
    """The transport of the eager backend (runtime/parallel/tp_functions.py): process groups called
    directly, each call counted where its bytes move."""

    @staticmethod
    def rank(axis: str) -> int:
        return dist.get_rank(_group(axis))

    @staticmethod
    def size(axis: str) -> int:
        return dist.get_world_size(_group(axis))

    @staticmethod
    def note(key: str) -> None:
        COUNTS[tuple(key.split("/"))] += 1

    @staticmethod
    def all_reduce(x: torch.Tensor, axis: str, key: str, overlap: bool, owned: bool) -> torch.Tensor:
        """``owned``: the caller's buffer is summed in place (``_all_reduce``), else a copy of it."""
        Eager.note(key)
        x = x if owned else x.clone()
        return (_all_reduce_overlapped if overlap else _all_reduce)(x, axis)

    @staticmethod
    def all_gather(x: torch.Tensor, dim: int, axis: str, full: int | None, key: str) -> torch.Tensor:
        Eager.note(key)
        return _all_gather(x, dim, axis, full)

    @staticmethod
    def reduce_scatter(x: torch.Tensor, dim: int, axis: str, key: str, backward: bool) -> torch.Tensor:
        Eager.note(key)
        return _reduce_scatter(x, dim, axis, backward=backward)

    @staticmethod
    def all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, axis: str, full: int | None, key: str,
                   backward: bool) -> torch.Tensor:
        Eager.note(key)
        return _all_to_all(x, split_dim, cat_dim, axis, full, backward)

    # linear_2d / linear_2d_backward: tp2d_collectives.py adds them (it builds on the helpers above)


FUNCTIONS = functions(Eager)


class _AllReduceStart(torch.autograd.Function):
    """The forward all-reduce launched, not waited; identity backward."""

    @staticmethod
    def forward(ctx, x, axis):
        COUNTS[("all_reduce", "fwd")] += 1
        out, work = _launch_all_reduce(x, axis)     # in place, as _all_reduce (the caller owns x)
        _IN_FLIGHT[id(out)] = (out, work, f"all_reduce over {axis}")
        if out is x:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        COUNTS[("all_reduce", "bwd")] += 1
        return grad, None


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


def reduce_grad(grad: torch.Tensor, axis: str) -> torch.Tensor:
    """Sum a parameter's partial gradient over the axis (a tensor hook, not a graph node)."""
    COUNTS[("grad_all_reduce", "bwd")] += 1
    return _all_reduce(grad, axis)


class _Backend:
    """What ``autosplit.tp.ops`` calls on real tensors."""

    axis_rank = staticmethod(Eager.rank)
    copy_to_axis = staticmethod(FUNCTIONS.Copy.apply)
    all_reduce = staticmethod(FUNCTIONS.AllReduce.apply)
    all_reduce_start = staticmethod(_AllReduceStart.apply)
    wait = staticmethod(_Wait.apply)
    all_gather = staticmethod(FUNCTIONS.AllGather.apply)
    gather = staticmethod(FUNCTIONS.Gather.apply)
    reduce_scatter = staticmethod(FUNCTIONS.ReduceScatter.apply)
    local_slice = staticmethod(FUNCTIONS.Slice.apply)
    all_to_all = staticmethod(FUNCTIONS.AllToAll.apply)

    @staticmethod
    def linear_2d(x, w, row: str, col: str, q: int, form: str):
        return FUNCTIONS.Linear2D.apply(x, w, row, col, form)

    sum_stats = staticmethod(FUNCTIONS.SumStats.apply)
