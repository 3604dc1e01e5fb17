"""Stage assignment: ``node.meta["stage"]`` from the chosen bounds.

Terms: see passes/partition.py (bounds: the last segment of each stage).
  from parameters -- a ``get_attr`` (parameter or buffer read), or a node computed from such reads
                     only (2D's gathers of a parameter's blocks).  It belongs to the stage of its first
                     user, so no parameter crosses a stage boundary.
"""
from __future__ import annotations

import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

from autosplit.passes.infra import MetaPass, PlanState


def assign_stages(segments: list[list[fx.Node]], bounds: list[int]) -> None:
    """Set ``meta["stage"]`` on every node of ``segments`` (all the graph's nodes, in order)."""
    stage = 0
    for k, seg in enumerate(segments):
        for n in seg:
            n.meta["stage"] = stage
        if k == bounds[stage] and stage < len(bounds) - 1:
            stage += 1
    nodes = [n for seg in segments for n in seg]
    from_params = set()
    for n in nodes:
        if n.op == "get_attr" or (n.op == "call_function" and n.all_input_nodes
                                  and all(a in from_params for a in n.all_input_nodes)):
            from_params.add(n)
    for n in reversed(nodes):
        if n in from_params and n.users:
            n.meta["stage"] = min(u.meta["stage"] for u in n.users)


class AssignStages(MetaPass):
    """Requires ``state.segments`` and ``state.bounds``.  Ensures meta['stage'] on every node."""

    requires_state = ("segments", "bounds")
    ensures_meta = ("stage",)

    def __init__(self, state: PlanState):
        self.state = state

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        assign_stages(self.state.segments, self.state.bounds)
        return PassResult(graph_module, False)
