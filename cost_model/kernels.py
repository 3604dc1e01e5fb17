"""What real kernels reach: GEMM efficiency by shape, fused attention, achievable bandwidth, launches.

A datasheet peak is a bound no training step reaches: published ViT training runs at 29-61 % of it.  This
module keeps the roofline (an op is limited by compute or by memory traffic, whichever is slower) and
replaces each ceiling by what kernels of that shape really reach, with a few numbers per device
(``DeviceProfile``'s kernel model, fitted to published timings: benchmarks/bench_gpu_tables.py).

Terms:
  GEMM shape  -- (batch, m, n, k) of an op that runs as matrix multiplies: ``batch`` independent
                 (m x k) @ (k x n) products.  A Linear on (B, N, C_in) -> C_out is (1, B*N, C_out, C_in);
                 a bmm of (B*H, L, d) @ (B*H, d, S) is (B*H, L, S, d); a convolution is its implicit GEMM
                 (batch = groups, m = output positions, n = output channels per group, k = input channels
                 per group x kernel size); scaled-dot-product attention is (B*H, L, S, head dim).
  efficiency  -- the fraction of ``peak_flops`` a GEMM reaches:
                   gemm_efficiency * prod over d in (m, n, k) of d / (d + gemm_half_dim).
                 A tensor-core GEMM is tiled (128 x 128 x 32 and the like) and launched in waves over the
                 SMs: a dimension near or under a tile leaves lanes idle, so each small dimension scales
                 the rate down, and a large GEMM saturates at ``gemm_efficiency`` (clocks under load, the
                 epilogue, memory stalls).  The backward's two GEMMs (dX: m x k from m x n, n x k; dW:
                 n x k from m x n, m x k) have the same three dimensions, so the same efficiency.
  attention   -- a fused attention kernel (flash / memory-efficient SDPA) runs its FLOPs at the GEMM rate
                 of its shape times ``attention_efficiency`` (softmax, masking and the online rescaling
                 inside the kernel); the scores never reach memory.
  bandwidth   -- memory-bound kernels move bytes at ``mem_bandwidth * bandwidth_efficiency``.
  launch      -- every kernel costs ``op_overhead`` seconds beside its work; a GEMM op's backward is two
                 kernels (dX and dW), every other op's one.
  time        -- per pass: max(FLOPs / rate, bytes / bandwidth) + launches * op_overhead.  Ops without a
                 GEMM shape (pointwise, norms, softmax, reductions) run their FLOPs at the profile's
                 float32 rate (vector units, not tensor cores); in practice their bytes decide.

Pure: shapes from ``node.meta['val']``, no device work.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from autosplit.cost_model.flops import NodeCost, _arg, _rule_key

# cost classes (passes/op_registry.py, ``cost``; our own graph ops' ``cost_rule``) that run as GEMMs / fused attention
GEMM_RULES = ("linear", "conv", "matmul", "addmm", "linear_2d", "multi_head_attention")
ATTENTION_RULES = ("scaled_dot_product_attention",)


def _val(x):
    return x.meta.get("val") if isinstance(x, fx.Node) else x


def gemm_shape(node: fx.Node) -> tuple[int, int, int, int] | None:
    """(batch, m, n, k) of ``node`` when it runs as GEMMs or fused attention (see Terms); else None."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return None
    module = node.graph.owning_module.get_submodule(node.target) if node.op == "call_module" else None
    try:
        key = _rule_key(node, module)
    except AttributeError:
        return None
    out = node.meta.get("val")
    if key not in GEMM_RULES + ATTENTION_RULES or not isinstance(out, (torch.Tensor, tuple)):
        return None
    try:
        return _shape(node, module, key, out)
    except (AttributeError, IndexError, TypeError, ValueError):
        return None                      # an unusual call form: priced without the shape term


