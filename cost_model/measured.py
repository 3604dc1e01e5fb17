"""A measured profile's numbers: per op class compute fits and per collective alpha-beta fits.

Terms:
  op class  -- what limits an op on a CPU / GPU, from the cost rule that priced it (flops.py):
               ``matmul`` (linear, conv, matmul, einsum, 2D linear, nn.MultiheadAttention),
               ``attention`` (scaled-dot-product attention, local heads), ``norm`` (layer / group /
               batch / RMS norm), ``softmax``, ``pointwise`` (everything else that moves bytes: GELU,
               add, dropout, copies, reductions, unknown ops) and ``view`` (an op the roofline prices at
               0: reshape, permute, getitem ... which still costs a dispatch and an autograd node).
  work      -- what an op class's time grows with: FLOPs for matmul and attention (``fwd_flops`` /
               ``bwd_flops``), bytes for the memory-bound classes (``fwd_bytes`` / ``bwd_bytes``),
               nothing for views (NodeCost's own fields, so a fit prices exactly what the rules count).
  fit       -- ``(alpha, rate)``: seconds = alpha + work / rate.  alpha is the per-op overhead (dispatch,
               autograd bookkeeping, a small GEMM's set-up), rate the FLOP/s or B/s the class reaches;
               small GEMMs are slower per FLOP because alpha dominates them.  Fitted by least squares on
               relative error (sizes span orders of magnitude), forward and backward separately.
  compute   -- ``DeviceProfile.compute``: op class -> (forward fit, backward fit), measured in float32;
               other dtypes scale the rate by the profile's ``flops_for(dtype) / flops_for(float32)``.
  comm      -- ``DeviceProfile.comm``: "kind/n" (a group of n ranks on one node) or "kind/n@k" (n ranks
               spread evenly over k nodes) -> (alpha s, beta s/B) for kind in all_reduce, all_gather,
               reduce_scatter, broadcast, send_recv, with nbytes the FULL tensor (comm.py's convention):
               seconds = alpha + beta * nbytes.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from autosplit.cost_model.flops import NodeCost, _rule_key   # the rule that priced the node

OP_CLASSES = ("matmul", "attention", "norm", "softmax", "pointwise", "view")
COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")
_BY_RULE = {**{k: "matmul" for k in ("linear", "conv", "matmul", "addmm", "einsum", "linear_2d",
                                      "multi_head_attention")},
            "scaled_dot_product_attention": "attention",
            **{k: "norm" for k in ("layer_norm", "group_norm", "batch_norm", "rms_norm", "layer_norm_2d")},
            "softmax": "softmax"}
_FLOP_CLASSES = ("matmul", "attention")


def op_class(node: fx.Node, cost: NodeCost) -> str:
    """The op class of ``node`` (see Terms), given its cost."""
    if not (cost.fwd_flops or cost.fwd_bytes or cost.bwd_flops or cost.bwd_bytes):
        return "view"
    module = node.graph.owning_module.get_submodule(node.target) if node.op == "call_module" else None
    try:
        key = _rule_key(node, module)
    except AttributeError:
        key = None
    return _BY_RULE.get(key, "pointwise")


def work(cost: NodeCost, cls: str) -> tuple[float, float]:
    """(forward, backward) work of an op of class ``cls``: FLOPs, bytes, or nothing (views)."""
    if cls == "view":
        return 0.0, 0.0
    if cls in _FLOP_CLASSES:
        return float(cost.fwd_flops), float(cost.bwd_flops)
    return float(cost.fwd_bytes), float(cost.bwd_bytes)


def fit_time(fit, amount: float, scale: float = 1.0) -> float:
    alpha, rate = fit
    return alpha + amount / (rate * scale) if rate > 0 else alpha


def measured_op_parts(cost: NodeCost, cls: str, dtype: torch.dtype, profile) -> tuple[tuple, tuple]:
    """((forward alpha s, forward work s), (backward alpha s, backward work s)) of one op from the
    profile's fits: the constant and the work term of each.  An op without backward work (an integer
    op, an op on a tensor that needs no gradient) costs no backward time."""
    fwd_fit, bwd_fit = profile.compute[cls]
    scale = profile.flops_for(dtype) / profile.flops_for(torch.float32) if cls in _FLOP_CLASSES else 1.0
    fwd_work, bwd_work = work(cost, cls)
    has_bwd = cls == "view" or bool(cost.bwd_flops or cost.bwd_bytes)
    fwd = (fwd_fit[0], fit_time(fwd_fit, fwd_work, scale) - fwd_fit[0])
    bwd = (bwd_fit[0], fit_time(bwd_fit, bwd_work, scale) - bwd_fit[0]) if has_bwd else (0.0, 0.0)
    return fwd, bwd


def measured_op_time(cost: NodeCost, cls: str, dtype: torch.dtype, profile) -> tuple[float, float]:
    """(forward s, backward s) of one op from the profile's fits (see measured_op_parts)."""
    (fa, fw), (ba, bw) = measured_op_parts(cost, cls, dtype, profile)
    return fa + fw, ba + bw


def fit_alpha_rate(samples: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Least-squares (alpha, rate) from samples (ops, work, seconds): seconds ~ ops * alpha + work / rate,
    minimizing relative error.  Both stay >= 0 (a fit that wants a negative one drops it)."""
    rows = [(k / t, x / t) for k, x, t in samples if t > 0]          # divide each equation by t
    if not rows:
        raise ValueError("no timed samples to fit")
    if all(x == 0 for _, x in rows):                                  # views: alpha only
        return sum(k for k, _ in rows) / sum(k * k for k, _ in rows), math.inf
    saa = sum(a * a for a, _ in rows)
    sab = sum(a * b for a, b in rows)
    sbb = sum(b * b for _, b in rows)
    sa, sb = sum(a for a, _ in rows), sum(b for _, b in rows)       # right-hand side is 1 for every row
    det = saa * sbb - sab * sab
    if det > 0:
        alpha, inv_rate = (sa * sbb - sb * sab) / det, (saa * sb - sab * sa) / det
        if alpha >= 0 and inv_rate > 0:
            return alpha, 1 / inv_rate
    return 0.0, sbb / sb                                              # work only: rate through the origin


def fit_alpha_beta(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """(alpha s, beta s/B) from (nbytes, seconds) samples: seconds ~ alpha + beta * nbytes."""
    alpha, rate = fit_alpha_rate([(1.0, b, t) for b, t in samples])
    return alpha, (0.0 if math.isinf(rate) else 1 / rate)


def comm_key(kind: str, n: int, nodes: int = 1) -> str:
    return f"{kind}/{n}" if nodes <= 1 else f"{kind}/{n}@{nodes}"


def measured_comm_time(profile, kind: str, nbytes: float, n: int, nodes: int = 1) -> float | None:
    """Seconds of collective ``kind`` over ``n`` ranks on ``nodes`` nodes from the profile's fits; None
    when not measured."""
    table = profile.comm or {}
    fit = table.get(comm_key(kind, n, nodes))
    if fit is None:
        return None
    alpha, beta = fit
    return alpha + beta * nbytes


def compute_to_json(compute: dict | None):
    return None if compute is None else {k: [list(f), list(b)] for k, (f, b) in compute.items()}


def compute_from_json(data) -> dict | None:
    return None if data is None else {k: (tuple(f), tuple(b)) for k, (f, b) in data.items()}
