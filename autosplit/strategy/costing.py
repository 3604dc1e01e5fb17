"""Pricing one configuration with compile's own cost model, from one layout's rescaled graph.

Terms:
  group   -- (layout, microbatch size b, recompute, whether pipeline transfers cross nodes): everything
             that does not depend on the stage cut, the schedule, m or dp: ``SegmentCosts`` of the graph at b (per segment: fwd + bwd time with
             tp collectives and recompute, boundary time, parameter and saved bytes), and per segment the
             parts the predictor needs (fwd, bwd, W, tp forward / backward seconds).
  cut     -- ``balanced_bounds``' cut (strategy/cuts.py ``CutSolver``, exact and shared by every stage count);
             where it does not fit the memory budget, ``balanced_bounds`` itself with compile's memory
             function decides; then ``rank_balanced_bounds`` for the schedule's placement, as compile
             does, so the cut is always the one ``autosplit.compile`` makes.
  memory  -- per stage exactly as compile's StageInfo.memory_bytes (SegmentCosts.memory with the dp state
             of cost_model/sharding.py); per rank the sum over the stages it holds.
  price   -- ``cost_model.step_time.predict_step`` of the stage times, with the profile's core sharing for
             tp * dp processes per pipeline rank and its posting cost: what ``plan.summary()`` shows.
"""
from __future__ import annotations

import functools

import numpy as np

import torch
from torch.utils._pytree import tree_leaves

from autosplit.cost_model import collective_time, get_profile, p2p_time
from autosplit.cost_model.roofline import node_time
from autosplit.cost_model.sharding import StageDataParallel, UnitTable, unit_sums
from autosplit.cost_model.optimizer_step import optimizer_kind
from autosplit.cost_model.step_time import (StageTimes, deferred_w_stages, lower_bound, predict_step, sharing_of,
                                           stage_gathers, step_collectives, tp_overlaps)
from autosplit.cost_model.weight_grad import weight_grad_time
from autosplit.errors import PlanError
from autosplit.passes.partition import balanced_bounds, cut_fits, rank_balanced_bounds
from autosplit.schedule import build_schedule, peak_in_flight, placement_of
from autosplit.strategy.cuts import CutSolver
from autosplit.segment_costs import OPTIMIZER_FACTOR, SegmentCosts


def _rank_cut(group, start: list[int], stage_rank: list[int]) -> list[int]:
    """``rank_balanced_bounds`` of ``start`` without a budget, computed once per group, cut and placement:
    the descent depends on the segment costs alone, and the search asks for it once per configuration."""
    cache = group.__dict__.setdefault("_rank_cuts", {})
    key = (tuple(start), tuple(stage_rank))
    if key not in cache:
        cache[key] = rank_balanced_bounds(start, group.seg.time, group.seg.out_time, stage_rank, None,
                                          group.seg.params)
    return cache[key]


