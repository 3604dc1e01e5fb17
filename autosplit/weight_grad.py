"""Weight GEMMs whose backward splits in two: the input gradient now (I), the weight gradient later (W).

Terms:
  split GEMM  -- ``split_linear`` / ``split_conv``: the forward is ``F.linear`` / ``F.conv{1,2,3}d``;
                 the backward returns the input gradient (and the bias gradient, which is cheap), and
                 *defers* the weight-gradient GEMM with the tensors it needs (the input the forward
                 saw and the output gradient) to the store's current key.  With no key set (outside a
                 zero-bubble schedule) the weight gradient is computed and returned at once, as usual.
  key         -- (stage, microbatch): the executor sets it around one I (``DEFERRED.collecting``)
                 and runs its W later (``DEFERRED.run``).
  eager       -- a B (not a zero-bubble I) under tensor parallelism collects too, with ``eager=True``:
                 its weight gradients may run as soon as a collective is in flight
                 (``run_while_communicating``: the tensor-parallel backward all-reduce / reduce-scatter
                 of an entry's input gradient overlaps the weight-gradient GEMMs queued before it,
                 as Megatron's async grad all-reduce does); whatever is left runs at the end of B.
  accumulate  -- W hands each weight gradient to autograd as the gradient of the parameter leaf
                 (``torch.autograd.backward([w], [g])``), so it is *added* into ``.grad`` exactly as a
                 fused backward would add it (tied or reused weights add up, ``.grad`` views of the dp
                 buckets are written in place) and the post-accumulate-grad hooks fire.  Uses of one
                 weight within one key are summed first, so each hook fires once per W.
  autocast    -- the forward casts its floating inputs to the autocast dtype, as autocast would for
                 linear / conv, and runs with autocast off; the backward (which runs without autocast)
                 uses the cast tensors, and autograd casts the gradients back to the parameters' dtype.

Hooks: autograd runs a parameter's post-accumulate-grad hooks even when the backward gave it no
gradient (the split op returns None for the weight), so during I such a hook does not mean the
weight's gradient is complete; whoever counts on those hooks (the dp buckets) must start listening
only after the outer backward, when W is about to run (see runtime/executor.py, *armed*).

The backward runs on autograd's thread for the device (on CUDA not the caller's), which is why the key
is a plain attribute of the store and not thread-local: the executor sets it before ``backward()``
and clears it after, and nothing else runs a backward in between.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


class DeferredWeightGrads:
    """Weight-gradient work queued by I, run by W; one per process (``DEFERRED``)."""

    def __init__(self):
        self.key, self.eager = None, False
        self.pending: dict = {}       # key -> [(weight, fn() -> gradient)]
        self.overlapped = 0           # weight gradients run while a collective was in flight (a count)

    @contextlib.contextmanager
    def collecting(self, key, eager: bool = False):
        """Split GEMMs whose backward runs inside this block defer their weight gradient to ``key``;
        ``eager``: they may run while a collective is in flight (B), not only at the key's W (I)."""
        previous, self.key, self.eager = (self.key, self.eager), key, eager
        try:
            yield
        finally:
            self.key, self.eager = previous

    def run_while_communicating(self) -> None:
        """Called by a backward collective after it launched and before it waits: in an eager key,
        compute the weight gradients queued so far (they overlap the communication)."""
        if self.key is not None and self.eager:
            self.overlapped += len(self.pending.get(self.key, []))
            self.run(self.key)

    def defer(self, weight: torch.Tensor, compute) -> None:
        self.pending.setdefault(self.key, []).append((weight, compute))

    def weights(self, key) -> list[torch.Tensor]:
        """The distinct weights ``run(key)`` will write, in the order they were deferred."""
        seen: dict[int, torch.Tensor] = {}
        for w, _ in self.pending.get(key, []):
            seen.setdefault(id(w), w)
        return list(seen.values())

    def run(self, key) -> None:
        """Compute the weight gradients deferred to ``key`` and add them into the weights' ``.grad``."""
        sums: dict[int, list] = {}
        for w, compute in self.pending.pop(key, []):
            g = compute().to(w.dtype)
            if id(w) in sums:
                sums[id(w)][1] = sums[id(w)][1] + g
            else:
                sums[id(w)] = [w, g]
        if sums:
            weights, grads = zip(*sums.values())
            torch.autograd.backward(list(weights), list(grads))

    def clear(self) -> None:
        """Drop everything queued (after a failed step, so nothing stale is applied later)."""
        self.pending.clear()
        self.key, self.eager = None, False


DEFERRED = DeferredWeightGrads()


