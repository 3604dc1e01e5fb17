"""Roofline time of one op: it is limited by compute or by memory traffic, whichever is slower.

Terms:
  peak    -- ``profile.flops_for(dtype)``, dense FLOP/s for the op's dtype.
  traffic -- bytes the op reads and writes in main memory (``NodeCost.fwd_bytes`` / ``bwd_bytes``).
  time    -- max(flops / peak, traffic / mem_bandwidth), separately for forward and backward.
             plus ``profile.op_overhead`` per pass that does any work (a kernel launch); no overlap
             between ops is modelled.
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
from autosplit.cost_model.measured import measured_op_time, op_class


def op_time(cost: NodeCost, dtype: torch.dtype, profile, cls: str | None = None) -> tuple[float, float]:
    """(forward s, backward s) of one op in ``dtype`` on ``profile`` (a DeviceProfile or its name).

    ``cls``: the op's class (measured.op_class); with a measured profile (``profile.compute``) the
    class's fits price it instead of the roofline.
    """
    p = get_profile(profile)
    if cls is not None and p.compute is not None and cls in p.compute:
        return measured_op_time(cost, cls, dtype, p)
    (fa, fw), (ba, bw) = roofline_op_parts(cost, dtype, p)
    return fa + fw, ba + bw


def roofline_op_parts(cost: NodeCost, dtype: torch.dtype, p) -> tuple[tuple, tuple]:
    """The roofline's ((overhead s, forward work s), (overhead s, backward work s)) of one op on the
    DeviceProfile ``p``: work is the larger of the FLOP and byte terms, and an op with work pays the
    per-op overhead (model_fit.py scales the two terms apart)."""
    peak = p.flops_for(dtype)
    fwd = max(cost.fwd_flops / peak, cost.fwd_bytes / p.mem_bandwidth)
    bwd = max(cost.bwd_flops / peak, cost.bwd_bytes / p.mem_bandwidth)
    return (p.op_overhead if fwd else 0.0, fwd), (p.op_overhead if bwd else 0.0, bwd)


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
        cost = n.meta.get("cost") or node_cost(n, n.graph.owning_module)
        f, b = op_time(cost, output_dtype(n), p, op_class(n, cost) if p.compute is not None else None)
        fwd, bwd = fwd + f, bwd + b
    return fwd, bwd