def _shape(node, module, key, out):
    if key == "multi_head_attention":    # its projections dominate: (tokens, E, E)
        q = _val(_arg(node, 0, "query"))
        return 1, q.numel() // q.shape[-1], module.embed_dim, module.embed_dim
    if key in ATTENTION_RULES:
        q, k = _val(_arg(node, 0, "query")), _val(_arg(node, 1, "key"))
        return math.prod(q.shape[:-2]), q.shape[-2], k.shape[-2], q.shape[-1]
    if key == "linear_2d":
        x, q = _val(node.args[0]), node.args[4]
        return 1, x.numel() // x.shape[-1], out.shape[-1], x.shape[-1] * q
    if key in ("linear", "conv"):
        w = module.weight if module is not None else _val(_arg(node, 1, "weight"))
        if w.dim() > 2:                  # conv: out (B, C_out, *spatial), w (C_out, C_in / g, *kernel)
            groups = module.groups if module is not None else (_arg(node, 6, "groups", 1) or 1)
            return groups, out.numel() // out.shape[1], w.shape[0] // groups, math.prod(w.shape[1:])
        return 1, out.numel() // out.shape[-1], w.shape[0], w.shape[-1]
    # matmul's operands by position (named input / other for torch.matmul, input / mat2 for mm and bmm)
    pa, pb = ((0, None), (1, None)) if key == "matmul" else ((1, "mat1"), (2, "mat2"))
    a, b = _val(_arg(node, *pa)), _val(_arg(node, *pb))
    if a.dim() == 1 or b.dim() == 1:     # matrix-vector: a GEMM with n = 1
        return 1, out.numel(), 1, a.shape[-1]
    return math.prod(out.shape[:-2]), a.shape[-2], b.shape[-1], a.shape[-1]


def gemm_efficiency(profile, shape) -> float:
    """Fraction of peak a GEMM of ``shape`` (batch, m, n, k) reaches on ``profile`` (see Terms)."""
    half = profile.gemm_half_dim
    eff = profile.gemm_efficiency
    if half > 0:
        for d in shape[1:]:
            eff *= d / (d + half)
    return eff


def kernel_parts(cost: NodeCost, dtype: torch.dtype, profile, cls: str, shape=None) -> tuple[tuple, tuple]:
    """((forward launch s, forward work s), (backward launch s, backward work s)) of one op.

    Args:
        cost: the op's FLOPs and bytes (flops.py).
        dtype: its compute dtype (output_dtype of the node).
        profile: a DeviceProfile.
        cls: its op class (measured.op_class): "matmul" and "attention" run at the GEMM rate of ``shape``,
            every other class at the float32 rate; all of them no faster than the achievable bandwidth.
        shape: its GEMM shape (``gemm_shape``); None: the rate without the shape term.
    """
    bandwidth = profile.mem_bandwidth * profile.bandwidth_efficiency
    if cls in ("matmul", "attention"):
        rate = profile.flops_for(dtype)
        rate *= gemm_efficiency(profile, shape) if shape is not None else profile.gemm_efficiency
        if cls == "attention":
            rate *= profile.attention_efficiency
    else:
        rate = profile.flops_for(torch.float32)
    fwd = max(cost.fwd_flops / rate, cost.fwd_bytes / bandwidth)
    bwd = max(cost.bwd_flops / rate, cost.bwd_bytes / bandwidth)
    launches = 2 if cls == "matmul" else 1
    return ((profile.op_overhead if fwd else 0.0, fwd),
            (launches * profile.op_overhead if bwd else 0.0, bwd))


def optimizer_step_time(param_bytes: float, tensors: int, profile, traffic: float = 5.0,
                        launches: float = 1.0) -> float:
    """Seconds of an element-wise optimizer step over ``param_bytes`` of parameters in ``tensors`` tensors:
    ``traffic`` parameter-sized reads and writes in all (SGD with momentum, fused: parameter, gradient,
    momentum in; parameter, momentum out = 5) at the achievable bandwidth, and ``launches`` kernels per
    tensor.  What a training step pays after the backward pass."""
    moved = traffic * param_bytes
    return moved / (profile.mem_bandwidth * profile.bandwidth_efficiency) + tensors * launches * profile.op_overhead
