"""Lower bounds of one microbatch's compute time through a layout's graph, at any microbatch size,
without pricing the graph at that size (the search prunes with them before it builds anything).

Terms:
  table        -- per node: forward and backward FLOPs and bytes, the peak FLOP/s of its dtype, its op
                  class (cost_model/measured.py ``op_class``) and GEMM dims (batch, m, n, k)
                  (cost_model/kernels.py ``gemm_shape``), read off the graph at two microbatch sizes
                  and extrapolated to any other as the shapes are (layout.py ``rescale``).
  roofline     -- what ``kernels.kernel_parts`` charges an op: launches * op_overhead plus
                  max(FLOPs / rate, bytes / bandwidth) per pass, the rate a GEMM's shape reaches.  For a
                  profile without measured fits this is exactly the compute compile prices, so the
                  floor is the group's compute without recomputation and tp collectives; an op class
                  the profile prices from measured fits keeps the old floor, FLOPs at the fastest rate.
  split floor  -- a grid layout's graph before it is rewritten (layout.py ``DeferredLayout``): each op
                  of the single-device graph runs on every tp rank, on at least 1/T of its FLOPs and
                  bytes (even splits; replicated ops and gathered copies only add) and with the same
                  launches; a GEMM split T ways runs its FLOPs no faster than the best split of its
                  dims allows (``_shape_efficiency``).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

from autosplit.cost_model.kernels import gemm_efficiency, gemm_shape
from autosplit.cost_model.measured import op_class
from autosplit.cost_model.roofline import output_dtype

_CLASS = {"matmul": 1, "attention": 2, "view": 3}     # every other class: 0 (the float32 vector rate)


def node_table(nodes, profile) -> dict[str, np.ndarray]:
    """The table (see Terms) of the nodes holding tensors, from their meta['val'] and meta['cost']."""
    rows, dims, kinds, classes = [], [], [], []
    for n in nodes:
        if not any(isinstance(x, torch.Tensor) for x in tree_leaves(n.meta.get("val"))):
            continue
        cost = n.meta["cost"]
        cls = op_class(n, cost)
        shape = gemm_shape(n) if cls in ("matmul", "attention") else None
        rows.append((cost.fwd_flops, cost.bwd_flops, cost.fwd_bytes, cost.bwd_bytes,
                     profile.flops_for(output_dtype(n))))
        dims.append(shape or (0, 0, 0, 0))
        kinds.append(_CLASS.get(cls, 0))
        classes.append(cls)
    return {"work": np.array(rows, dtype=float).reshape(-1, 5), "dims": np.array(dims, dtype=float).reshape(-1, 4),
            "kind": np.array(kinds, dtype=int), "measured": np.array(
                [profile.compute is not None and c in profile.compute for c in classes], dtype=bool)}


def at_size(one: dict, two: dict, k: int) -> dict:
    """The table at size unit * (2 + k), from the tables at 2 and 3 units (affine, as layout.py's shapes)."""
    return {**one, "work": one["work"] + k * (two["work"] - one["work"]),
            "dims": one["dims"] + k * (two["dims"] - one["dims"])}


def time_floor(table: dict, profile, ways: int = 1) -> float:
    """Seconds one microbatch's forward and backward take at least, summed over the table's ops, on a
    rank of a layout that splits every op at most ``ways`` ways (1: the layout's own graph)."""
    ff, bf, fb, bb, peak = table["work"].T
    kind, dims = table["kind"], table["dims"]
    gemm = (kind == 1) | (kind == 2)
    rate = np.where(gemm, peak * _shape_efficiency(dims, profile, ways), profile.flops_for(torch.float32))
    rate = np.where(kind == 2, rate * profile.attention_efficiency, rate)
    bandwidth = profile.mem_bandwidth * profile.bandwidth_efficiency
    fwd = np.maximum(ff / ways / rate, fb / ways / bandwidth)
    bwd = np.maximum(bf / ways / rate, bb / ways / bandwidth)
    launches = np.where(fwd > 0, 1.0, 0.0) + np.where(bwd > 0, np.where(kind == 1, 2.0, 1.0), 0.0)
    roofline = fwd + bwd + launches * profile.op_overhead
    # a class the profile prices from measured fits: its FLOPs at the fastest rate any fit reaches
    rates = [r for cls in ("matmul", "attention") for _, r in (profile.compute or {}).get(cls, ())]
    boost = max([1.0] + [r / profile.flops_for(torch.float32) for r in rates])
    measured = (ff + bf) / (ways * boost * peak)
    return float(np.where(table["measured"], measured, np.where(kind == 3, 0.0, roofline)).sum())


def _shape_efficiency(dims: np.ndarray, profile, ways: int) -> np.ndarray:
    """Per row, the GEMM efficiency (kernels.gemm_efficiency) of the shape that splits (batch, m, n, k)
    ``ways`` ways at the least cost.  A GEMM's time is proportional to batch * prod(d + half) over
    m, n, k (FLOPs / (peak * eff * prod d / (d + half))); for a fixed product of the local dims that is
    least when the batch takes the split first (it costs no efficiency), then the largest of m, n, k
    are cut down to a common level (water-filling: log(e^x + half) is convex in x = log d).  Exact
    kernels split by divisors; the continuous split is a bound of every one of them."""
    out = np.full(len(dims), float(profile.gemm_efficiency))
    for i, (batch, *mnk) in enumerate(dims):
        if not all(mnk):
            continue                          # no shape known: priced without the shape term
        left = ways / min(ways, batch) if batch >= 1 else ways
        out[i] = gemm_efficiency(profile, (1, *_water_fill(sorted(mnk, reverse=True), left)))
    return out


def _water_fill(dims: list[float], ways: float) -> list[float]:
    """``dims`` (largest first) with the largest cut to one level L, their product divided by ``ways``."""
    if ways <= 1:
        return dims
    total = math.prod(dims) / ways
    for j in range(1, len(dims) + 1):                   # cap the j largest at L
        rest = math.prod(dims[j:])
        level = (total / rest) ** (1.0 / j)
        if j == len(dims) or level >= dims[j]:
            return [min(d, level) for d in dims]
    return dims
