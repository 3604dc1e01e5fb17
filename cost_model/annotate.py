"""Graph pass: attach a NodeCost to every node.

Terms:
  cost        -- ``node.meta["cost"]``, a ``cost_model.NodeCost`` (FLOPs, bytes, saved activations).
  unknown ops -- names of ops with tensor inputs that the cost model has no rule for (``op_name`` form,
                 e.g. ``Tensor.cumsum`` or ``timm.layers.foo.MyBlock``); they get 0 FLOPs and a
                 memory-bound estimate, and callers should report them.
"""
from __future__ import annotations

import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

from autosplit.cost_model.flops import node_cost
from autosplit.passes.infra import MetaPass


class AnnotateCosts(MetaPass):
    """Requires: meta['val'] on every node (MetaShapeProp).  Ensures: meta['cost'] on every node, and
    ``self.unknown_ops`` (also ``state.unknown_ops`` when given a PlanState)."""

    requires_meta = ("val",)
    ensures_meta = ("cost",)

    def __init__(self, state=None):
        self.unknown_ops: list[str] = []
        self.state = state
        self.ensures_state = ("unknown_ops",) if state is not None else ()

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        unknown: set[str] = set()
        for node in graph_module.graph.nodes:
            node.meta["cost"] = node_cost(node, graph_module, unknown)
        self.unknown_ops = sorted(unknown)
        if self.state is not None:
            self.state.put(unknown_ops=list(self.unknown_ops))
        return PassResult(graph_module, False)
