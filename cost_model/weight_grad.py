"""Prices of the two halves of a split backward: I (input gradient) and W (weight gradients).

Terms:
  weight GEMM -- a node whose weight gradient a zero-bubble schedule defers to W (which nodes: the
                 caller passes them, from ``passes/split_backward.weight_gemm_nodes``).
  W           -- per weight GEMM, one GEMM with the forward's FLOPs (dW = dY^T X is as large as
                 Y = X W^T), reading the saved input and the output gradient and writing dW:
                 kernel-model time of those FLOPs and bytes (kernels.py), plus one launch.
  I           -- the rest of the backward: every node's backward time minus its W.

With the cost model's backward of 2 x forward for GEMMs, a weight GEMM's backward splits evenly
into I and W; norms, attention and pointwise ops stay whole in I.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from autosplit.cost_model.flops import node_cost
from autosplit.cost_model.measured import op_class
from autosplit.cost_model.profiles import get_profile
from autosplit.cost_model.kernels import gemm_efficiency, gemm_shape
from autosplit.cost_model.roofline import node_time, op_time, output_dtype


def _bytes(val) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(val) if isinstance(t, torch.Tensor))


def weight_grad_time(node: fx.Node, profile) -> float:
    """Seconds of the W GEMM of one weight GEMM node (see the module docstring)."""
    p = get_profile(profile)
    cost = node.meta.get("cost") or node_cost(node, node.graph.owning_module)
    if p.compute is not None and cost.bwd_flops:       # measured: dW is one of backward's two GEMMs
        bwd = op_time(cost, output_dtype(node), p, op_class(node, cost))[1]
        return bwd * cost.fwd_flops / cost.bwd_flops
    x = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    traffic = _bytes(x) + 2 * _bytes(node.meta.get("val")) + cost.param_bytes   # X, dY read; dW written
    shape = gemm_shape(node)
    rate = p.flops_for(output_dtype(node)) * (gemm_efficiency(p, shape) if shape else p.gemm_efficiency)
    return max(cost.fwd_flops / rate, traffic / (p.mem_bandwidth * p.bandwidth_efficiency)) + p.op_overhead


def split_backward_time(nodes: Iterable[fx.Node], gemms: set[fx.Node], profile) -> tuple[float, float]:
    """(I s, W s) of ``nodes``' backward when the ``gemms`` among them defer their weight gradient."""
    i_time = w_time = 0.0
    for n in nodes:
        if not any(isinstance(x, torch.Tensor) for x in tree_leaves(n.meta.get("val"))):
            continue
        bwd = node_time(n, get_profile(profile))[1]
        w = min(weight_grad_time(n, profile), bwd) if n in gemms else 0.0
        i_time, w_time = i_time + bwd - w, w_time + w
    return i_time, w_time
