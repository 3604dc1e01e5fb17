"""Choose the stage bounds and the data-parallel sharding together, as a planning pass.

Terms: see passes/partition.py (bounds, budget, torchtitan's baseline cut) and cost_model/sharding.py
(``dp_shard``: replicated, "stage" or "layer" FSDP units; the state bytes each leaves per rank).
  choice -- the shardings ``dp_shard`` allows, in order of preference (``candidates``); the first whose
            cut fits ``memory_budget`` wins.  A stage's memory counts its dp state as that sharding
            leaves it, instead of 4 x parameter bytes.  With ``stage_bounds`` given the cut is the
            user's (checked), and only the sharding is chosen.
  rank balance -- where a rank holds several stages (interleaved, ZB-V) the min-max stage cut is then
            moved until the busiest rank is lightest (``rank_balanced_bounds``): a step lasts as long as
            the busiest rank, not the slowest stage.
"""
from __future__ import annotations

from torch.fx.passes.infra.pass_base import PassResult

from autosplit import validate
from autosplit.cost_model.sharding import StageDataParallel, candidates
from autosplit.errors import PlanError
from autosplit.model_layers import find_layer_ends, first_layer_segment
from autosplit.passes.infra import MetaPass, PlanState
from autosplit.passes.partition import balanced_bounds, rank_balanced_bounds, stage_costs, torchtitan_bounds
from autosplit.schedule import placement_of
from autosplit.segment_costs import OPTIMIZER_FACTOR


class ChooseStageBounds(MetaPass):
    """Requires ``state.costs``.  Ensures ``state.bounds``, ``dp_shard``, ``dp_costs``, and torchtitan's
    baseline (``baseline_bounds``, ``baseline_times``) over the layers' end segments (``layer_ends``)."""

    requires_state = ("costs",)
    ensures_state = ("bounds", "dp_shard", "dp_costs", "baseline_bounds", "baseline_times", "layer_ends")

    def __init__(self, state: PlanState):
        self.state = state

    def call(self, graph_module) -> PassResult:
        s, opts, seg = self.state, self.state.options, self.state.costs
        options = candidates(opts.dp_shard, s.mesh.dp) if s.mesh.dp > 1 else [None]
        for sharding in options:        # in order of preference: the first whose cut fits the budget
            # the gradients are summed (FSDP: sharded) over the dp x cp ranks of one tp coordinate, every
            # tp-th rank (autosplit/mesh.py's order): with cp = 1 the dp group
            dpc = StageDataParallel(s.segments, seg.params, s.layers, s.mesh.dp * s.mesh.cp, s.num_microbatches,
                                    sharding, s.profile, 0.5 if opts.autocast is not None else 1.0, tp=s.mesh.tp)

            def memory(st, a, b, dpc=dpc):     # the dp state as sharded, instead of 4 x parameter bytes
                return seg.memory(st, a, b) - OPTIMIZER_FACTOR * sum(seg.params[a:b + 1]) + dpc.memory_bytes(a, b)
            try:
                if opts.stage_bounds is not None:
                    bounds = validate.stage_bounds(opts.stage_bounds, s.n_stages, len(s.segments))
                    over = [(st, memory(st, a + 1, b)) for st, (a, b) in enumerate(zip([-1, *bounds], bounds))]
                    over = [(st, m) for st, m in over if s.budget is not None and m > s.budget]
                    if over and sharding != options[-1]:
                        continue
                    if over:        # the user's cut is kept as given, so a budget it breaks is an error
                        st, m = max(over, key=lambda o: o[1])
                        raise PlanError(
                            f"stage_bounds={list(opts.stage_bounds)}: stage {st} needs {m / 2**20:.2f} MiB "
                            f"> the memory budget of {s.budget / 2**20:.2f} MiB per stage"
                            f"{'' if sharding is None else f' (dp state sharded per {sharding})'}; "
                            f"move the cut or raise the budget"
                            f"{', or shard the dp state (dp_shard=True)' if sharding is None and s.mesh.dp > 1 else ''}")
                else:
                    bounds = balanced_bounds(seg.time, seg.out_time, s.n_stages, memory, s.budget,
                                             seg_params=seg.params)
                    place = placement_of(opts.schedule, s.mesh.pp, opts.chunks_per_rank)
                    fits = None if s.budget is None else (lambda st, a, b, m=memory: m(st, a, b) <= s.budget)
                    bounds = rank_balanced_bounds(bounds, seg.time, seg.out_time,
                                                  [place.rank(st) for st in range(s.n_stages)], fits, seg.params)
                break
            except PlanError:
                if sharding == options[-1]:
                    raise
        layer_ends = find_layer_ends(s.layers, s.segments)
        baseline = torchtitan_bounds(layer_ends, first_layer_segment(s.layers, s.segments) - 1, len(s.segments),
                                     s.n_stages)
        s.put(bounds=bounds, dp_shard=sharding, dp_costs=dpc, baseline_bounds=baseline, layer_ends=layer_ends,
              baseline_times=None if baseline is None else stage_costs(baseline, seg.time, seg.out_time))
        return PassResult(graph_module, False)
