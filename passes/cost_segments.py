"""Segment costing as a planning pass: per segment, time, boundary transfer and memory.

Terms: see autosplit/segment_costs.py (kept, recompute bytes, recompute) and passes/cut_points.py (segment).
Touches no node: ``state.costs`` is the ``SegmentCosts`` the stage-bound choice and the stage table read.
"""
from __future__ import annotations

from torch.fx.passes.infra.pass_base import PassResult

from autosplit.passes.infra import MetaPass, PlanState
from autosplit.passes.shape_prop import tensor_bytes
from autosplit.cost_model.comm import pipeline_crosses_nodes
from autosplit.segment_costs import SegmentCosts


class CostSegments(MetaPass):
    """Requires meta['cost'], ``state.cuts`` / ``segments`` / ``in_flight``.  Ensures ``state.costs``."""

    requires_meta = ("cost",)
    requires_state = ("cuts", "segments", "in_flight")
    ensures_state = ("costs",)

    def __init__(self, state: PlanState):
        self.state = state

    def call(self, graph_module) -> PassResult:
        s = self.state
        s.put(costs=SegmentCosts(s.segments, s.cuts, s.mesh.block, s.profile, s.in_flight,
                                 recompute=s.options.recompute, layers=s.layers,
                                 input_bytes=sum(tensor_bytes(x) for x in s.inputs),
                                 cross_node=pipeline_crosses_nodes(s.profile, s.mesh.pp, s.mesh.block * s.mesh.dp)))
        return PassResult(graph_module, False)