@functools.lru_cache(maxsize=1024)
def in_flight(schedule: str, pp: int, m: int, v: int) -> tuple[int, ...]:
    """Microbatches each stage holds at the schedule's peak: compile's rule on the unit simulator's peak,
    here scanned from the action lists (``peak_in_flight``, equal by construction and tested): simulating
    a 96-rank schedule of 384 microbatches takes seconds, the scan milliseconds.  Deadlock freedom is
    not re-proved here; compile simulates the schedule it is given."""
    peaks, place = peak_in_flight(build_schedule(schedule, pp, m, v)), placement_of(schedule, pp, v)
    return tuple(max(1, -(-peaks[place.rank(s)] // place.v)) for s in range(place.num_stages))


class Group:
    """Cut-independent costs of (layout, b, recompute, crossing); see the module docstring."""

    def __init__(self, layout_graph, b: int, recompute, profile, layers, input_bytes: int, cross_node: bool = False):
        self.graph, self.b, self.recompute, self.profile, self.layers = layout_graph, b, recompute, profile, layers
        self.input_bytes, self.cross_node = input_bytes, cross_node
        gm = layout_graph.at(b)
        nodes, cuts = list(gm.graph.nodes), layout_graph.cuts
        ends = [c.position for c in cuts] + [len(nodes) - 1]
        self.segments = [nodes[a + 1:e + 1] for a, e in zip([-1, *ends], ends)]
        self.segment_of = np.repeat(np.arange(len(ends)), np.diff([-1, *ends]))
        # per node, as compile sums them per stage: fwd, bwd + recompute, W, tp fwd, tp bwd
        base = _node_parts(layout_graph, b, profile)
        if recompute is not None:        # a recomputed node's forward runs again in backward (its f), and
            base = base.copy()           # so do its forward tp collectives (tp f into tp b)
            rule = SegmentCosts([], [], 1, profile, [], recompute=recompute, layers=layers)
            again = np.array([rule.recomputed(n) for n in nodes], dtype=bool)
            base[:, 1] += np.where(again, base[:, 0], 0.0)
            base[:, 4] += np.where(again, base[:, 3], 0.0)
        self.node_parts = base
        self.send = [p2p_time(c.nbytes, profile, cross_node) for c in cuts] + [0.0]
        # the bounds' inputs, from the nodes (compile's SegmentCosts is built only when a configuration of
        # this group is priced): one microbatch through every stage, and the bytes the memory bound needs
        self.work = float(base[:, [0, 1, 3, 4]].sum())
        self.params = sum(n.meta["cost"].param_bytes for n in nodes)
        self.saved = sum(n.meta["cost"].saved_bytes for n in nodes)
        self._seg = self._solver = None
        self._dp: dict[tuple, StageDataParallel] = {}
        self._stages: dict[tuple, tuple] = {}       # cut -> (part sums, parameter bytes, tensors) per stage

    @property
    def seg(self) -> SegmentCosts:
        """compile's SegmentCosts of this group (the cut's inputs and the memory model)."""
        if self._seg is None:
            self.graph.at(self.b)
            self._seg = SegmentCosts(self.segments, self.graph.cuts, self.graph.tp, self.profile, [],
                                     recompute=self.recompute, layers=self.layers, input_bytes=self.input_bytes,
                                     cross_node=self.cross_node, node_parts=_node_parts(self.graph, self.b,
                                                                                        self.profile))
        return self._seg

    @property
    def units(self) -> UnitTable:
        """FSDP unit bytes per segment (cost_model/sharding.py ``unit_sums``, ``UnitTable``), shared by every
        dp_shard="layer" price of this group."""
        if not hasattr(self, "_units"):
            self._units = UnitTable([unit_sums(s, self.layers) for s in self.segments])
        return self._units

    @property
    def n_segments(self) -> int:
        return len(self.segments)

    def data_parallel(self, dp: int, m: int, sharding, gather_ratio: float, tp: int) -> StageDataParallel:
        """The StageDataParallel of one (dp group, m, sharding), kept for every price of this group (its
        costs per stage range are kept in it)."""
        key = (dp, m if sharding else None, sharding, gather_ratio, tp)   # m only in a sharded cost
        if key not in self._dp:
            self._dp[key] = StageDataParallel(self.segments, self.seg.params, self.layers, dp, m, sharding,
                                              self.profile, gather_ratio, tp=tp,
                                              units=self.units if sharding == "layer" else None)
        return self._dp[key]

    def bounds(self, n_stages: int) -> list[int]:
        if self._solver is None:
            self._solver = CutSolver(self.seg.time, self.seg.out_time, self.seg.params)
        return self._solver.bounds(n_stages)

    def range_terms(self, first: int, last: int) -> tuple[float, int, int]:
        """(optimizer bytes as compile's memory function writes them, kept and recomputed activation bytes) of
        segments first..last, kept per range: a budgeted cut asks for every range of every stage count, and
        each configuration of the group for its cut's (~10^6 calls in a 1024-GPU search)."""
        terms = self.__dict__.setdefault("_range_terms", {})
        if (first, last) not in terms:
            terms[first, last] = (OPTIMIZER_FACTOR * sum(self.seg.params[first:last + 1]),
                                  *self.activations(first, last))
        return terms[first, last]

    def activations(self, first: int, last: int):
        if self.recompute == "block" and (first, last) not in self.seg._activations:
            self.graph.at(self.b)                    # recompute="block" reads the nodes' shapes at b
        return self.seg.activations(first, last)

    def stages(self, bounds: list[int]) -> tuple[np.ndarray, list[int]]:
        """Per stage the summed node parts (S, 5) and parameter bytes, with compile's assignment: a node
        in the stage of its segment, a parameter read (and what is computed from parameters alone) in
        the stage of its first user.  Kept per cut (read only): the configurations of one group that
        share a stage count ask for the same cut."""
        key = tuple(bounds)
        if key not in self._stages:
            stage_of_segment = np.searchsorted(np.array(bounds), np.arange(len(self.segments)))
            stage = stage_of_segment[self.segment_of]
            for k, users in self.graph.param_users:
                stage[k] = min(stage[u] for u in users)
            S = len(bounds)
            sums = np.stack([np.bincount(stage, weights=self.node_parts[:, i], minlength=S) for i in range(5)],
                            axis=1)
            names = [set() for _ in range(S)]
            for k, used in self.graph.param_names:
                names[stage[k]].update(used)
            sizes = self.graph.param_bytes
            self._stages[key] = (sums, [sum(sizes[n] for n in group) for group in names],
                                 [len(group) for group in names])
        sums, param_bytes, _ = self._stages[key]
        return sums, param_bytes

    def stage_tensors(self, bounds: list[int]) -> list[int]:
        """Per stage the parameter tensors it holds (``stages``' names, of the same cut)."""
        self.stages(bounds)
        return self._stages[tuple(bounds)][2]


def _node_parts(layout_graph, b: int, profile) -> np.ndarray:
    """(nodes, 5): per node the forward and backward time (graph_time), W (split_backward_time) and the
    tp collective's forward and backward (collective_time), without recomputation; cached on the graph per b."""
    cache = layout_graph.__dict__.setdefault("node_parts", {})
    if b not in cache:
        gemms, tp, origin = layout_graph.gemms, layout_graph.tp, layout_graph.origin
        prof = get_profile(profile)
        rows, row_of = [], {}
        for n in layout_graph.nodes:
            source = origin.get(n)
            if source is not None and (source in gemms) == (n in gemms):
                rows.append(row_of[source])       # a copied layer's node: its source's op on its shapes
                continue
            if not any(isinstance(x, torch.Tensor) for x in tree_leaves(n.meta.get("val"))):
                rows.append((0.0, 0.0, 0.0, *collective_time(n, tp, profile)))
            else:
                f, bw = node_time(n, prof, n.meta["cost"])      # as compile's graph_time prices it
                w = min(weight_grad_time(n, profile), bw) if n in gemms else 0.0
                rows.append((f, bw, w, *collective_time(n, tp, profile)))
            row_of[n] = rows[-1]
        cache[b] = np.array(rows, dtype=float).reshape(-1, 5)
    return cache[b]


PRUNED = "pruned"


def _stage_times(group: Group, bounds, split: frozenset[int], dpc, overlap: bool = False, optimizer=None,
                 owned: int = 1) -> tuple[list[StageTimes], list]:
    """``optimizer``: the OptimizerKind stepping each stage's parameters (1/``owned`` of them under FSDP)."""
    sums, param_bytes = group.stages(bounds)
    tensors = group.stage_tensors(bounds)
    ranges = list(zip([b + 1 for b in [-1, *bounds[:-1]]], bounds))
    stages, costs = [], []
    for s, (a, b) in enumerate(ranges):
        f, bw, w, tf, tb = (float(x) for x in sums[s])
        costs.append(dpc(a, b, param_bytes[s]))
        # compile's StageInfo: bwd holds the recomputed forward, fwd alone is the forward pass
        opt = optimizer.time(param_bytes[s] / owned, tensors[s], group.profile) if optimizer is not None else 0.0
        stages.append(StageTimes(fwd=f, bwd=bw, w=w if s in split else 0.0, tp_fwd=tf, tp_bwd=tb, send=group.send[b],
                                 dp=costs[-1].time, dp_buckets=costs[-1].buckets,
                                 tp_hidden=min(tb, w) if overlap else 0.0, opt=opt,
                                 **stage_gathers(costs[-1], f, bw)))
    return stages, costs


def price(group: Group, pp: int, dp: int, schedule: str, v: int, m: int, sharding, budget,
          incumbent: float = float("inf"), optimizer=None, parts: bool = True):
    """(prediction, memory of the fullest rank, cut) of one configuration; or why it does not fit (a str);
    or PRUNED where ``step_time.lower_bound`` of its stages already exceeds ``incumbent``, or the timed run
    shows its total will (``predict_step``'s ``limit``).  ``optimizer``:
    the OptimizerKind the job steps with (cost_model/optimizer_step.py), None: AdamW; ``parts``: as
    ``step_time.predict_step``'s (False: the total alone is exact)."""
    optimizer = optimizer if optimizer is not None else optimizer_kind("adamw")
    # the gradients are summed (FSDP: sharded) over dp x cp, every tp-th rank (passes/stage_bounds.py)
    cp, tp = getattr(group.graph, "cp", 1), getattr(group.graph, "tp_inner", group.graph.tp)
    owned = dp * cp if sharding else 1
    S, seg, split = pp * v, group.seg, deferred_w_stages(schedule, pp, m, v, group.graph.tp,
                                                            group.profile.device_type)
    # FSDP gathers half-precision copies under autocast, as compile prices them (passes/stage_bounds.py)
    gather_ratio = 0.5 if getattr(group.graph, "autocast", None) is not None else 1.0
    dpc = group.data_parallel(dp * cp, m, sharding or None, gather_ratio, tp)
    overlap = tp_overlaps(group.profile, group.graph.tp, sharding)
    place = placement_of(schedule, pp, v)
    stage_rank = [place.rank(s) for s in range(S)]
    bounds = group.bounds(S)
    profile = get_profile(group.profile)
    fixed = step_collectives(profile, pp * group.graph.tp * dp, (pp, group.graph.tp, dp))
    if budget is None:                        # the cut is final: bound before simulating anything
        bounds = _rank_cut(group, bounds, stage_rank)
        stages, _ = _stage_times(group, bounds, split, dpc, overlap, optimizer, owned)
        if lower_bound(schedule, pp, m, v, stages, fixed) > incumbent:
            return PRUNED
    seg.in_flight = list(in_flight(schedule, pp, m, v))

    def memory(s, a, b):                      # compile's: the dp state as sharded instead of 4 x params
        opt, kept, recompute = group.range_terms(a, b)
        return opt + seg.in_flight[s] * kept + recompute - opt + dpc.memory_bytes(a, b)   # compile's order

    ranges = list(zip([b + 1 for b in [-1, *bounds[:-1]]], bounds))
    if budget is not None:                    # compile's order: the budgeted stage cut, then rank balance
        if any(memory(s, a, b) > budget for s, (a, b) in enumerate(ranges)):
            try:
                bounds = balanced_bounds(seg.time, seg.out_time, S, memory, budget, seg_params=seg.params)
            except PlanError:
                return f"no cut into {S} stages fits {budget / 2**30:.1f} GiB per stage"
        moved = _rank_cut(group, bounds, stage_rank)           # rank_balanced_bounds with the budget:
        if cut_fits(moved, lambda s, a, b: memory(s, a, b) <= budget):
            bounds = moved                                   # the moved cut where it fits, else the stage cut
        ranges = list(zip([b + 1 for b in [-1, *bounds[:-1]]], bounds))
    stages, costs = _stage_times(group, bounds, split, dpc, overlap, optimizer, owned)
    if lower_bound(schedule, pp, m, v, stages, fixed) > incumbent:
        return PRUNED
    stage_memory = []
    for s, (a, b) in enumerate(ranges):
        kept, recompute = group.activations(a, b)
        stage_memory.append(int(costs[s].memory_bytes) + seg.in_flight[s] * kept + recompute)
    rank_memory = max(sum(stage_memory[s] for s in place.stages(r)) for r in range(pp))
    if budget is not None and rank_memory > budget:
        return f"memory {rank_memory / 2**30:.1f} GiB > budget {budget / 2**30:.1f} GiB (the fullest rank's stages)"
    price = predict_step(schedule, pp, m, v, stages, sharing_of(group.profile, group.graph.tp * dp),
                         profile.p2p_post, profile.p2p_wake, fixed, profile.resume, profile.pass_overhead, parts,
                         limit=incumbent)
    return PRUNED if price is None else (price, rank_memory, bounds)
