"""The pipeline schedule as a planning pass: prove it deadlock-free and read its activation peak.

Terms: see autosplit/schedule (simulate: NCCL's matching rules; placement).
  in flight -- per global stage, the microbatches whose activations the stage holds at the schedule's
               peak (the simulator's peak per rank, shared among the rank's chunks); stage memory is
               in flight x kept activations (autosplit/segment_costs.py).
Touches no node: its results are plan state.
"""
from __future__ import annotations

from torch.fx.passes.infra.pass_base import PassResult

from autosplit.passes.infra import MetaPass, PlanState
from autosplit.schedule import check_schedule, placement_of


class SimulateSchedule(MetaPass):
    """Ensures ``state.schedule_result``, ``state.placement`` and ``state.in_flight``."""

    ensures_state = ("schedule_result", "placement", "in_flight")

    def __init__(self, state: PlanState):
        self.state = state

    def call(self, graph_module) -> PassResult:
        s, opts = self.state, self.state.options
        result = check_schedule(opts.schedule, s.mesh.pp, s.num_microbatches, opts.chunks_per_rank)
        place = placement_of(opts.schedule, s.mesh.pp, opts.chunks_per_rank)
        in_flight = [max(1, -(-result.peak_activations[place.rank(st)] // place.v)) for st in range(place.num_stages)]
        s.put(schedule_result=result, placement=place, in_flight=in_flight)
        return PassResult(graph_module, False)
