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
  accumulate  -- W adds each weight gradient into ``.grad`` exactly as a fused backward would (tied or
                 reused weights add up, never overwrite).  A weight without autograd hooks gets its
                 gradient written straight into ``.grad`` by the GEMM itself (``addmm_`` on the 2-D
                 views, or a fresh ``mm`` the first time): no temporary, no separate add, no autograd
                 engine call.  A weight with hooks (the dp buckets' post-accumulate-grad hooks, a
                 tensor hook) is handed to autograd as the gradient of the parameter leaf
                 (``torch.autograd.backward([w], [g])``), so its hooks fire; uses of one such weight
                 within one key are summed first, so each hook fires once per W.
  autocast    -- the forward casts its floating inputs to the autocast dtype, as autocast would for
                 linear / conv, and runs with autocast off; the backward (which runs without autocast)
                 uses the cast tensors, and autograd casts the gradients back to the parameters' dtype.

Hooks: autograd runs a parameter's post-accumulate-grad hooks even when the backward gave it no
gradient (the split op returns None for the weight), so during I such a hook does not mean the
weight's gradient is complete; whoever counts on those hooks (the dp buckets) must start listening
only after the outer backward, when W is about to run (see runtime/pipeline/executor.py, *armed*).

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

    def defer(self, weight: torch.Tensor, work) -> None:
        """Queue ``work`` (a ``_LinearW`` / ``_ConvW``: ``grad()`` returns the weight gradient,
        ``add_to(out)`` adds it into ``out`` in place if it can) for ``weight`` under the current key."""
        self.pending.setdefault(self.key, []).append((weight, work))

    def weights(self, key) -> list[torch.Tensor]:
        """The distinct weights ``run(key)`` will write, in the order they were deferred."""
        seen: dict[int, torch.Tensor] = {}
        for w, _ in self.pending.get(key, []):
            seen.setdefault(id(w), w)
        return list(seen.values())

    def run(self, key) -> None:
        """Compute the weight gradients deferred to ``key`` and add them into the weights' ``.grad``."""
        hooked: dict[int, list] = {}
        with torch.no_grad():
            for w, work in self.pending.pop(key, []):
                if _has_hooks(w):
                    g = work.grad().to(w.dtype)
                    if id(w) in hooked:
                        hooked[id(w)][1] += g
                    else:
                        hooked[id(w)] = [w, g]
                elif w.grad is None:
                    w.grad = work.grad().to(w.dtype).view_as(w)     # first write: the GEMM's own output
                elif not work.add_to(w.grad):
                    w.grad.add_(work.grad().to(w.grad.dtype))
        if hooked:
            weights, grads = zip(*hooked.values())
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


def _no_autocast(device_type: str, fn, *args):
    """``fn(*args)`` with autocast off (the inputs are cast already); no context manager when it is off."""
    if not torch.is_autocast_enabled(device_type):
        return fn(*args)
    with torch.autocast(device_type, enabled=False):
        return fn(*args)


def _has_hooks(w: torch.Tensor) -> bool:
    """Does autograd run hooks when ``w`` receives a gradient?  torch has no public query for a tensor's
    hooks; these attributes are where ``register_hook`` / ``register_post_accumulate_grad_hook`` keep
    them.  Unknown (another torch) counts as hooked: the autograd path is always right, only slower."""
    if not (hasattr(w, "_backward_hooks") and hasattr(w, "_post_accumulate_grad_hooks")):
        return True
    return bool(w._backward_hooks) or bool(w._post_accumulate_grad_hooks) or not w.is_contiguous()


class _LinearW:
    """The weight gradient of one linear: dW = dY^T X on the 2-D views, (out, in)."""
    __slots__ = ("g2", "x")

    def __init__(self, g2: torch.Tensor, x: torch.Tensor):
        self.g2, self.x = g2, x                              # (rows, out), (..., in)

    def grad(self) -> torch.Tensor:
        return self.g2.t().mm(self.x.reshape(-1, self.x.shape[-1]))

    def add_to(self, out: torch.Tensor) -> bool:
        if out.dtype != self.g2.dtype or not out.is_contiguous():
            return False
        out.addmm_(self.g2.t(), self.x.reshape(-1, self.x.shape[-1]))
        return True


