"""Predicted seconds of one training step: a timed run of the lowered schedule with real durations.

Terms:
  StageTimes -- per global stage, seconds per microbatch: ``fwd`` and ``bwd`` compute (bwd includes a
                checkpointed stage's recomputed forward), ``w`` (the part of bwd a split-backward
                schedule defers to W; I = bwd - w), ``tp_fwd`` / ``tp_bwd`` (blocking tensor-parallel
                collectives inside the forward / backward), ``send`` (one direction of the stage's
                output boundary: the activation forward, or its gradient back), and ``dp`` (the
                stage's data-parallel gradient sync, seconds per step).
  timed run  -- the schedule's lowered lists (schedule/lower.py) under the simulator's NCCL rules
                (schedule/simulate.py), with durations instead of unit steps:
                  a compute starts when the previous compute of its rank ended, its data dependencies
                  ended (schedule/timing.py ``dependencies``) and the group bringing its input is done;
                  it lasts fwd + tp_fwd (F), bwd + tp_bwd (B), bwd - w + tp_bwd (I) or w (W);
                  a group becomes *active* once the compute before it in its rank's list ended (NCCL's
                  stream waits for the compute stream) and the rank's previous group is done (one queue
                  per rank, only its head runs); a transfer starts when both its groups are active and
                  lasts the producing boundary's ``send``; a group is done when all its transfers are.
  tp overlap -- under tp (without dp_shard) the runtime's B launches the entries' input-gradient
                all-reduces (reduce-scatters under sequence parallelism) asynchronously and runs the weight-
                gradient GEMMs queued so far while they are in flight (runtime/parallel/tp_collectives.py): a B then
                exposes tp_bwd - ``tp_hidden`` of its collectives, tp_hidden = min(tp_bwd, W) on a GPU, whose
                NCCL kernels run beside the GEMMs.  0 on a CPU host: there the gloo collective and the GEMMs
                share the rank's core, and the profile's collectives are timed as a step meets them.  An I
                (its W deferred) hides nothing.
  dp sync    -- per rank one stream: a stage's ``dp`` seconds run in ``dp_buckets`` equal pieces; piece j
                is ready j / k of the way through the stage's final backward (B, or W where W is deferred:
                the runtime arms its buckets there, runtime/parallel/data_parallel.py), and pieces follow each other
                and the rank's previous dp sync on one stream.  So the sync ends max(dp - b (k-1)/k, dp / k)
                after that backward (b: its duration, k: the pieces): DDP's overlap of bucketed all-reduces
                with the backward still running.  One piece (FSDP's "stage" reduce-scatter): all of it after.
  host terms -- on a CPU host running several ranks, the measured sharing, wake, resume and post terms
                stretch the run (host_contention.py); on GPUs they are absent and this run is plain.
  post       -- host seconds to post one group (``DeviceProfile.p2p_post``; 0 on GPUs, whose host posts
                while the device computes).  When positive, posting is on the rank's own timeline: a
                group is *posted* ``post`` after the rank's previous compute or post ended, becomes
                active no earlier, and the rank's next compute starts no earlier than its last post.
  fsdp gathers -- FSDP2 (``dp_shard``) all-gathers parameters before they are used and prefetches the next
                unit's gather while the current unit computes (runtime/parallel/fsdp.py): under "layer" each
                forward and each backward of a microbatch exposes the first unit's gather and whatever of the
                others outlasts the compute before them, ``fsdp_exposed`` (``gather_fwd`` / ``gather_bwd``);
                under "stage" the stage's one gather comes before its first forward (``gather_first``).  They
                lengthen those computes like a blocking collective and count in dp_comm.
  optimizer  -- ``opt.step()`` after the step (optimizer_step.py): per rank the step over the parameters
                its stages own, after its dp sync; the ``optimizer`` part.
  fixed      -- seconds every rank spends per step outside the schedule, waiting in collectives: the
                call check's all-gather over the world before its first action (runtime/faults/call_gate.py)
                and the loss all-reduce after its last, one per mesh axis larger than 1 (tp, dp, pp:
                runtime/parallel/gradients.py); ``step_collectives`` prices them.  Added to every rank's end
                and to dp_comm.
  slowest rank -- the rank whose last compute, group or dp sync ends last; its end is the step time.
  parts      -- of the slowest rank, adding up to ``total``: ``compute`` (its fwd + bwd seconds, as
                stretched by sharing), ``tp_comm`` (its blocking tp collectives), ``pp_comm`` (how much later
                it ends than with free point-to-point transfers), ``dp_comm`` (dp sync past its last compute,
                FSDP's exposed gathers, plus *fixed*), ``optimizer``, ``bubble`` (the rest: idle waiting for
                other ranks).  ``exposed_comm`` is
                tp_comm + pp_comm.

With every F = B = 1 and free communication the timed run ends at the unit simulator's step count,
and 1F1B's bubble is (pp - 1)(F + B) (tests/test_step_time.py).
Pure: no process group, no torch; the lowered structure is cached per (schedule, pp, m, v).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from autosplit.schedule import (SPLIT_BACKWARD, Group, build_schedule, deferring_stages, lower,
                                placement_of)
from autosplit.schedule.actions import MATCHING, RECV_B, RECV_F, F, W
from autosplit.schedule.timing import ScheduleDeadlock, dependency_keys
from autosplit.cost_model.host_contention import Sharing, resumed, run_shared, sharing_of  # noqa: F401 (re-exported)
from autosplit.cost_model.step_events import (StageTimes, _duration, _gather_part, _instant, _Node,  # noqa: F401
                                             _tp_part)


@dataclass(frozen=True)
class StepPrediction:
    """Seconds per step of the slowest rank: total = compute + bubble + tp_comm + pp_comm + dp_comm +
    optimizer (``plan.predicted_step()``; see *parts*)."""
    total: float
    compute: float
    bubble: float
    tp_comm: float
    pp_comm: float
    dp_comm: float
    rank: int                       # the slowest pipeline rank
    rank_ends: tuple[float, ...]    # per pipeline rank, when its step ends
    optimizer: float = 0.0          # its optimizer step (see *optimizer*)

    @property
    def exposed_comm(self) -> float:
        """Exposed tensor- and pipeline-parallel communication: tp_comm + pp_comm."""
        return self.tp_comm + self.pp_comm

    def line(self) -> str:
        dp = f" + dp sync {self.dp_comm * 1e3:.3f}" if self.dp_comm else ""
        opt = f" + optimizer {self.optimizer * 1e3:.3f}" if self.optimizer else ""
        return (f"predicted step: {self.total * 1e3:.3f} ms = compute {self.compute * 1e3:.3f} + bubble "
                f"{self.bubble * 1e3:.3f} + exposed comm {self.exposed_comm * 1e3:.3f} (tp {self.tp_comm * 1e3:.3f}, "
                f"pp {self.pp_comm * 1e3:.3f}){dp}{opt} (slowest rank, pp rank {self.rank})")


@functools.lru_cache(maxsize=256)
def _flat(schedule: str, pp: int, m: int, v: int, posts: bool = False) -> _Flat:
    """The timed run's dependency graph (nodes in an order where every dependency comes first); with
    ``posts``, a "posted" node per group on its rank's host timeline (see *post*).

    Built on integer node ids (each rank's items in list order: a group's posted, active and done
    nodes, a compute's node), then ordered by ``_topological``.  Any order where dependencies come first
    gives the same floats: every sum and tie-break over a rank's nodes follows the rank's own list,
    which each order keeps (a rank's nodes depend on the one before)."""
    sched = build_schedule(schedule, pp, m, v)
    lists, place, S = lower(sched), sched.placement, sched.num_stages
    # actions keyed by (stage, kind, microbatch) tuples: ~10^5 of them, cheaper to hash than Actions
    kinds: list[str] = []                            # per id
    ranks: list[int] = []
    actions: list = []
    compute_id: dict[tuple, int] = {}
    group_ids: list[list[tuple[int, int]]] = []      # per rank, per group: (active id, done id)
    where: dict[tuple, tuple[int, int]] = {}         # a send or receive -> its group's (active id, done id)
    for r, items in lists.items():
        mine = []
        for item in items:
            if isinstance(item, Group):
                if posts:
                    kinds.append("posted"), ranks.append(r), actions.append(None)
                ids = (len(kinds), len(kinds) + 1)
                mine.append(ids)
                kinds += ["active", "done"]
                ranks += [r, r]
                actions += [None, None]
                for a in item.actions:
                    where[(a.stage, a.kind, a.microbatch)] = ids
            else:
                compute_id[(item.stage, item.kind, item.microbatch)] = len(kinds)
                kinds.append("compute"), ranks.append(r), actions.append(item)
        group_ids.append(mine)
    n = len(kinds)
    deps: list[list[int]] = [[] for _ in range(n)]
    transfers: list[tuple] = [()] * n
    feeds = [-1] * n
    for r, items in lists.items():
        last_compute = last_host = -1                # last_host: the rank's last compute or post
        g = 0
        for item in items:
            if isinstance(item, Group):
                active, done = group_ids[r][g]
                if posts:
                    posted = active - 1
                    if last_host >= 0:
                        deps[posted].append(last_host)
                    last_host = posted
                mine = deps[active]
                if last_compute >= 0:
                    mine.append(last_compute)
                if posts:
                    mine.append(last_host)
                if g:
                    mine.append(group_ids[r][g - 1][1])
                peers = []
                for a in item.actions:
                    # the boundary is the producing stage's output: SEND_F / RECV_B of stage s and
                    # SEND_B / RECV_F of stage s+1 all carry stage s's output (or its gradient)
                    peer = a.peer_stage
                    peers.append((where[(peer, MATCHING[a.kind], a.microbatch)][0], min(a.stage, peer)))
                deps[done] = [active] + [p for p, _ in peers]
                transfers[done] = tuple(peers)
                g += 1
            else:
                s, kind, i = item.stage, item.kind, item.microbatch
                k = compute_id[(s, kind, i)]
                mine = deps[k]
                if last_host >= 0:
                    mine.append(last_host)
                mine += [compute_id[d] for d in dependency_keys(s, kind, i, S)]
                # the receive that brings it its input (as the simulator's ``_feed``): none for a W
                fed = where.get((s, RECV_F if kind is F else RECV_B, i)) if kind is not W else None
                if fed is not None:
                    feeds[k] = fed[1]
                    mine.append(fed[1])
                last_compute = last_host = k
    order = _topological(deps)
    index = [0] * n
    for pos, k in enumerate(order):
        index[k] = pos
    return _Flat([kinds[k] for k in order], [ranks[k] for k in order],
                 [tuple(index[d] for d in deps[k]) for k in order], [actions[k] for k in order],
                 [tuple((index[t], b) for t, b in transfers[k]) for k in order],
                 [index[feeds[k]] if feeds[k] >= 0 else -1 for k in order], [place.rank(s) for s in range(S)], S)


def _topological(deps: list[list[int]]) -> list[int]:
    """Kahn's order of the node ids; a cycle means the schedule cannot finish (never for a schedule
    the simulator accepted)."""
    users: list[list[int]] = [[] for _ in deps]
    missing = [len(d) for d in deps]
    for k, mine in enumerate(deps):
        for d in mine:
            users[d].append(k)
    ready = [k for k, c in enumerate(missing) if c == 0]
    order = []
    while ready:
        k = ready.pop()
        order.append(k)
        for u in users[k]:
            missing[u] -= 1
            if missing[u] == 0:
                ready.append(u)
    if len(order) != len(deps):
        raise ScheduleDeadlock(f"the timed run cannot order {len(deps) - len(order)} of its events: the "
                               f"lowered schedule has a cycle")
    return order


class _Flat:
    """A timed run's nodes as plain lists (the search runs it for every configuration it prices): per
    node its kind code (``_COMPUTE``, ``_ACTIVE``, ``_POSTED``, ``_DONE``), deps, rank, action (a
    compute's), transfers (a done node's: (peer active node, boundary stage)) and feed, and for a compute
    the index of its (stage, kind, first microbatch) in ``keys``, whose durations ``_Parts`` tabulates
    once per run; ``rank_of`` (per stage its rank) and ``S`` (stages)."""

    def __init__(self, kinds: list[str], ranks: list[int], deps: list[tuple], actions: list, transfers: list[tuple],
                 feeds: list[int], rank_of: list[int], S: int):
        codes = {name: code for code, name in enumerate(_KIND_NAMES)}
        self.n = len(kinds)
        self.kinds = [codes[k] for k in kinds]
        self.deps, self.ranks, self.actions, self.transfers, self.feeds = deps, ranks, actions, transfers, feeds
        self.rank_of, self.S = rank_of, S
        self.ranks_count = max(ranks) + 1
        index: dict[tuple, int] = {}
        self.keys, self.key_of = [], []
        for a in actions:
            if a is None:
                self.key_of.append(-1)
                continue
            key = (a.stage, a.kind, a.microbatch == 0)
            if key not in index:
                index[key] = len(self.keys)
                self.keys.append(a)              # a representative action of the key
            self.key_of.append(index[key])
        self.computes = [k for k, key in enumerate(self.key_of) if key >= 0]       # the compute nodes, in order
        # per key: its stage where it is a backward action (B, I or W; the dp sync waits for the last), else -1
        self.backward_stage = [a.stage if a.kind is not F else -1 for a in self.keys]

    @functools.cached_property
    def key_counts(self) -> list[list[tuple[int, int]]]:
        """Per rank, (key, how many of its computes have that key): a rank's whole compute, unstretched."""
        counts: list[dict[int, int]] = [{} for _ in range(self.ranks_count)]
        for k in self.computes:
            mine = counts[self.ranks[k]]
            mine[self.key_of[k]] = mine.get(self.key_of[k], 0) + 1
        return [sorted(c.items()) for c in counts]

    @functools.cached_property
    def nodes(self) -> list[_Node]:
        """The same graph as ``_Node``s (the run with sharing, host_contention.py, reads these)."""
        return [_Node(_KIND_NAMES[code], *fields)
                for code, *fields in zip(self.kinds, self.ranks, self.deps, self.actions, self.transfers, self.feeds)]


_COMPUTE, _ACTIVE, _POSTED, _DONE = range(4)
_KIND_NAMES = ("compute", "active", "posted", "done")           # by code


class _Parts:
    """Per key of a ``_Flat`` (a stage's F, B, I or W; a stage's first forward apart): the compute part,
    the tp part (``_tp_part``), the whole duration (``_duration``) and FSDP's gather part."""

    def __init__(self, flat: _Flat, stages: Sequence[StageTimes]):
        self.part, self.tp, self.duration, self.gather = [], [], [], []
        for a in flat.keys:
            t = stages[a.stage]
            tp, duration = _tp_part(a, t), _duration(a, t)
            self.part.append(duration - tp)
            self.tp.append(tp)
            self.duration.append(duration)
            self.gather.append(_gather_part(a, t))


def _run(flat: _Flat, parts: _Parts, stages: Sequence[StageTimes], p2p: bool, post: float = 0.0,
         resume: tuple[float, float] = (1.0, 1.0), overhead: float = 0.0,
         caps: list[float] | None = None) -> tuple[list[float], list[float]] | None:
    """The timed run without sharing, in topological order: (values, per rank seconds spent computing).
    (``_instant`` spelled out over ``flat``'s lists: the same floats in the same order.)

    ``caps``: per rank, an end its last compute must not pass (see ``predict_step``'s ``limit``): None
    as soon as one compute's end plus the unstretched compute its rank has left passes its rank's cap."""
    value = [0.0] * flat.n
    busy = [0.0] * flat.ranks_count
    host_free = [0.0] * flat.ranks_count        # per rank: when its last compute or post ended
    transfers, actions = flat.transfers, flat.actions
    kinds, deps_of, ranks, key_of = flat.kinds, flat.deps, flat.ranks, flat.key_of
    part_of, tp_of = parts.part, parts.tp
    wait = post if p2p else 0.0
    send = [t.send if p2p else 0.0 for t in stages]
    if caps is not None:        # per rank the compute it has left: each of its computes starts after the one
        left = [sum(n * (part_of[key] + tp_of[key]) for key, n in mine)       # before it (its list's order)
                for mine in flat.key_counts]
    for k in range(flat.n):
        kind, deps = kinds[k], deps_of[k]
        # max() spelled out for the one- and two-element cases (most nodes): the first of the largest,
        # as max() picks, so the same floats
        if kind == _DONE:           # step_events._transfer_end
            mine = end = value[deps[0]]
            first = True
            for peer, b in transfers[k]:
                v = value[peer]
                t = (v if v > mine else mine) + send[b]
                if first or t > end:
                    end, first = t, False
            value[k] = end
            continue
        n_deps = len(deps)
        if n_deps == 1:
            start = value[deps[0]]
        elif n_deps == 2:
            a, b = value[deps[0]], value[deps[1]]
            start = b if b > a else a
        else:
            start = max([value[d] for d in deps]) if deps else 0.0
        if kind == _ACTIVE:
            value[k] = start
        elif kind == _COMPUTE:
            r, key = ranks[k], key_of[k]
            part = part_of[key]
            if start > host_free[r] + 1e-12 * max(1.0, start):   # the rank sat idle: see *resume*
                part = resumed(actions[k], part, resume, overhead)
            value[k] = end = start + part + tp_of[key]
            busy[r] += part
            if end > host_free[r]:
                host_free[r] = end
            if caps is not None:
                left[r] -= part_of[key] + tp_of[key]
                if end + left[r] > caps[r]:
                    return None
        else:                       # posted
            value[k] = end = start + wait
            if end > host_free[ranks[k]]:
                host_free[ranks[k]] = end
    return value, busy


def _rank_ends(flat: _Flat, value, pp: int) -> list[float]:
    ends = [0.0] * pp
    kinds, ranks = flat.kinds, flat.ranks
    for k in range(flat.n):
        if kinds[k] != _ACTIVE and value[k] > ends[ranks[k]]:
            ends[ranks[k]] = value[k]
    return ends


def predict_step(schedule: str, pp: int, num_microbatches: int, chunks_per_rank: int,
                 stages: Sequence[StageTimes], sharing: Sharing | None = None, post: float = 0.0,
                 wake: float = 0.0, fixed: float = 0.0,
                 resume: tuple[float, float] = (1.0, 1.0), overhead: float = 0.0,
                 parts: bool = True, limit: float = float("inf")) -> StepPrediction | None:
    """Seconds of one step of ``schedule`` (see the module docstring).

    Args:
        schedule: one of autosplit.schedule.SCHEDULES; its placement maps stages to ranks.
        pp, num_microbatches, chunks_per_rank: the pipeline's shape (pp * chunks_per_rank stages).
        stages: one StageTimes per global stage, in stage order.
        sharing: how ranks share a host's cores (``sharing_of(profile, tp * dp)``); None: not shared.
        post: host seconds per posted transfer group (``profile.p2p_post``; see *post*).
        wake: seconds a waiting rank pays to get a core back on a busy host (``profile.p2p_wake``; see
            *wake*; only with ``sharing``).
        fixed: seconds of the step's own collectives outside the schedule (``step_collectives``; see
            *fixed*).
        resume: (F, B) factors on a compute that starts after its rank sat idle (``profile.resume``;
            see *resume*).
        overhead: seconds added to such a compute after ``resume`` (``profile.pass_overhead``).
        parts: False skips the run with free transfers (half the work; the strategy search ranks by
            ``total`` and asks for the parts of the configurations it returns): ``pp_comm`` is then 0 and
            the transfers' delay counts in ``bubble``; ``total`` and every other part are the same.
        limit: None is returned, the run stopped where it is known, once the total is sure to exceed it
            (the search's incumbent: most of the configurations it runs lose, by 8-44 % on the 22B
            search).  A rank ends no earlier than a compute's end plus the computes its list still holds,
            unstretched, and then pays ``fixed`` and its optimizer step.  Only without ``sharing``, and
            with ``resume`` factors of at least 1.
    """
    flat = _flat(schedule, pp, num_microbatches, chunks_per_rank, post > 0)
    nodes, rank_of, S = flat.nodes if sharing is not None else None, flat.rank_of, flat.S
    if len(stages) != S:
        raise ValueError(f"{len(stages)} StageTimes for pp({pp}) * chunks_per_rank({chunks_per_rank}) = {S} stages")
    table = _Parts(flat, stages)
    tp, gathers, last_bwd, last_dur = [0.0] * pp, [0.0] * pp, [0.0] * S, [0.0] * S
    opt = [0.0] * pp
    for s in range(S):
        opt[rank_of[s]] += stages[s].opt
    if sharing is None:
        # (a profile file may state resume factors below 1: a compute could then end sooner than its part)
        bounded = limit < float("inf") and min(resume) >= 1.0 and overhead >= 0.0
        caps = [limit - fixed - o for o in opt] if bounded else None
        run = _run(flat, table, stages, p2p=True, post=post, resume=resume, overhead=overhead, caps=caps)
        if run is None:
            return None
        timed, compute = run
    else:
        timed, compute = run_shared(nodes, stages, True, sharing, post, wake, resume, overhead)
    ends = _rank_ends(flat, timed, pp)
    free_ends = ends
    if parts:       # the free run: transfers and posting cost nothing
        if sharing is None:
            free, _ = _run(flat, table, stages, p2p=False, resume=resume, overhead=overhead)
        else:
            free, _ = run_shared(nodes, stages, False, sharing, post, wake, resume, overhead)
        free_ends = _rank_ends(flat, free, pp)
    key_of, ranks, backward_stage = flat.key_of, flat.ranks, flat.backward_stage
    tp_of, gather_of = table.tp, table.gather
    for k in flat.computes:         # in node order: each rank's sums in its list's order
        key = key_of[k]
        r, g = ranks[k], gather_of[key]
        tp[r] += tp_of[key] - g
        gathers[r] += g
        stage = backward_stage[key]
        if stage >= 0 and timed[k] >= last_bwd[stage]:
            last_bwd[stage], last_dur[stage] = timed[k], table.duration[key]
    totals = []
    for r in range(pp):
        clock = 0.0
        for s in sorted((s for s in range(S) if rank_of[s] == r), key=lambda s: last_bwd[s]):
            t = stages[s]
            clock = max(clock, last_bwd[s] - _sync_hidden(last_dur[s], t)) + t.dp
        # the optimizer steps once the rank's gradients are synced (opt.step() after pm.step)
        totals.append(max(ends[r], clock) + fixed + opt[r])
    r = max(range(pp), key=lambda q: (totals[q], -q))
    p2p = max(0.0, ends[r] - free_ends[r])
    return StepPrediction(total=totals[r], compute=compute[r], bubble=ends[r] - compute[r] - tp[r] - gathers[r] - p2p,
                          tp_comm=tp[r], pp_comm=p2p, dp_comm=totals[r] - ends[r] - opt[r] + gathers[r], rank=r,
                          rank_ends=tuple(totals), optimizer=opt[r])


def plan_stage_times(plan, device=None, optimizer="adamw") -> list[StageTimes]:
    """StageTimes of a compiled Plan, from what its StageInfos hold: fwd / bwd / W seconds, dp sync and
    FSDP gathers, the optimizer step, and ``comm_time`` split into the tp collectives (priced again per
    stage from ``plan.graph``, the same ``collective_time`` the compiler summed, with the forward ones
    recomputation runs again in backward) and the boundary (the rest: send forward + gradient back).

    Args:
        plan: an autosplit Plan (read, not imported: the cost model sits below the compiler).
        device: the profile the plan was compiled with; default ``plan.profile`` where a Plan carries
            one, else ``plan.device`` by name ("h100", "cpu", ...).
        optimizer: the job's optimizer (optimizer_step.py ``optimizer_kind``: a class, an instance or a name).
    """
    from autosplit.cost_model.comm import collective_time
    from autosplit.cost_model.optimizer_step import optimizer_kind
    from autosplit.cost_model.profiles import get_profile
    profile = get_profile(device or getattr(plan, "profile", None) or plan.device)
    kind = optimizer_kind(optimizer)
    tp = [[0.0, 0.0] for _ in plan.stages]
    for n in plan.graph.graph.nodes:
        stage = n.meta.get("stage")
        if stage is not None:
            f, b = collective_time(n, plan.mesh.block, profile)
            tp[stage][0] += f
            tp[stage][1] += b
    split = plan_deferred_w_stages(plan, profile)
    sharding = getattr(plan, "dp_shard", None)
    overlap = tp_overlaps(profile, plan.mesh.block, sharding)
    owned = plan.mesh.dp * plan.mesh.cp if sharding else 1      # FSDP: each rank steps its 1/(dp cp) shard
    out = []
    for k, (s, (f, b)) in enumerate(zip(plan.stages, tp)):
        again = getattr(s, "recompute_comm", 0.0)
        gathers = stage_gathers(_StageDp(sharding, getattr(s, "dp_gather", 0.0), getattr(s, "dp_units", 1)),
                                s.fwd_time, s.bwd_time)
        out.append(StageTimes(fwd=s.fwd_time, bwd=s.bwd_time, w=s.w_time if k in split else 0.0, tp_fwd=f,
                              tp_bwd=b + again, send=max(0.0, (s.comm_time - f - b - again) / 2), dp=s.dp_time,
                              dp_buckets=getattr(s, "dp_buckets", 1),
                              tp_hidden=min(b + again, s.w_time) if overlap else 0.0,
                              opt=kind.time(s.param_bytes / owned, len(s.params), profile), **gathers))
    return out


class _StageDp:
    """The fields of a DataParallelCost ``stage_gathers`` reads, from a StageInfo."""

    def __init__(self, sharding, gather: float, units: int):
        self.sharding, self.gather, self.units = sharding, gather, units


def tp_overlaps(profile, tp: int, dp_shard) -> bool:
    """Whether a B hides backward tp collectives under its weight-gradient GEMMs (see *tp overlap*)."""
    return tp > 1 and not dp_shard and profile.device_type == "cuda"


@functools.lru_cache(maxsize=256)
def deferred_w_stages(schedule: str, pp: int, m: int, v: int, tp: int, device_type: str) -> frozenset[int]:
    """The stages whose W the runtime really defers (a W priced apart from its I; elsewhere I is the
    whole backward and W nothing): under an I / W schedule ``schedule.deferring_stages``, with the early
    hand-off worth the split's cost except on a CPU (``device_type``, the profile's); every stage when
    tp > 1 (the runtime splits every stage there, for its overlapped backward: runtime/rank_plan.py);
    none under F / B schedules."""
    if schedule not in SPLIT_BACKWARD:
        return frozenset()
    if tp > 1:
        return frozenset(range(pp * v))
    actions = build_schedule(schedule, pp, m, v).actions
    return frozenset(deferring_stages(actions, early_send=device_type != "cpu"))


def plan_deferred_w_stages(plan, device=None) -> frozenset[int]:
    """``deferred_w_stages`` of a compiled Plan (its schedule and mesh), for the device type of
    ``device`` (default: the plan's own profile, as ``plan_stage_times``)."""
    from autosplit.cost_model.profiles import get_profile
    profile = get_profile(device or getattr(plan, "profile", None) or plan.device)
    return deferred_w_stages(plan.schedule, plan.mesh.pp, plan.num_microbatches, plan.chunks_per_rank,
                             plan.mesh.block, profile.device_type)


def predict_plan(plan, device=None, optimizer="adamw") -> StepPrediction:
    """``predict_step`` of a compiled Plan (its schedule, mesh and StageInfos; see plan_stage_times), with
    ``optimizer``'s step (optimizer_step.py) as the ``optimizer`` part."""
    from autosplit.cost_model.profiles import get_profile
    profile = get_profile(device or getattr(plan, "profile", None) or plan.device)
    mesh = plan.mesh
    return predict_step(plan.schedule, mesh.pp, plan.num_microbatches, plan.chunks_per_rank,
                        plan_stage_times(plan, profile, optimizer), sharing_of(profile, mesh.block * mesh.dp),
                        profile.p2p_post, profile.p2p_wake,
                        step_collectives(profile, mesh.size, (mesh.pp, mesh.block, mesh.dp)),
                        profile.resume, profile.pass_overhead)


CALL_ROW_BYTES = 5 * 8      # runtime/faults/call_gate.py: one row of five int64 per rank
LOSS_BYTES = 2 * 8          # runtime/parallel/gradients.py global_mean: loss and overflow flag, float64


def step_collectives(profile, world_size: int, mesh: tuple[int, int, int] | None = None) -> float:
    """Seconds of *fixed*: the call check's all-gather of one row per rank over the world, and the loss
    all-reduces (0 for one rank).

    Args:
        profile: a DeviceProfile or a profile name.
        world_size: ranks of the job (pp * tp * dp).
        mesh: (pp, tp, dp): the loss is summed by one all-reduce per axis larger than 1, tp, dp then pp
            (runtime/parallel/gradients.py ``global_mean``), each over the nodes its group spans (tp
            consecutive ranks, dp every tp-th, pp every (tp dp)-th: mesh.py's layout); None: one
            all-reduce over the world.
    """
    from autosplit.cost_model.comm import all_gather_time, all_reduce_time, group_nodes
    gather = all_gather_time(CALL_ROW_BYTES * world_size, world_size, profile)
    if mesh is None:
        return gather + all_reduce_time(LOSS_BYTES, world_size, profile)
    pp, tp, dp = mesh
    # one group after another (each waits for the sum before it): their times add
    return gather + sum(all_reduce_time(LOSS_BYTES, n, profile, group_nodes(profile, n, stride))
                        for n, stride in ((tp, 1), (dp, tp), (pp, tp * dp)) if n > 1)


def fsdp_exposed(gather: float, units: int, compute: float) -> float:
    """Exposed seconds of one pass's FSDP2 all-gathers (*fsdp gathers*): ``gather`` seconds over ``units``
    equal units, each prefetched while the unit before it computes (``compute`` / units of the pass):
    the first unit's gather waits in full, every later one only for what outlasts that compute."""
    if gather <= 0 or units <= 0:
        return 0.0
    one = gather / units
    return one + (units - 1) * max(0.0, one - compute / units)


def stage_gathers(dp_cost, fwd: float, bwd: float) -> dict:
    """StageTimes' gather fields of one stage from its ``cost_model.sharding.DataParallelCost`` and its
    compute per microbatch (forward, backward)."""
    if dp_cost.sharding == "layer":
        return {"gather_fwd": fsdp_exposed(dp_cost.gather, dp_cost.units, fwd),
                "gather_bwd": fsdp_exposed(dp_cost.gather, dp_cost.units, bwd)}
    if dp_cost.sharding == "stage":
        return {"gather_first": dp_cost.gather}
    return {}


def lower_bound(schedule: str, pp: int, num_microbatches: int, chunks_per_rank: int,
                stages: Sequence[StageTimes], fixed: float = 0.0) -> float:
    """A bound ``predict_step(...).total`` never goes below, without running the schedule (the search
    prunes with it).  For each rank r, whose lowest stage is l (looped or V placement):
      its first compute is a forward of some stage >= l, after that microbatch's forwards of stages < l
      and the transfers between those stages that sit on different ranks;
      its computes run one after another (m forwards and backwards of each of its stages, FSDP2's exposed
      gathers inside them: *fsdp gathers*);
      without a split backward its last compute is a backward of a stage >= l, and that microbatch's
      backwards of stages < l, and their transfers, all follow it;
      its last compute is the final backward (B, I or W) of one of its stages s, and that stage's dp sync
      ends at least dp_s - min(d_s, dp_s) (k_s - 1) / k_s after it (*dp sync*: d_s the longest backward
      action of s, k_s its pieces), so its end is at least the smallest such remainder later.
    So rank r ends no earlier than its last compute plus that remainder, then its optimizer step
    (sum_{s on r} opt_s); and without a split backward the drain ends on stage 0's rank, then that rank's
    optimizer step; every rank then pays ``fixed``.  Posting, wake, sharing and resume only add (factors
    of at least 1), and so do the transfers and syncs of the steady state.  With equal stages, 1F1B and
    free communication this is the exact (m + pp - 1)(F + B)."""
    place = placement_of(schedule, pp, chunks_per_rank)
    split = schedule in SPLIT_BACKWARD
    m = num_microbatches
    fwd = [t.fwd + t.tp_fwd + t.gather_fwd for t in stages]
    bwd = [t.bwd + t.tp_bwd - t.tp_hidden + t.gather_bwd for t in stages]
    rank = [place.rank(s) for s in range(len(stages))]
    # boundary s (stage s's output, forward and back) costs its send where s and s + 1 sit on different ranks
    hop = [t.send if s + 1 < len(stages) and rank[s] != rank[s + 1] else 0.0 for s, t in enumerate(stages)]
    opt = [sum(stages[s].opt for s in place.stages(r)) for r in range(pp)]   # after a rank's last compute
    bound = 0.0
    for r in range(pp):
        mine = place.stages(r)
        low = min(mine)
        end = sum(fwd[:low]) + sum(hop[:low]) + sum(m * (fwd[s] + bwd[s]) + stages[s].gather_first for s in mine)
        bound = max(bound, end + min(_sync_left(stages[s], split) for s in mine) + opt[r])
        if not split and low:           # the drain, down to stage 0's rank
            bound = max(bound, end + sum(bwd[:low]) + sum(hop[:low]) + opt[rank[0]])
    return bound + fixed


def _sync_left(t: StageTimes, split: bool) -> float:
    """The least of a stage's dp sync that can end after its final backward action (see lower_bound)."""
    if t.dp <= 0:
        return 0.0
    longest = max(t.bwd + t.tp_bwd + t.gather_bwd, t.w) if split else t.bwd + t.tp_bwd - t.tp_hidden + t.gather_bwd
    return t.dp - _sync_hidden(longest, t)


def _sync_hidden(duration: float, t: StageTimes) -> float:
    """Seconds of a stage's dp sync hidden under its final backward action of ``duration``: the buckets
    of its first (k-1)/k (see *dp sync*; 0 for one piece)."""
    return min(duration, t.dp) * (t.dp_buckets - 1) / t.dp_buckets if t.dp_buckets > 1 else 0.0
