"""The tensor-parallel rewrite as a planning pass: 1D (Megatron, optionally sequence parallel), or a grid
mode (2D, 2.5D, 3D).

Terms: see passes/sharding/ (the engine: placements, rules, strategies, the solver, the lowering;
TensorParallelPlan and the local root in tp_plan.py; 1D in megatron.py, the grid modes in grid.py).
  local graph -- the rewritten graph with tp rank 0's parameter shards: the pass returns a new
                 GraphModule over it, so the following passes see local shapes (after the next
                 shape propagation); ``plan.stage_modules(r, tp_rank)`` builds the other ranks'.

With tp = 1 the graph is unchanged and every node is ``{"tp": Replicate()}`` (dp splits rows only).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate
from torch.fx.passes.infra.pass_base import PassResult

from autosplit.cost_model.comm import linear_2d_time
from autosplit.passes.decompose_attention import decompose_attention
from autosplit.passes.infra import MetaPass, PlanState
from autosplit.passes.shape_prop import tensor_bytes
from autosplit.passes.sharding.context import shard_context
from autosplit.passes.sharding.grid import shard_grid
from autosplit.passes.tp_auto import choose, label
from autosplit.tp.axes import GRID_MODES, batch_ways, tp_axes
from autosplit.passes.sharding.engine import priced_at
from autosplit.passes.sharding.megatron import shard_1d

LINEAR_2D_FORMS = ("allgather", "summa")


def form_chooser(choice: str, q: int, profile):
    """fn(node, x_val, w_shape) -> the 2D linear form: the user's, or the one the cost model prices lower."""
    def form(node, x, w_shape):
        if choice != "auto":
            return choice
        x_bytes = tensor_bytes(x) / (q * q)                        # the (B/q, ..., in/q) block
        w_bytes = math.prod(w_shape) * x.element_size() / (q * q)  # the (out/q, in/q) block
        times = {f: sum(linear_2d_time(x_bytes, w_bytes, q, f, profile)) for f in LINEAR_2D_FORMS}
        return min(LINEAR_2D_FORMS, key=times.get)
    return form


def layout_vals(gm: fx.GraphModule, inputs, unit: int) -> dict | None:
    """The values the layout is priced at (passes/sharding/engine.py "priced at"): the graph's at a
    microbatch of 2 * unit rows (the strategy search's), None when the example already has that many."""
    tensors = [x for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not tensors or all(x.shape[0] == 2 * unit for x in tensors):
        return None
    canon = tuple(torch.empty((2 * unit, *x.shape[1:]), dtype=x.dtype, device="meta")
                  if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in inputs)
    return priced_at(gm, canon)


class TensorParallel(MetaPass):
    """Requires meta['val'].  Ensures ``state.tp_plan`` (None when tp = 1), and sets meta['spec'] on the
    traced nodes (not declared in ``ensures_meta``: the nodes a rewrite inserts, such as the
    collectives and re-read parameters, carry none)."""

    requires_meta = ("val",)
    ensures_state = ("tp_plan",)

    def __init__(self, state: PlanState):
        self.state = state

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        s, opts, tp = self.state, self.state.options, self.state.mesh.tp
        if s.mesh.block == 1:
            for n in graph_module.graph.nodes:
                n.meta["spec"] = {"tp": Replicate()}
            s.put(tp_plan=None)
            return PassResult(graph_module, False)
        # nn.MultiheadAttention as the ops it computes, so it is split by heads like any attention block
        kept = decompose_attention(graph_module)
        if s.mesh.cp > 1:            # tokens over cp, 1D's layouts over tp inside it
            tp_plan = shard_context(graph_module, s.mesh.cp, tp, s.profile, price_vals=layout_vals(graph_module, s.inputs, 1),
                                    attention=opts.cp_attention)
        elif opts.tp_mode == "auto":   # the whole model on one tp group: the stages' budgets added
            budget = (s.budget if s.budget is not None else s.profile.memory_bytes) * s.mesh.pp
            tp_plan, graph_module, mode, depth, line = choose(graph_module, s.inputs, tp, s.profile, budget,
                                                              lambda gm, m, d: self.rewrite(gm, m, d, budget))
            tp_plan.mode = label(mode, depth)
            tp_plan.notes.insert(0, line)
        else:
            tp_plan = self.rewrite(graph_module, opts.tp_mode, opts.tp_depth)
        tp_plan.notes.extend(kept)
        s.put(tp_plan=tp_plan)
        graph = graph_module.graph
        return PassResult(fx.GraphModule(tp_plan.local_root(0, graph), graph, type(s.model).__name__), True)

    def rewrite(self, gm: fx.GraphModule, mode: str, depth: int | None, budget: float | None = None):
        """``gm`` rewritten in place for one layout (``mode``: "1d", "auto" (1D's free choice), or a grid
        mode with ``depth`` for "2.5d"); its TensorParallelPlan."""
        s, opts, tp = self.state, self.state.options, self.state.mesh.tp
        if mode in GRID_MODES:
            axes = tp_axes(mode, tp, depth)
            q = dict(axes).get("tp_col", 1)
            return shard_grid(gm, mode, axes, s.profile, form_chooser(opts.tp_2d_form, q, s.profile),
                              price_vals=layout_vals(gm, s.inputs, batch_ways(axes)))
        if mode == "auto":
            # the engine's free choice under a memory budget: priced at the plan's own microbatch rows (at
            # 2 rows its budget would see tiny activations) and its microbatch count (partial gradients are
            # summed once a step).  The fixed layouts stay at 2 rows and one microbatch: the strategy
            # search prices one rewrite of each for every size and count, and compile must plan what it priced.
            return shard_1d(gm, tp, s.profile, opts.sequence_parallel, auto=True, memory_budget=budget,
                            microbatches=s.num_microbatches)
        return shard_1d(gm, tp, s.profile, opts.sequence_parallel, price_vals=layout_vals(gm, s.inputs, 1),
                        auto=False, memory_budget=budget)