class _ConvW:
    """The weight gradient of one convolution (``aten.convolution_backward``, weight only)."""
    __slots__ = ("grad_out", "x", "w", "args")

    def __init__(self, grad_out, x, w, args):
        self.grad_out, self.x, self.w, self.args = grad_out, x, w, args

    def grad(self) -> torch.Tensor:
        return torch.ops.aten.convolution_backward(self.grad_out, self.x, self.w, *self.args,
                                                   [False, True, False])[1]

    def add_to(self, out: torch.Tensor) -> bool:
        return False


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        xc, wc, bc = _cast(x.device.type, x, weight, bias)
        y = _no_autocast(x.device.type, F.linear, xc, wc, bc)          # (..., out)
        ctx.save_for_backward(xc, wc)
        ctx.weight, ctx.has_bias = weight, bias is not None
        # F.linear of a (B, N, C) input returns a view of its (B*N, out) GEMM result, and autograd forbids
        # writing in place into a view a custom Function returns (torch.sigmoid_(y) would raise): hand
        # it over as a plain tensor on the same storage, as torch's own matmul does (no copy; nothing
        # else holds the GEMM result)
        return torch.ops.aten._unsafe_view(y, y.shape) if y._is_view() else y

    @staticmethod
    def backward(ctx, grad):                              # grad: (..., out)
        xc, wc = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])             # (rows, out): one copy at most, shared with W
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_x = g2.mm(wc).view(*grad.shape[:-1], wc.shape[1]) if need_x else None     # (..., in)
        grad_b = g2.sum(0) if ctx.has_bias and need_b else None
        if not need_w:
            return grad_x, None, grad_b
        work = _LinearW(g2, xc)
        if DEFERRED.key is None:
            return grad_x, work.grad(), grad_b
        DEFERRED.defer(ctx.weight, work)
        return grad_x, None, grad_b


class _SplitConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups):
        xc, wc, bc = _cast(x.device.type, x, weight, bias)
        conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[x.dim()]
        y = _no_autocast(x.device.type, conv, xc, wc, bc, stride, padding, dilation, groups)
        ctx.save_for_backward(xc, wc)
        ctx.args = (stride, padding, dilation, groups)
        ctx.weight, ctx.bias_sizes = weight, None if bias is None else [bias.shape[0]]
        return y

    @staticmethod
    def backward(ctx, grad):                              # grad: (B, C_out, *spatial)
        xc, wc = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.args
        n = xc.dim() - 2
        args = (ctx.bias_sizes, _tuple(stride, n), _tuple(padding, n), _tuple(dilation, n), False, [0] * n, groups)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = None
        if need_x:
            grad_x = torch.ops.aten.convolution_backward(grad, xc, wc, *args, [True, False, False])[0]
        # the bias gradient is a sum over batch and space (convolution_backward would cost a weight GEMM)
        grad_b = grad.sum([0] + list(range(2, grad.dim()))) if ctx.bias_sizes is not None and need_b else None
        none = (None,) * 4
        if not need_w:
            return (grad_x, None, grad_b) + none
        work = _ConvW(grad, xc, wc, args)
        if DEFERRED.key is None:
            return (grad_x, work.grad(), grad_b) + none
        DEFERRED.defer(ctx.weight, work)
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


# (split_linear, split_conv) as dynamo traces them: autosplit/weight_grad_ops.py installs them on import
TRACED: list = []


def _traced(k: int):
    if not TRACED:
        raise RuntimeError("a stage with split weight GEMMs is being compiled, but autosplit.weight_grad_ops "
                           "was not loaded: compile stages with parallelize(..., compile_stages=True)")
    return TRACED[k]


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose weight gradient is deferred (see the module docstring)."""
    if torch.compiler.is_compiling():
        return _traced(0)(x, weight, bias)
    return _SplitLinear.apply(x, weight, bias)


def split_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride=1, padding=0,
               dilation=1, groups: int = 1) -> torch.Tensor:
    """``F.conv{1,2,3}d`` (by ``x.dim()``) whose weight gradient is deferred; numeric padding only."""
    if torch.compiler.is_compiling():
        return _traced(1)(x, weight, bias, stride, padding, dilation, groups)
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
