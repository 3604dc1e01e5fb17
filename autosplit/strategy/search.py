"""``autosplit.search``: rank every parallel configuration of a model on W devices by predicted step time.

Terms: see space.py (layout, Bd, m, b, the enumerated options), costing.py (group, cut, memory, price),
candidate.py (Candidate, Rejected, pruned).

Order of work, cheapest refusals first:
  1. trace the model once; leave out the layouts whose tp exceeds ``max_tp`` (one node's GPUs by default);
     per layout, rewrite a copy for tensor parallelism (a refusal, e.g. heads not
     dividing by tp, rejects the layout, and every multiple of that tp: divisibility refusals are
     inherited by multiples); a grid layout (2D, 2.5D, 3D) is rewritten only when a configuration of
     it is first priced (layout.py ``DeferredLayout``: bounds from the single-device graph until then),
     and so is a cp layout (cp x tp ranks, 1D inside: layout.py ``ContextLayout``), rewritten at each
     microbatch size it is priced at, as compile rewrites it, one graph per distinct rewrite;
  2. enumerate meshes (pp, cp, tp, dp), microbatch counts, schedules, recomputation and dp sharding
     (space.py), rejecting what the compiler would refuse (batch and rows divisibility, stages beyond
     the graph's cuts, zero-bubble with dp_shard);
  3. for each configuration two sound lower bounds, from each layout's costs at two sizes (affine in b):
       memory >= (dp state of all parameters + saved activations without recomputation) / pp: the
         fullest rank holds at least the mean of what all ranks hold;
       step time >= m * (compute floor of one microbatch through all stages) / pp: some rank is at
         least that busy (floors.py: the roofline compile prices, or for a grid layout not yet
         rewritten a floor of any split of the ops), and the timed schedule runs a rank's computes
         one after another; plus the optimizer's traffic over the mean rank's parameters (1/pp of
         them, 1/dp of that under dp_shard), which the fullest rank steps after its last compute;
     reject what the memory bound puts over the budget, and price the rest in increasing order of the
     time bound, stopping once the bound exceeds the ``top``-th best step time found (everything
     after it is slower than ``top`` configurations already found: pruned, never wrongly); in two
     passes, the layouts already rewritten first, then the grid and cp layouts from that incumbent
     (their bounds know nothing of their own collectives, so they sort early and would be rewritten
     against a loose one);
  4. pricing a configuration (costing.price; its group's costs built on first use) cuts, bounds again
     with the stage times (step_time.lower_bound: transfers, dp sync and the step's own collectives
     included), checks memory, and runs the timed schedule for its total alone, stopped (pruned) once
     it is sure to pass the incumbent (step_time.predict_step's ``limit``); the returned ``top``
     are run once more with their parts (the run with free transfers that tells pp_comm from the bubble:
     step_time.predict_step's ``parts``).
The result is deterministic (no clocks or randomness in the choices), so every rank of a job that
searches reaches the same ranking.  ``SearchResult.phases`` says where the time went (``PHASES``).
Python's collector runs paced inside it (collector.py: what survives a full collection is frozen, so
the search's heap of graphs is not walked again at every full collection).
"""
from __future__ import annotations

import contextlib
import heapq
import time
from collections import defaultdict

from autosplit import validate
from autosplit.cost_model import get_profile
from autosplit.errors import AutosplitError
from autosplit.cost_model.optimizer_step import optimizer_kind
from autosplit.model_layers import layer_paths
from autosplit.options import AUTOCAST
from autosplit.passes.repeats import reduce
from autosplit.strategy.collector import frozen_survivors
from autosplit.strategy.candidate import Candidate, Rejected, SearchResult, describe, search_mesh
from autosplit.cost_model.comm import pipeline_crosses_nodes
from autosplit.cost_model.step_time import step_collectives
from autosplit.strategy.costing import PRUNED, Group, price
from autosplit.strategy.layout import (ContextLayout, DeferredLayout, LayoutGraph, fewest_microbatch_rows,
                                       trace_model)
from autosplit.trace import keeps_module_state
from autosplit.strategy.space import divisors, layouts, microbatch_counts, recompute_modes, schedules, shardings

_SLACK = 1e-9        # a bound must exceed the incumbent by more than float noise (sums in another order)

