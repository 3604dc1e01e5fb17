"""Split GEMMs that ``torch.compile`` traces: the forward in the graph, the weight gradient an opaque op.

Terms: see autosplit/weight_grad.py (split GEMM, key, defer, W).
  traced part -- the forward (``F.linear`` / ``F.conv*``, fusable by inductor), the input and bias
                 gradients: all ordinary ops of the compiled forward and backward graphs.
  weight op   -- ``autosplit::linear_weight_grad`` / ``autosplit::conv_weight_grad``: a custom op the
                 compiled backward calls at run time, where ``DEFERRED``'s key is known.  With no key it
                 returns the weight gradient; under a key it queues the GEMM for W and returns zeros
                 (an op returns a tensor whatever the key; autograd adds them into ``.grad``, and W adds
                 the real gradient there later: the price is one weight-sized zero tensor per I).
  parameter   -- the queue needs the Parameter whose ``.grad`` W writes; a compiled backward hands the
                 op the weight's storage, so ``register_weights`` maps storages to Parameters when a
                 stage is compiled.  A weight it does not know gets its gradient at once (correct,
                 only not deferred).
  copies      -- what is queued is copied first (the output gradient, the input, a conv's weight): inductor may
                 reuse a buffer of its backward graph once the graph no longer reads it, and W runs
                 after that graph has returned.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from autosplit import weight_grad as WG

_PARAMS: dict[int, weakref.ref] = {}      # weight storage address -> its Parameter


def register_weights(module: torch.nn.Module) -> None:
    """Remember ``module``'s parameters by storage, for the weight ops' queue."""
    for p in module.parameters():
        if type(p) is torch.nn.Parameter and p.untyped_storage().size():
            # FSDP2's (DTensor, or freed until gathered) never split: zero-bubble schedules refuse dp_shard
            _PARAMS[p.untyped_storage().data_ptr()] = weakref.ref(p)


def _parameter(w: Tensor):
    ref = _PARAMS.get(w.untyped_storage().data_ptr())
    p = ref() if ref is not None else None
    return p if p is not None and p.shape == w.shape else None


def _deferred(param_like: Tensor, work) -> bool:
    """Queue ``work()`` (built only then: it copies its tensors) for W under the current key, if there is
    one and ``param_like``'s Parameter is known; False: the caller computes the gradient now."""
    param = _parameter(param_like) if WG.DEFERRED.key is not None else None
    if param is None:
        return False
    WG.DEFERRED.defer(param, work())
    return True


@torch.library.custom_op("autosplit::linear_weight_grad", mutates_args=())
def linear_weight_grad(g2: Tensor, x: Tensor, w: Tensor, param: Tensor) -> Tensor:
    """dW = g2^T x (g2: (rows, out), x: (..., in)), or zeros with the GEMM queued under the key."""
    if _deferred(param, lambda: WG._LinearW(g2.clone(), x.clone())):
        return torch.zeros_like(w)
    return WG._LinearW(g2, x).grad()


@linear_weight_grad.register_fake
def _(g2, x, w, param):
    return w.new_empty(w.shape)


@torch.library.custom_op("autosplit::conv_weight_grad", mutates_args=())
def conv_weight_grad(grad: Tensor, x: Tensor, w: Tensor, param: Tensor, stride: list[int], padding: list[int],
                     dilation: list[int], groups: int) -> Tensor:
    args = (None, stride, padding, dilation, False, [0] * len(stride), groups)
    if _deferred(param, lambda: WG._ConvW(grad.clone(), x.clone(), w.clone(), args)):
        return torch.zeros_like(w)
    return WG._ConvW(grad, x, w, args).grad()


@conv_weight_grad.register_fake
def _(grad, x, w, param, stride, padding, dilation, groups):
    return w.new_empty(w.shape)


class _TracedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        xc, wc, bc = WG._cast(x.device.type, x, weight, bias)
        ctx.save_for_backward(xc, wc, weight)
        ctx.has_bias = bias is not None
        return WG._no_autocast(x.device.type, F.linear, xc, wc, bc)          # (..., out)

    @staticmethod
    def backward(ctx, grad):                                                 # (..., out)
        xc, wc, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])                                # (rows, out)
        grad_x = g2.mm(wc).view(*grad.shape[:-1], wc.shape[1]) if ctx.needs_input_grad[0] else None  # (..., in)
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad_x, linear_weight_grad(g2, xc, wc, weight), grad_b


class _TracedConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups):
        xc, wc, bc = WG._cast(x.device.type, x, weight, bias)
        conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[x.dim()]
        n = x.dim() - 2
        ctx.args = (WG._tuple(stride, n), WG._tuple(padding, n), WG._tuple(dilation, n), groups)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(xc, wc, weight)
        return WG._no_autocast(x.device.type, conv, xc, wc, bc, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, grad):                                                 # (B, C_out, *spatial)
        xc, wc, weight = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.args
        n = xc.dim() - 2
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.aten.convolution_backward(grad, xc, wc, None, stride, padding, dilation, False,
                                                         [0] * n, groups, [True, False, False])[0]
        grad_b = grad.sum([0] + list(range(2, grad.dim()))) if ctx.has_bias else None
        grad_w = conv_weight_grad(grad, xc, wc, weight, stride, padding, dilation, groups)
        return (grad_x, grad_w, grad_b) + (None,) * 4


def traced_split_linear(x, weight, bias=None):
    return _TracedLinear.apply(x, weight, bias)


def traced_split_conv(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return _TracedConv.apply(x, weight, bias, stride, padding, dilation, groups)


WG.TRACED[:] = [traced_split_linear, traced_split_conv]
