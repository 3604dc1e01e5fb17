"""Roofline time of one op: it is limited by compute or by memory traffic, whichever is slower.

Terms:
  rate    -- what the op's kernels reach: a GEMM's FLOP/s by its shape and dtype, fused attention's,
             the vector rate of other ops, the achievable memory bandwidth (kernels.py).
  traffic -- bytes the op reads and writes in main memory (``NodeCost.fwd_bytes`` / ``bwd_bytes``).
  time    -- max(flops / rate, traffic / bandwidth), separately for forward and backward, plus
             ``profile.op_overhead`` per kernel launched (kernels.py); no overlap between ops.
  measured -- a profile with measured fits (``profile.compute``, measured.py) prices each op by its
              class instead: alpha + work / rate, forward and backward.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from autosplit.cost_model.profiles import get_profile
from autosplit.cost_model.flops import NodeCost, node_cost
from autosplit.cost_model.kernels import gemm_shape, kernel_parts
from autosplit.cost_model.measured import measured_op_time, op_class


def op_time(cost: NodeCost, dtype: torch.dtype, profile, cls: str | None = None,
            shape: tuple | None = None) -> tuple[float, float]:
    """(forward s, backward s) of one op in ``dtype`` on ``profile`` (a DeviceProfile or its name).

    Args:
        cost: the op's FLOPs and bytes.
        dtype: its compute dtype.
        profile: a DeviceProfile or a profile name.
        cls: the op's class (measured.op_class): with a measured profile (``profile.compute``) the class's
            fits price it; otherwise it picks the kernel rate (kernels.py).  None: a GEMM-class rate.
        shape: its GEMM shape (kernels.gemm_shape), for the efficiency of small and skinny GEMMs.
    """
    p = get_profile(profile)
    if cls is not None and p.compute is not None and cls in p.compute:
        return measured_op_time(cost, cls, dtype, p)
    (fa, fw), (ba, bw) = roofline_op_parts(cost, dtype, p, cls, shape)
    return fa + fw, ba + bw


def roofline_op_parts(cost: NodeCost, dtype: torch.dtype, p, cls: str | None = None,
                      shape: tuple | None = None) -> tuple[tuple, tuple]:
    """The roofline's ((launch s, forward work s), (launch s, backward work s)) of one op on the
    DeviceProfile ``p`` (kernels.kernel_parts; model_fit.py scales the two terms apart)."""
    if cls is None:                  # no class known: one kernel a pass at the GEMM rate (the old roofline)
        (fa, fw), (_, bw) = kernel_parts(cost, dtype, p, "matmul", shape)
        return (fa, fw), (p.op_overhead if bw else 0.0, bw)
    return kernel_parts(cost, dtype, p, cls, shape)


def node_time(n: fx.Node, p, cost: NodeCost | None = None) -> tuple[float, float]:
    """(forward s, backward s) of graph node ``n`` on the DeviceProfile ``p``: its class and GEMM shape
    decide the kernel rates (or the measured fits)."""
    cost = cost or n.meta.get("cost") or node_cost(n, n.graph.owning_module)
    return op_time(cost, output_dtype(n), p, op_class(n, cost), gemm_shape(n))


def output_dtype(node: fx.Node) -> torch.dtype:
    """dtype of the first tensor in ``node.meta['val']`` (float32 when it holds none)."""
    for leaf in tree_leaves(node.meta.get("val")):
        if isinstance(leaf, torch.Tensor):
            return leaf.dtype
    return torch.float32


def graph_time(nodes: Iterable[fx.Node], profile) -> tuple[float, float]:
    """Summed (forward s, backward s) of ``nodes`` whose ``meta['val']`` holds a tensor.

    Uses ``meta['cost']`` when present (AnnotateCosts), otherwise computes it.  A tuple output counts
    (nn.MultiheadAttention returns one); its first tensor gives the dtype.
    """
    p = get_profile(profile)
    fwd = bwd = 0.0
    for n in nodes:
        if not any(isinstance(x, torch.Tensor) for x in tree_leaves(n.meta.get("val"))):
            continue
        f, b = node_time(n, p)
        fwd, bwd = fwd + f, bwd + b
    return fwd, bwd