# Where a search's time goes: tracing and shape propagation; the tensor-parallel rewrites (1D when
# enumerated, grid layouts when first priced); the compute floors (strategy/floors.py); the groups'
# cut-independent costs; pricing (cut, memory, schedule); what is left: enumerating and sorting.
PHASES = ("trace", "rewrite", "bounds", "group costs", "pricing", "enumerate")


class _Clock(dict):
    """Seconds per phase: ``with clock("rewrite"): ...``."""

    def __init__(self):
        super().__init__((k, 0.0) for k in PHASES)
        self.start = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self[phase] += time.perf_counter() - t

    def done(self) -> dict[str, float]:
        self["enumerate"] = time.perf_counter() - self.start - sum(v for k, v in self.items() if k != "enumerate")
        return dict(self)


def _tp_cap(max_tp, profile) -> float:
    """The largest tp ``search`` tries (see its ``max_tp``)."""
    if max_tp is None:
        return float("inf")
    if max_tp == "node":
        return profile.gpus_per_node or float("inf")
    if isinstance(max_tp, bool) or not isinstance(max_tp, int) or max_tp < 1:
        raise AutosplitError(f"max_tp={max_tp!r}: expected \"node\", a positive int or None")
    return max_tp


def _options(layout, schedule, v, m, recompute, shard, budget, autocast=None) -> dict:
    o = {"num_microbatches": m, "schedule": schedule, "chunks_per_rank": v, "tp_mode": layout.tp_mode,
         "sequence_parallel": layout.sequence_parallel, "dp_shard": shard, "recompute": recompute}
    if autocast is not None:           # compile / parallelize plan the same dtypes the search priced
        o["autocast"] = autocast
    if layout.tp_mode in ("2d", "2.5d"):
        o["tp_2d_form"] = "allgather"
    if layout.tp_depth is not None:
        o["tp_depth"] = layout.tp_depth
    if layout.cp > 1:                  # priced with each attention's cp lowering chosen by cost (layout.py)
        o["cp_attention"] = "auto"
    if budget is not None:
        o["memory_budget"] = budget
    return o


