"""The tensor-parallel collectives' autograd, written once for the eager and the traceable backend.

Terms: see autosplit/tp/ops.py (the graph vocabulary: copy, all_reduce, all_gather, gather,
reduce_scatter, local_slice, all_to_all, linear_2d, sum_stats).
  transport  -- what moves the bytes, one per backend:
                eager (runtime/parallel/tp_collectives.py ``Eager``): process groups called directly,
                  every wait through the Watchdog; a sum runs *in place* where the caller owns the
                  buffer (Megatron's all-reduce of a fresh partial sum or of a gradient handed over
                  for this backward alone);
                traceable (traceable_collectives.py ``Traced``): ``torch.library`` custom ops that
                  dynamo records as opaque nodes and whose bodies are the eager helpers; a custom op
                  never returns (an alias of) its input, so every sum runs on a copy.
  key        -- ``"name/fwd"`` or ``"name/bwd"``, the ``COUNTS`` entry a call adds to.  A transport's
                collective counts its key where the bytes move (inside the custom op when compiled:
                a compiled graph runs the op's body, not this Python).  ``note(key)`` counts a call
                that moves nothing (a copy's forward); the traceable transport does not count those.
  owned      -- the caller's buffer may be summed in place (eager only; see ``Copy.backward``).

What is NOT shared, and why: the in-flight pair (``all_reduce_start`` / ``wait``) finds its launch by
the tensor's identity in eager mode and by a ticket tensor when traced (inductor may reuse buffers,
and the ticket is the data edge that keeps the wait after the launch); each backend keeps its own.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from autosplit.tp.ops import shard


def functions(tr) -> SimpleNamespace:
    """The autograd Functions of the tp collectives over the transport ``tr`` (module docstring)."""

    class Copy(torch.autograd.Function):
        """Identity forward; its gradient summed over the axis backward (Megatron's f)."""

        @staticmethod
        def forward(ctx, x, axis, owned=False):
            ctx.axis, ctx.owned = axis, owned
            tr.note("copy/fwd")
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            # in place only where the graph says the gradient is this op's alone (``owned``: every reader
            # computes a fresh input gradient, a GEMM's, as Megatron's f before a column-parallel linear).
            # Otherwise autograd may hand the same gradient to other readers (an add passes its one gradient
            # to both operands; a one-row expand or a slice of a cat hands a view of it), and an in-place
            # sum would change what they read (2.5D's cls token: its gradient summed twice).  The backward
            # overlaps the queued weight-gradient GEMMs (``overlap``).
            return tr.all_reduce(grad, ctx.axis, "copy/bwd", overlap=True, owned=ctx.owned), None, None

    class AllReduce(torch.autograd.Function):
        """The sum over the axis forward (Megatron's g); identity backward."""

        @staticmethod
        def forward(ctx, x, axis):
            out = tr.all_reduce(x, axis, "all_reduce/fwd", overlap=False, owned=True)
            if out is x:
                ctx.mark_dirty(x)     # reduced in place: autograd must know x changed
            return out

        @staticmethod
        def backward(ctx, grad):
            tr.note("all_reduce/bwd")
            return grad, None

    class AllGather(torch.autograd.Function):
        """Whole along ``dim`` forward; the gradient reduce-scattered backward."""

        @staticmethod
        def forward(ctx, x, dim, axis, full):
            ctx.dim, ctx.axis = dim, axis
            return tr.all_gather(x, dim, axis, full, "all_gather/fwd")

        @staticmethod
        def backward(ctx, grad):
            return tr.reduce_scatter(grad, ctx.dim, ctx.axis, "all_gather/bwd", backward=True), None, None, None

    class Gather(torch.autograd.Function):
        """Whole along ``dim`` forward, for a reader that runs whole on every rank; this rank's slice
        of the gradient backward (every rank computed the whole gradient)."""

        @staticmethod
        def forward(ctx, x, dim, axis, full):
            ctx.dim, ctx.n, ctx.rank = dim, tr.size(axis), tr.rank(axis)
            return tr.all_gather(x, dim, axis, full, "gather/fwd")

        @staticmethod
        def backward(ctx, grad):
            return shard(grad, ctx.dim, ctx.n, ctx.rank, "zero"), None, None, None

    class ReduceScatter(torch.autograd.Function):
        """The sum's slice of this rank forward; the gradient all-gathered backward."""

        @staticmethod
        def forward(ctx, x, dim, axis):
            ctx.dim, ctx.axis, ctx.full = dim, axis, x.shape[dim]
            return tr.reduce_scatter(x, dim, axis, "reduce_scatter/fwd", backward=False)

        @staticmethod
        def backward(ctx, grad):
            return tr.all_gather(grad, ctx.dim, ctx.axis, ctx.full, "reduce_scatter/bwd"), None, None

    class Slice(torch.autograd.Function):
        """This rank's slice of a whole tensor forward; the gradient all-gathered backward."""

        @staticmethod
        def forward(ctx, x, dim, axis):
            ctx.dim, ctx.axis, ctx.full = dim, axis, x.shape[dim]
            tr.note("local_slice/fwd")
            return shard(x, dim, tr.size(axis), tr.rank(axis), "copy")

        @staticmethod
        def backward(ctx, grad):
            return tr.all_gather(grad, ctx.dim, ctx.axis, ctx.full, "local_slice/bwd"), None, None

    class AllToAll(torch.autograd.Function):
        """Shard(cat_dim) -> Shard(split_dim) forward (cat_dim whole, ``full`` long); the reverse exchange
        of the gradient backward (its ``cat_dim`` split again, padded with zeros)."""

        @staticmethod
        def forward(ctx, x, split_dim, cat_dim, axis, full):
            ctx.dims, ctx.axis, ctx.split_full = (split_dim, cat_dim), axis, x.shape[split_dim]
            return tr.all_to_all(x, split_dim, cat_dim, axis, full, "all_to_all/fwd", backward=False)

        @staticmethod
        def backward(ctx, grad):
            split_dim, cat_dim = ctx.dims
            return tr.all_to_all(grad, cat_dim, split_dim, ctx.axis, ctx.split_full, "all_to_all/bwd",
                                 backward=True), None, None, None, None

    class Linear2D(torch.autograd.Function):
        """2D's ``x @ w.T`` on blocks (tp2d_collectives.py); both forms save only the local blocks."""

        @staticmethod
        def forward(ctx, x, w, row, col, form):
            ctx.save_for_backward(x, w)
            ctx.axes, ctx.form = (row, col), form
            return tr.linear_2d(x, w, row, col, form)

        @staticmethod
        def backward(ctx, dy):
            x, w = ctx.saved_tensors
            dx, dw = tr.linear_2d_backward(x, w, dy, *ctx.axes, ctx.form)
            return dx, dw, None, None, None

    class SumStats(torch.autograd.Function):
        """A sum every rank then uses for its own part (2D layer-norm statistics): summed both ways, on
        copies (the partial statistics are read again by the caller's graph)."""

        @staticmethod
        def forward(ctx, x, axis):
            ctx.axis = axis
            return tr.all_reduce(x, axis, "sum_stats/fwd", overlap=False, owned=False)

        @staticmethod
        def backward(ctx, grad):
            return tr.all_reduce(grad, ctx.axis, "sum_stats/bwd", overlap=False, owned=False), None

    return SimpleNamespace(Copy=Copy, AllReduce=AllReduce, AllGather=AllGather, Gather=Gather,
                           ReduceScatter=ReduceScatter, Slice=Slice, Linear2D=Linear2D, SumStats=SumStats,
                           AllToAll=AllToAll)