def _cast(device_type: str, *tensors):
    """The tensors autocast would hand to a linear / conv: floating ones in the autocast dtype."""
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors)


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        device_type = x.device.type
        xc, wc, bc = _cast(device_type, x, weight, bias)
        with torch.autocast(device_type, enabled=False):
            y = F.linear(xc, wc, bc)                      # (..., out)
        ctx.save_for_backward(xc, wc)
        ctx.weight, ctx.has_bias = weight, bias is not None
        return y

    @staticmethod
    def backward(ctx, grad):
        xc, wc = ctx.saved_tensors
        grad_x = grad.matmul(wc) if ctx.needs_input_grad[0] else None         # (..., in)
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None

        def weight_grad(grad=grad, xc=xc):
            return grad.reshape(-1, grad.shape[-1]).t().mm(xc.reshape(-1, xc.shape[-1]))   # (out, in)

        if not ctx.needs_input_grad[1]:
            return grad_x, None, grad_b
        if DEFERRED.key is None:
            return grad_x, weight_grad(), grad_b
        DEFERRED.defer(ctx.weight, weight_grad)
        return grad_x, None, grad_b


class _SplitConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups):
        device_type = x.device.type
        xc, wc, bc = _cast(device_type, x, weight, bias)
        conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[x.dim()]
        with torch.autocast(device_type, enabled=False):
            y = conv(xc, wc, bc, stride, padding, dilation, groups)
        ctx.save_for_backward(xc, wc)
        ctx.args = (stride, padding, dilation, groups)
        ctx.weight, ctx.bias_sizes = weight, None if bias is None else [bias.shape[0]]
        return y

    @staticmethod
    def backward(ctx, grad):
        xc, wc = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.args
        n = xc.dim() - 2
        args = (ctx.bias_sizes, _tuple(stride, n), _tuple(padding, n), _tuple(dilation, n), False, [0] * n, groups)
        grad_x, _, grad_b = torch.ops.aten.convolution_backward(
            grad, xc, wc, *args, [ctx.needs_input_grad[0], False, ctx.bias_sizes is not None])

        def weight_grad(grad=grad, xc=xc, wc=wc):
            return torch.ops.aten.convolution_backward(grad, xc, wc, *args, [False, True, False])[1]

        none = (None,) * 4
        if not ctx.needs_input_grad[1]:
            return (grad_x, None, grad_b) + none
        if DEFERRED.key is None:
            return (grad_x, weight_grad(), grad_b) + none
        DEFERRED.defer(ctx.weight, weight_grad)
        return (grad_x, None, grad_b) + none


def uses_split_ops(module: nn.Module) -> bool:
    """Does ``module`` (or a submodule, e.g. a checkpointed layer) run a split GEMM?"""
    for m in module.modules():
        if isinstance(m, (SplitLinear, SplitConv)):
            return True
        graph = getattr(m, "graph", None)
        if isinstance(graph, torch.fx.Graph) and any(n.target in (split_linear, split_conv) for n in graph.nodes):
            return True
    return False


def _tuple(value, n: int) -> list[int]:
    return list(value) if isinstance(value, (tuple, list)) else [value] * n


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose weight gradient is deferred (see the module docstring)."""
    return _SplitLinear.apply(x, weight, bias)


def split_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride=1, padding=0,
               dilation=1, groups: int = 1) -> torch.Tensor:
    """``F.conv{1,2,3}d`` (by ``x.dim()``) whose weight gradient is deferred; numeric padding only."""
    return _SplitConv.apply(x, weight, bias, stride, padding, dilation, groups)


class SplitLinear(nn.Module):
    """Stands in for an ``nn.Linear`` (same Parameter objects, same names); ``add_bias=False`` for a
    row-parallel linear, whose bias the graph adds after the all-reduce."""

    def __init__(self, linear: nn.Linear, add_bias: bool = True):
        super().__init__()
        self.weight, self.bias, self.add_bias = linear.weight, linear.bias, add_bias
        self.train(linear.training)

    def forward(self, x):
        return split_linear(x, self.weight, self.bias if self.add_bias else None)


class SplitConv(nn.Module):
    """Stands in for an ``nn.Conv{1,2,3}d`` with zeros padding (same Parameter objects, same names)."""

    def __init__(self, conv: nn.modules.conv._ConvNd):
        super().__init__()
        self.weight, self.bias = conv.weight, conv.bias
        self.stride, self.padding, self.dilation, self.groups = conv.stride, conv.padding, conv.dilation, conv.groups
        self.train(conv.training)

    def forward(self, x):
        return split_conv(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