@keeps_module_state       # it traces and propagates shapes (leaves' forwards run) many times
@frozen_survivors()       # its heap of graphs walked by full collections once, not each time (collector.py)
def search(model, world_size: int, example_input, *, global_batch: int, device="h100", memory_budget=None,
           top: int = 10, prune: bool = True, leaf_modules=(), concrete_args=None, autocast=None,
           optimizer="adamw", context_parallel: bool = True, max_tp="node") -> SearchResult:
    """Ranked configurations of ``model`` on ``world_size`` devices, fastest predicted step first.

    Args:
        model: the unchanged model (parameters may be on the meta device).
        world_size: number of devices W; every mesh (pp, cp, tp, dp) with pp * cp * tp * dp = W is
            considered (cp > 1 beside 1D tensor parallelism without sequence parallelism: space.py).
        example_input: one example of what the model's forward takes, batch dim first, with any batch
            size (e.g. torch.empty(1, 3, 224, 224, device="meta")): only its per-sample shape and dtype
            are used; each configuration sets the batch dim to its own microbatch size.
        global_batch: samples per optimizer step over all replicas; replica k of dp gets global_batch / dp.
        device: the cost-model profile ("h100", "h200", "a100", "cpu" or a DeviceProfile).
        memory_budget: bytes per rank (a number or "80GiB"); None: no limit.
        top: how many configurations to return.
        prune: False prices every configuration (the brute force the tests compare against).
        leaf_modules, concrete_args: as for ``autosplit.compile``.
        autocast: None (float32), torch.bfloat16 or torch.float16: the job trains under
            ``torch.autocast`` in that dtype; every candidate is priced with the dtypes autocast gives
            (layout.py *autocast*) and its ``options`` carry ``autocast`` for ``compile``/``parallelize``.
        optimizer: the optimizer the job steps with (a torch.optim class, an instance, or a name such as
            "adamw", "adam", "sgd"): its step over the parameters each rank owns is priced
            (cost_model/optimizer_step.py) and shown as the ``optimizer`` part.
        context_parallel: False leaves the cp layouts out (every mesh has cp = 1: the search before the
            cp axis).
        max_tp: the largest tensor-parallel degree tried (a cp layout's tp inside its cp ranks): "node"
            (default) the profile's ``gpus_per_node`` (no cap where the profile puts the job on one node),
            an int, or None for every divisor of ``world_size``.  Why a node: every tensor-parallel
            collective sits inside each layer's forward and backward, and across nodes it runs at the
            network's bandwidth (an H100 node's NVLink all-reduce is ~10x its InfiniBand); Galvatron's
            search caps it the same way (``max_tp_deg``, default 8) and published large runs keep tp
            inside a node.  The layouts above the cap are listed in ``rejected`` (kind "max_tp").
    Returns:
        A SearchResult: a list of Candidates (``.mesh``: a MeshShape with cp that also reads as the
        (pp, tp, dp) tuple; ``.options`` for ``parallelize``/``compile``,
        ``.step_time`` s, ``.memory`` bytes, ``.parts``), with ``.rejected`` (each with ``.why``),
        ``.pruned``, ``.table()``.
    """
    clock = _Clock()
    validate.model(model)
    for name, value in (("world_size", world_size), ("global_batch", global_batch), ("top", top)):
        validate.positive_int(name, value)
    inputs = validate.example_inputs(model, example_input)
    budget = validate.memory_budget(memory_budget)
    leaves = validate.leaf_modules(model, leaf_modules)
    validate.concrete_args(model, len(inputs), concrete_args)
    profile = get_profile(device)
    if not any(autocast is a for a in AUTOCAST):
        raise AutosplitError(f"autocast={autocast!r}: expected None, torch.bfloat16 or torch.float16")
    opt_kind = optimizer_kind(optimizer)
    tp_cap = _tp_cap(max_tp, profile)
    layers = layer_paths(model)
    sample_bytes = sum(x[:1].numel() * x.element_size() for x in inputs)
    with clock("trace"):
        traced = trace_model(model, inputs, leaves, concrete_args)
        repeats = reduce(traced, layers)        # identical layers rewritten once (passes/repeats.py)
    min_rows, one_row = fewest_microbatch_rows(traced)   # 2 where a BatchNorm sees one value per channel per row

    rejected: list[Rejected] = []
    specs = []                                  # (layout, graph, pp, dp, m, b, schedule, v)
    single = None                               # the tp = 1 graph: a deferred grid layout's bounds
    failed = defaultdict(list)                  # tp_mode -> [(tp, message)]
    context_failures: list = []                 # (cp, tp, message): the cp layouts' refusals (ContextLayout)
    for layout in layouts(world_size, context=context_parallel):
        block = layout.block
        meshes = [search_mesh(pp, layout.tp, world_size // (pp * block), layout.cp)
                  for pp in divisors(world_size // block)]
        base = {"tp_mode": layout.tp_mode, "sequence_parallel": layout.sequence_parallel}
        if layout.tp_depth is not None:
            base["tp_depth"] = layout.tp_depth
        if layout.tp > tp_cap:
            why = (f"tp({layout.tp}) > max_tp({tp_cap})" + (f" = gpus_per_node of {profile.name!r}: tensor parallelism "
                   f"stays inside a node (search's max_tp)" if max_tp == "node" else ""))
            rejected += [Rejected(mesh, base, why, "max_tp") for mesh in meshes]
            continue
        known = next(((t, msg) for t, msg in failed[layout.tp_mode] if layout.tp % t == 0), None)
        graph = None
        build = lambda layout=layout: LayoutGraph(traced, inputs, layout.tp, layout.tp_mode,  # noqa: E731
                                                  layout.sequence_parallel, profile, tp_depth=layout.tp_depth,
                                                  repeats=repeats, autocast=autocast)
        if layout.cp > 1:
            if single is None:                  # (the tp = 1 layout comes first and never fails)
                continue
            graph = ContextLayout(traced, inputs, layout.cp, layout.tp, profile, repeats, autocast, single,
                                  context_failures)                  # built per b when first priced
        elif known is None and layout.unit > 1 and single is not None:
            graph = DeferredLayout(build, layout.tp, layout.unit, single)   # built when first priced
        elif known is None:
            try:
                with clock("rewrite"):
                    graph = build()
            except AutosplitError as exc:
                known = (layout.tp, str(exc).splitlines()[0])
                failed[layout.tp_mode].append(known)
        if graph is None:
            why = known[1] if known[0] == layout.tp else f"as for tp={known[0]} (a divisor): {known[1]}"
            rejected += [Rejected(mesh, base, why, "tensor parallel") for mesh in meshes]
            continue
        if layout.block == 1:
            single = graph
        if not isinstance(graph, (DeferredLayout, ContextLayout)):
            with clock("rewrite"):
                graph.at(2 * graph.unit)
        n_segments = len(graph.cuts) + 1
        most = min(n_segments, 2 * len(layers)) if layers else n_segments
        for mesh in meshes:
            pp, dp = mesh.pp, mesh.dp
            if global_batch % dp:
                rejected.append(Rejected(mesh, base, f"global_batch({global_batch}) % dp({dp}) = "
                                                     f"{global_batch % dp}", "batch"))
                continue
            per_replica = global_batch // dp
            counts = microbatch_counts(pp, per_replica)
            if not counts:
                rejected.append(Rejected(mesh, base, f"no microbatch count m with pp({pp}) <= m <= 4*pp dividing "
                                                     f"the per-replica batch {per_replica}", "batch"))
            for m in counts:
                b = per_replica // m
                if b < min_rows:
                    rejected.append(Rejected(mesh, {**base, "num_microbatches": m}, f"microbatch rows {b} < "
                                             f"{min_rows}: {one_row}", "batch"))
                    continue
                if b % layout.unit:
                    rejected.append(Rejected(mesh, {**base, "num_microbatches": m}, f"microbatch rows {b} % "
                                             f"{layout.unit} != 0 ({layout.name} splits rows {layout.unit} ways)",
                                             "tensor parallel"))
                    continue
                for schedule, v in schedules(pp):
                    if pp * v > most:
                        rejected.append(Rejected(mesh, {**base, "schedule": schedule, "chunks_per_rank": v},
                                                 f"pp({pp}) * chunks_per_rank({v}) = {pp * v} stages > {most} "
                                                 f"(segments the graph can be cut into, at most 2 per layer)",
                                                 "stages"))
                        continue
                    specs.append((layout, graph, pp, dp, m, b, schedule, v))

    groups, bounded = {}, []
    fixed = {}                                  # mesh -> step_collectives (the same for every configuration of it)
    for layout, graph, pp, dp, m, b, schedule, v in specs:
        with clock("bounds"):
            time_floor, saved, params = graph.floors(b, profile)    # strategy/floors.py
        mesh = search_mesh(pp, layout.tp, dp, layout.cp)
        if mesh not in fixed:
            fixed[mesh] = step_collectives(profile, world_size, (pp, layout.block, dp))
        for recompute in recompute_modes():
            for shard, why in shardings(dp, schedule):
                options = _options(layout, schedule, v, m, recompute, shard, budget, autocast)
                if why:
                    rejected.append(Rejected(mesh, options, why, "schedule"))
                    continue
                owners = dp * layout.cp           # FSDP shards over dp x cp (passes/stage_bounds.py)
                state = (4 / owners + 1 if shard else 4) * params
                floor = (state + (saved if recompute is None else 0)) / pp - pp * v
                if budget is not None and floor > budget:
                    rejected.append(Rejected(mesh, options,
                                             f"memory >= {floor / 2**30:.1f} GiB (lower bound: dp state + saved "
                                             f"activations over pp={pp}) > budget {budget / 2**30:.1f} GiB", "memory"))
                    continue
                # after its last compute the fullest rank steps at least the mean of the parameters it owns
                # (optimizer_step.py), and every rank pays the step's own collectives (step_time.py *fixed*)
                after_floor = opt_kind.floor(params / pp / (owners if shard else 1), profile) + fixed[mesh]
                bounded.append((m * time_floor / pp + after_floor, describe(mesh, options),
                                (graph, b, recompute), pp, dp, schedule, v, m, shard, options, after_floor, mesh))

    # Two passes, each in increasing order of the time bound: first the layouts already rewritten, then
    # the grid and cp layouts (rewritten when first priced).  Why: their bounds split the single-device
    # ops over every rank of the block and know nothing of the block's own collectives (cp's key
    # all-gathers and all-to-alls, a grid's gathers), so they sort first, and priced first each costs a
    # rewrite and a cut against a loose incumbent (the 22B on 1024: the first configuration priced was a cp
    # one, and each of the 828 cp configurations priced came out slower than the final top five).
    # Pruning is sound in any order (a configuration is dropped only when its bound exceeds ``top`` step
    # times already found), so the ranking is the same; the second pass starts from the first pass's
    # incumbent.
    bounded.sort(key=lambda c: (c[0], c[1]))
    later = [isinstance(c[2][0], (DeferredLayout, ContextLayout)) for c in bounded]
    passes = [[c for c, x in zip(bounded, later) if not x], [c for c, x in zip(bounded, later) if x]]
    found, best, pruned = [], [], 0            # best: max-heap (negated) of the top step times
    for configs in passes:
        for k, (bound, label, key, pp, dp, schedule, v, m, shard, options, after_floor, mesh) in enumerate(configs):
            if prune and len(best) == top and bound > -best[0] * (1 + _SLACK):
                pruned += len(configs) - k          # every later one of this pass has a larger bound
                break
            if isinstance(key[0], (DeferredLayout, ContextLayout)):   # a grid or cp layout, built now if the bound
                #                                                        does not prune it
                deferred, b, recompute = key
                base_key = (deferred.base, b, recompute, False)
                if base_key not in groups:
                    with clock("group costs"):
                        groups[base_key] = Group(deferred.base, b, recompute, profile, layers, b * sample_bytes, False)
                incumbent = -best[0] * (1 + _SLACK) if prune and len(best) == top else float("inf")
                # a rank's compute is at least 1/tp of the single-device ops' times (an op split n ways
                # takes at least 1/n of its time: GEMM efficiency falls with size, launches stay)
                if m * groups[base_key].work / (deferred.tp * pp) + after_floor > incumbent:
                    pruned += 1
                    continue
                with clock("rewrite"):
                    graph = deferred.resolve(b)
                if graph is None:
                    rejected.append(Rejected(mesh, options, deferred.refusal(b), "tensor parallel"))
                    continue
                most = min(len(graph.cuts) + 1, 2 * len(layers)) if layers else len(graph.cuts) + 1
                if pp * v > most:
                    rejected.append(Rejected(mesh, options, f"pp({pp}) * chunks_per_rank({v}) = {pp * v} stages > "
                                             f"{most} (segments the graph can be cut into, at most 2 per layer)",
                                             "stages"))
                    continue
                key = (graph, *key[1:])
            cross = pipeline_crosses_nodes(profile, pp, key[0].tp * dp)
            if pp == 1:     # one stage sends nothing: a group of this key priced for either crossing serves it
                cross = next((c for c in (False, True) if (*key, c) in groups), cross)
            key = (*key, cross)
            if key not in groups:                 # priced once per (layout, b, recompute, crossing), when first needed
                graph, b, recompute, cross = key
                with clock("group costs"):
                    groups[key] = Group(graph, b, recompute, profile, layers, b * sample_bytes, cross)
            group = groups[key]
            incumbent = -best[0] * (1 + _SLACK) if prune and len(best) == top else float("inf")
            if m * group.work / pp + after_floor > incumbent:   # the same bound with the group's full op times
                pruned += 1
                continue
            with clock("pricing"):      # the total alone: the parts of the returned ones are priced below
                result = price(group, pp, dp, schedule, v, m, shard, budget, incumbent, opt_kind, parts=False)
            if result is PRUNED:
                pruned += 1
                continue
            if isinstance(result, str):
                rejected.append(Rejected(mesh, options, result, "memory"))
                continue
            pred, memory, bounds = result
            found.append((pred.total, describe(mesh, options), mesh, options, memory, tuple(bounds),
                          (group, pp, dp, schedule, v, m, shard, budget)))
            heapq.heappush(best, -pred.total)
            if len(best) > top:
                heapq.heappop(best)
    ranked = []
    for total, _, mesh, options, memory, bounds, args in sorted(found, key=lambda c: c[:2])[:top]:
        with clock("pricing"):      # the same run again with its parts (predict_step's ``parts``)
            pred = price(*args, optimizer=opt_kind)[0]
        ranked.append(Candidate(mesh, options, pred.total, memory, {
            "compute": pred.compute, "bubble": pred.bubble, "exposed_comm": pred.exposed_comm,
            "tp_comm": pred.tp_comm, "pp_comm": pred.pp_comm, "dp_comm": pred.dp_comm,
            "optimizer": pred.optimizer}, bounds))
    phases = clock.done()
    return SearchResult(ranked, rejected, pruned, len(found), sum(phases.values()), phases)
