"""``tp_mode="auto"``: every layout of the sharding engine for the mesh's tp, planned and priced, the
fastest kept.

Terms:
  layouts   -- "1d" free (megatron.py ``auto``: any feature or token class, nothing required, a layer kept
               whole where splitting does not pay), and the grid modes tp factors into: "2d" (q x q),
               "2.5d" at each depth d >= 2 (q x q x d), "3d" (q^3); a grid mode only where its row split
               divides the microbatch.
  price     -- tp rank 0's local graph for one microbatch: the cost model's compute time plus its tensor-
               parallel collectives, forward and backward (what a stage's time is made of,
               segment_costs.py), float32.  Pipeline and data parallelism are the same for every layout.
  memory    -- what a rank keeps: 4 x its parameter bytes (value, gradient, Adam moments) and the saved
               activations of one microbatch; a layout over ``budget`` is kept only when none fits (then
               the one keeping least).
  why not per op -- the layouts live on different sub-meshes (one axis; a q x q grid; a cube), so one
               program cannot mix them op by op; within each, the engine chooses per op.
"""
from __future__ import annotations

import copy

import torch
import torch.fx as fx

from autosplit.cost_model.flops import node_cost
from autosplit.cost_model.roofline import graph_time
from autosplit.errors import AutosplitError
from autosplit.passes.shape_prop import MetaShapeProp
from autosplit.segment_costs import comm_time
from autosplit.tp.axes import batch_ways, grid_layouts, tp_axes


def layouts(tp: int, rows: int) -> list[tuple[str, int | None]]:
    """(tp_mode, tp_depth) of every layout for ``tp`` ranks and microbatches of ``rows`` rows."""
    return [("auto", None)] + [(m, d) for m, d in grid_layouts(tp) if rows % batch_ways(tp_axes(m, tp, d)) == 0]


def label(mode: str, depth: int | None) -> str:
    return "1d (free)" if mode == "auto" else f"2.5d d={depth}" if depth else mode


def choose(gm: fx.GraphModule, inputs: tuple, tp: int, profile, budget: float | None, rewrite):
    """(plan, graph module over its rewritten graph, one line naming every layout's price) of the
    fastest layout (module docstring).

    Args:
        gm: the traced graph with global shapes (not changed: each layout rewrites a copy).
        inputs: the example microbatch (meta tensors).
        tp: ranks per tensor-parallel group.
        profile: the DeviceProfile that prices the layouts.
        budget: bytes a rank may keep, or None.
        rewrite: fn(graph module, tp_mode, tp_depth) -> TensorParallelPlan: one layout, in place.
    """
    rows = next((x.shape[0] for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0), 1)
    priced, refused = [], []
    for mode, depth in layouts(tp, rows):
        copied = fx.GraphModule(gm, copy.deepcopy(gm.graph), type(gm).__name__)
        try:
            plan = rewrite(copied, mode, depth)
        except AutosplitError as exc:       # a layout this model cannot take: the others still can
            refused.append(f"{label(mode, depth)} refused ({str(exc).splitlines()[0]})")
            continue
        local = fx.GraphModule(plan.local_root(0, copied.graph), copied.graph, type(gm).__name__)
        MetaShapeProp(inputs)(local)
        nodes = list(local.graph.nodes)
        seconds = sum(graph_time(nodes, profile)) + comm_time(nodes, tp, profile)
        kept = 4 * sum(p.numel() * p.element_size() for p in local.parameters()) + \
            sum(node_cost(n, local).saved_bytes for n in nodes if isinstance(n.meta.get("val"), torch.Tensor))
        priced.append((seconds, kept, mode, depth, plan, copied))
    fits = [p for p in priced if budget is None or p[1] <= budget]
    best = min(fits, key=lambda p: p[0]) if fits else min(priced, key=lambda p: p[1])
    words = [f"{label(m, d)} {t * 1e3:.3f} ms, keeps {k / 2**20:.2f} MiB" + (" (chosen)" if p is best[4] else "")
             for t, k, m, d, p, _ in priced]
    line = (f"tp_mode='auto' priced every layout for tp={tp} (tp rank 0, one microbatch, compute + tp "
            f"communication): " + "; ".join(words + refused))
    return best[4], best[5], best[2], best[3], line
