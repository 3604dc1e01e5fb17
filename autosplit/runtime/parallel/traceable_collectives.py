"""Tensor-parallel collectives that ``torch.compile`` traces without a graph break.

Terms: see autosplit/tp/ops.py (the graph vocabulary) and runtime/parallel/tp_collectives.py (the eager backend:
process groups, the Watchdog, ``COUNTS``, the backward overlap with deferred weight GEMMs).
  custom op  -- each collective is a ``torch.library`` op in the ``autosplit`` namespace with a fake
                (shape-only) implementation, so dynamo records it as one opaque node and inductor calls
                it as an extern kernel.  Its real implementation is the eager backend's helper, so
                every wait still goes through the Watchdog and is counted.  Why not torch's functional
                collectives: their waits (``wait_tensor``) block in C++, out of the Watchdog's reach, so
                a peer's failure would hang a compiled stage instead of ending every rank with the
                failing rank's message.
  functional -- a custom op may not return (an alias of) its input, so the ops that reduce in place in
                eager mode (``all_reduce``) reduce a copy here; inductor owns the buffers anyway.
  autograd   -- the Functions of runtime/parallel/tp_functions.py, written once for both backends, over
                ``Traced`` (the custom ops) here (dynamo traces a Function's forward and backward;
                AOTAutograd puts the backward ops in the compiled backward graph).  A rank's coordinate
                along an axis (``local_slice``, ``gather``'s backward) is read while tracing and becomes
                a constant of this rank's graph.
  in flight  -- ``all_reduce_start`` returns a *ticket* (a one-element int64 tensor naming the launch)
                with the input; ``wait`` takes the pair and returns the sum.  The ticket is the data
                edge that keeps inductor from reordering the wait before the launch, while the
                compute the graph places between them runs as the collective flies (tp_overlap).
Ordering (NCCL's rule): every tp rank compiles the same graph (the rank constants change no node), and
inductor schedules a graph deterministically, so every rank issues the group's collectives in one order.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import Tensor

from autosplit.runtime.parallel import tp2d_collectives as T2
from autosplit.runtime.parallel import tp_collectives as T
from autosplit.runtime.parallel.tp_functions import functions
from autosplit.tp import ops

_TICKETS = itertools.count()
_LAUNCHED: dict[int, tuple] = {}        # ticket -> (buffer, Work, what): launched, not yet waited


def _size(axis: str) -> int:
    return dist.get_world_size(T._group(axis))


def _dense(x: Tensor) -> Tensor:
    """A fresh row-major copy (the buffer a collective reduces in place)."""
    return torch.clone(x, memory_format=torch.contiguous_format)


def _gathered_shape(x: Tensor, dim: int, n: int, full: int | None) -> list[int]:
    shape = list(x.shape)
    shape[dim] = full if full is not None else n * shape[dim]
    return shape


# ---- the ops: real implementations (the eager helpers) and fake ones (shapes) -------------------------
@torch.library.custom_op("autosplit::all_reduce", mutates_args=())
def all_reduce(x: Tensor, axis: str, count: str, overlap: bool) -> Tensor:
    """Sum over ``axis`` of a copy of ``x``; ``overlap``: a backward input gradient, run the queued
    weight-gradient GEMMs while it flies.  ``count``: the ``COUNTS`` key, "op/fwd" or "op/bwd"."""
    T.COUNTS[tuple(count.split("/"))] += 1
    return (T._all_reduce_overlapped if overlap else T._all_reduce)(_dense(x), axis)


@all_reduce.register_fake
def _(x, axis, count, overlap):
    return x.new_empty(x.shape)


@torch.library.custom_op("autosplit::all_gather", mutates_args=())
def all_gather(x: Tensor, dim: int, axis: str, n: int, full: int | None, count: str) -> Tensor:
    T.COUNTS[tuple(count.split("/"))] += 1
    return T._all_gather(x, dim, axis, full)


@all_gather.register_fake
def _(x, dim, axis, n, full, count):
    return x.new_empty(_gathered_shape(x, dim, n, full))


@torch.library.custom_op("autosplit::reduce_scatter", mutates_args=())
def reduce_scatter(x: Tensor, dim: int, axis: str, n: int, count: str, overlap: bool) -> Tensor:
    """``overlap``: an input gradient (all_gather's backward), whose padding rows are zeros; a forward
    sum's are copies of its last row (``ops.pad``)."""
    T.COUNTS[tuple(count.split("/"))] += 1
    return T._reduce_scatter(x, dim, axis, backward=overlap)


@reduce_scatter.register_fake
def _(x, dim, axis, n, count, overlap):
    shape = list(x.shape)
    shape[dim] = -(-shape[dim] // n)
    return x.new_empty(shape)


@torch.library.custom_op("autosplit::all_to_all", mutates_args=())
def all_to_all(x: Tensor, split_dim: int, cat_dim: int, axis: str, n: int, full: int | None, count: str,
               backward: bool) -> Tensor:
    T.COUNTS[tuple(count.split("/"))] += 1
    return T._all_to_all(_dense(x), split_dim, cat_dim, axis, full, backward)


@all_to_all.register_fake
def _(x, split_dim, cat_dim, axis, n, full, count, backward):
    shape = list(x.shape)
    shape[cat_dim] = full if full is not None else shape[cat_dim] * n
    shape[split_dim] = -(-shape[split_dim] // n)
    return x.new_empty(shape)


@torch.library.custom_op("autosplit::all_reduce_start", mutates_args=())
def all_reduce_start(x: Tensor, axis: str) -> Tensor:
    """Launch the sum of a copy of ``x``; returns its ticket."""
    T.COUNTS[("all_reduce", "fwd")] += 1
    buf, work = T._launch_all_reduce(_dense(x), axis)
    ticket = next(_TICKETS)
    _LAUNCHED[ticket] = (buf, work, f"all_reduce over {axis}")
    return torch.tensor([ticket], dtype=torch.int64)


@all_reduce_start.register_fake
def _(x, axis):
    return torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("autosplit::wait", mutates_args=())
def wait(ticket: Tensor, like: Tensor) -> Tensor:
    """The sum launched under ``ticket`` (``like``: its input, for the shape), once it has arrived."""
    entry = _LAUNCHED.pop(int(ticket.item()), None)
    if entry is None:
        raise RuntimeError("tp wait: no all_reduce_start in flight under this ticket (each launch is waited once)")
    T._wait(entry[1], entry[2])
    return entry[0]


@wait.register_fake
def _(ticket, like):
    return like.new_empty(like.shape)


@torch.library.custom_op("autosplit::linear_2d", mutates_args=())
def linear_2d(x: Tensor, w: Tensor, row: str, col: str, form: str) -> Tensor:
    return T2._linear_2d(x, w, row, col, form)          # counts linear_2d/fwd


@linear_2d.register_fake
def _(x, w, row, col, form):
    return x.new_empty(*x.shape[:-1], w.shape[0])


@torch.library.custom_op("autosplit::linear_2d_backward", mutates_args=())
def linear_2d_backward(x: Tensor, w: Tensor, dy: Tensor, row: str, col: str, form: str) -> tuple[Tensor, Tensor]:
    dx, dw = T2._linear_2d_backward(x, w, dy, row, col, form)   # counts linear_2d/bwd
    return dx.contiguous(), dw.contiguous()


@linear_2d_backward.register_fake
def _(x, w, dy, row, col, form):
    return x.new_empty(x.shape), w.new_empty(w.shape)


# ---- autograd: the Functions of runtime/parallel/tp_functions.py over the custom ops -------------------
class Traced:
    """The traceable transport (tp_functions.py): each collective one custom op, counted inside it; a
    sum always on a copy (a custom op never writes its input, so ``owned`` changes nothing here).  A
    rank's coordinate along an axis is read while tracing and becomes a constant of this rank's graph."""

    size = staticmethod(_size)
    rank = staticmethod(T.Eager.rank)

    @staticmethod
    def note(key: str) -> None:
        """A call that moves nothing: not counted when compiled (its Python does not run in the graph)."""

    @staticmethod
    def all_reduce(x: Tensor, axis: str, key: str, overlap: bool, owned: bool) -> Tensor:
        return all_reduce(x, axis, key, overlap)

    @staticmethod
    def all_gather(x: Tensor, dim: int, axis: str, full: int | None, key: str) -> Tensor:
        return all_gather(x, dim, axis, _size(axis), full, key)

    @staticmethod
    def reduce_scatter(x: Tensor, dim: int, axis: str, key: str, backward: bool) -> Tensor:
        return reduce_scatter(x, dim, axis, _size(axis), key, backward)

    @staticmethod
    def all_to_all(x: Tensor, split_dim: int, cat_dim: int, axis: str, full: int | None, key: str,
                   backward: bool) -> Tensor:
        return all_to_all(x, split_dim, cat_dim, axis, _size(axis), full, key, backward)

    @staticmethod
    def linear_2d(x: Tensor, w: Tensor, row: str, col: str, form: str) -> Tensor:
        return linear_2d(x, w, row, col, form)

    @staticmethod
    def linear_2d_backward(x: Tensor, w: Tensor, dy: Tensor, row: str, col: str, form: str):
        return linear_2d_backward(x, w, dy, row, col, form)


FUNCTIONS = functions(Traced)


class TraceableBackend:
    """What ``autosplit.tp.ops`` calls while dynamo traces a stage (``ops.bind_traceable``)."""

    axis_rank = staticmethod(T.Eager.rank)
    copy_to_axis = staticmethod(FUNCTIONS.Copy.apply)
    all_reduce = staticmethod(FUNCTIONS.AllReduce.apply)

    @staticmethod
    def all_reduce_start(x, axis):
        # launched here and waited at ``wait``'s node: the pair travels as (ticket, input)
        return (all_reduce_start(x, axis), x)

    @staticmethod
    def wait(pair):
        ticket, x = pair
        return _Waited.apply(ticket, x)

    all_gather = staticmethod(FUNCTIONS.AllGather.apply)
    gather = staticmethod(FUNCTIONS.Gather.apply)
    reduce_scatter = staticmethod(FUNCTIONS.ReduceScatter.apply)
    local_slice = staticmethod(FUNCTIONS.Slice.apply)
    all_to_all = staticmethod(FUNCTIONS.AllToAll.apply)

    @staticmethod
    def linear_2d(x, w, row, col, q, form):
        return FUNCTIONS.Linear2D.apply(x, w, row, col, form)

    sum_stats = staticmethod(FUNCTIONS.SumStats.apply)


class _Waited(torch.autograd.Function):
    """``wait`` of a launched sum: the gradient flows to the launch's input unchanged (the sum's)."""

    @staticmethod
    def forward(ctx, ticket, x):
        return wait(ticket, x)

    @staticmethod
    def backward(ctx, grad):
        return None, grad


ops.bind_traceable(TraceableBackend())
