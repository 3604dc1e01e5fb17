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
  post       -- host seconds to post one group (``DeviceProfile.p2p_post``; 0 on GPUs, whose host posts
                while the device computes).  When positive, posting is on the rank's own timeline: a
                group is *posted* ``post`` after the rank's previous compute or post ended, becomes
                active no earlier, and the rank's next compute starts no earlier than its last post.
  dp sync    -- per rank one stream: a stage's ``dp`` starts once its last backward (B or W) ended and
                the rank's previous dp sync is done (replicated dp all-reduces there; FSDP's all-gathers
                are counted there too, an upper bound on what its prefetch exposes).
  sharing    -- processes of the job that compute at once on one host share its cores (a CPU world runs
                several ranks per machine): while n of them compute, each compute progresses at
                1 / ``slowdown[n-1]`` of its own speed (``DeviceProfile.sharing``, measured on the machine;
                None: devices are not shared).  Pipeline rank r stands for its ``group`` = tp * dp processes
                (ranks r*group .. (r+1)*group - 1, mesh.py's layout), which compute in lockstep; a host
                holds ``len(slowdown)`` consecutive ranks.  Only compute is shared: tp collectives,
                transfers and dp sync take their own time.  With sharing the timed run is event-driven
                (a compute's end depends on what else runs meanwhile); without it, a topological pass.
  wake       -- (with sharing) a compute that waited for its input's transfer (the transfer's end is the
                last thing it waited for) starts ``wake`` later (``DeviceProfile.p2p_wake``) if, when the
                data arrives, at least as many of the host's other processes compute as did while it was
                measured (all but the two relaying: the host's processes - 2): the rank must win a core
                back (runtime/sharing_bench.py *wake*).  Part of the transfers' exposed time.
  fixed      -- seconds every rank spends per step outside the schedule, waiting in collectives over
                the whole world: the call check's all-gather before its first action
                (runtime/call_gate.py) and the loss all-reduce after its last (runtime/gradients.py);
                ``step_collectives`` prices them.  Added to every rank's end and to exposed_comm.
  resume     -- a compute that starts after its rank sat idle (it waited for a transfer, or for the other
                end of the pipeline: it starts later than the rank's previous compute or post ended) runs
                its compute part ``resume[0]`` (F) or ``resume[1]`` (B, I, W) times as long
                (``DeviceProfile.resume``: measured on a CPU in the live world by runtime/resume_bench.py,
                where a pass after an idle wait with two microbatches in flight ran 9-14 % slower than
                back to back; 1 on GPUs), and then ``overhead`` seconds longer (``DeviceProfile.pass_overhead``:
                fitted so that this timed run reproduces a reference pipeline measured on the host,
                cost_model/pipeline_fit.py; 0 on GPUs).  Part of compute.
  slowest rank -- the rank whose last compute, group or dp sync ends last; its end is the step time.
  parts      -- of the slowest rank, adding up to ``total``: ``compute`` (its fwd + bwd seconds, as
                stretched by sharing),
                ``exposed_comm`` (its blocking tp collectives, plus how much later it ends than with free
                point-to-point transfers), ``dp_comm`` (dp sync past its last compute), ``bubble`` (the rest:
                idle waiting for other ranks).

With every F = B = 1 and free communication the timed run ends at the unit simulator's step count,
and 1F1B's bubble is (pp - 1)(F + B) (tests/test_step_time.py).
Pure: no process group, no torch; the lowered structure is cached per (schedule, pp, m, v).
"""
from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from autosplit.schedule import (SPLIT_BACKWARD, Action, Group, build_schedule, deferring_stages, lower,
                                placement_of)
from autosplit.schedule.actions import RECV_B, RECV_F, B, F, I, W
from autosplit.schedule.timing import ScheduleDeadlock, dependencies


@dataclass(frozen=True)
class StageTimes:
    """One global stage's durations (see the module docstring); seconds."""
    fwd: float
    bwd: float
    w: float = 0.0
    tp_fwd: float = 0.0
    tp_bwd: float = 0.0
    send: float = 0.0
    dp: float = 0.0


@dataclass(frozen=True)
class StepPrediction:
    """Seconds per step of the slowest rank: total = compute + bubble + exposed_comm + dp_comm."""
    total: float
    compute: float
    bubble: float
    exposed_comm: float
    dp_comm: float
    rank: int                       # the slowest pipeline rank
    rank_ends: tuple[float, ...]    # per pipeline rank, when its step ends

    def line(self) -> str:
        dp = f" + dp sync {self.dp_comm * 1e3:.3f}" if self.dp_comm else ""
        return (f"predicted step: {self.total * 1e3:.3f} ms = compute {self.compute * 1e3:.3f} + bubble "
                f"{self.bubble * 1e3:.3f} + exposed comm {self.exposed_comm * 1e3:.3f}{dp} (slowest rank, "
                f"pp rank {self.rank})")


@dataclass(frozen=True)
class _Node:
    """One value of the timed run: a compute's end, a group's activation, or a group's end."""
    kind: str                 # "compute", "posted", "active", "done"
    rank: int
    deps: tuple[int, ...]     # node indices whose values it waits for
    action: object = None     # the compute (kind "compute")
    transfers: tuple = ()     # kind "done": ((peer active node, boundary stage), ...)
    feed: int = -1            # kind "compute": the "done" node of the group bringing its input, or -1


@functools.lru_cache(maxsize=256)
def _structure(schedule: str, pp: int, m: int, v: int, posts: bool = False) -> tuple[list[_Node], list[int], int]:
    """The timed run's dependency graph (nodes in an order where every dependency comes first); with
    ``posts``, a "posted" node per group on its rank's host timeline (see *post*)."""
    sched = build_schedule(schedule, pp, m, v)
    lists, place, S = lower(sched), sched.placement, sched.num_stages
    recv_group = {}                                  # receive Action -> (rank, group index)
    send_group = {}                                  # send Action -> (rank, group index)
    for r, items in lists.items():
        g = 0
        for item in items:
            if isinstance(item, Group):
                for a in item.actions:
                    (recv_group if a.kind.is_recv else send_group)[a] = (r, g)
                g += 1
    specs: dict[tuple, tuple] = {}     # ("c", Action) / ("a" | "d", (rank, group)) -> (rank, deps, action, transfers)
    for r, items in lists.items():
        last_compute, last_host, g = None, None, 0     # last_host: the rank's last compute or post
        for item in items:
            if isinstance(item, Group):
                deps = [last_compute] if last_compute is not None else []
                if posts:
                    specs[("p", (r, g))] = (r, [last_host] if last_host is not None else [], None, (), None)
                    last_host = ("p", (r, g))
                    deps.append(last_host)
                if g:
                    deps.append(("d", (r, g - 1)))
                specs[("a", (r, g))] = (r, deps, None, (), None)
                transfers = []
                for a in item.actions:
                    peer = a.matching()
                    table = send_group if peer.kind.is_send else recv_group
                    # the boundary is the producing stage's output: SEND_F / RECV_B of stage s and
                    # SEND_B / RECV_F of stage s+1 all carry stage s's output (or its gradient)
                    boundary = min(a.stage, a.peer_stage)
                    transfers.append((("a", table[peer]), boundary))
                specs[("d", (r, g))] = (r, [("a", (r, g))] + [t[0] for t in transfers], None, tuple(transfers), None)
                g += 1
            else:
                deps = [last_host] if last_host is not None else []
                deps += [("c", d) for d in dependencies(item, S)]
                feed = _feed(item)
                fed = ("d", recv_group[feed]) if feed is not None and feed in recv_group else None
                if fed is not None:
                    deps.append(fed)
                specs[("c", item)] = (r, deps, item, (), fed)
                last_compute = last_host = ("c", item)
    order = _topological(specs)
    index = {key: k for k, key in enumerate(order)}
    nodes = []
    for key in order:
        r, deps, action, transfers, fed = specs[key]
        kind = {"c": "compute", "p": "posted", "a": "active", "d": "done"}[key[0]]
        nodes.append(_Node(kind, r, tuple(index[d] for d in deps), action,
                           tuple((index[t], b) for t, b in transfers), index[fed] if fed is not None else -1))
    return nodes, [place.rank(s) for s in range(S)], S


def _feed(a: Action) -> Action | None:
    """The receive that brings compute ``a`` its input (as the simulator's ``_feed``)."""
    if a.kind is W:
        return None
    return Action(a.stage, RECV_F if a.kind is F else RECV_B, a.microbatch)


def _topological(specs: dict[tuple, tuple]) -> list[tuple]:
    """Kahn's order of the spec keys; a cycle means the schedule cannot finish (never for a schedule
    the simulator accepted)."""
    users: dict[tuple, list[tuple]] = {k: [] for k in specs}
    missing = {}
    for k, (_, deps, *_) in specs.items():
        missing[k] = len(deps)
        for d in deps:
            users[d].append(k)
    ready = [k for k, n in missing.items() if n == 0]
    order = []
    while ready:
        k = ready.pop()
        order.append(k)
        for u in users[k]:
            missing[u] -= 1
            if missing[u] == 0:
                ready.append(u)
    if len(order) != len(specs):
        raise ScheduleDeadlock(f"the timed run cannot order {len(specs) - len(order)} of its events: the "
                               f"lowered schedule has a cycle")
    return order


def _duration(a, t: StageTimes) -> float:
    if a.kind is F:
        return t.fwd + t.tp_fwd
    if a.kind is B:
        return t.bwd + t.tp_bwd
    if a.kind is I:
        return t.bwd - t.w + t.tp_bwd
    return t.w


def _tp_part(a, t: StageTimes) -> float:
    """The blocking tp collectives inside compute ``a`` (not compute: sharing does not stretch them)."""
    return t.tp_fwd if a.kind is F else 0.0 if a.kind is W else t.tp_bwd


def _transfer_end(n: _Node, value: list, stages, p2p: bool) -> float:
    mine = value[n.deps[0]]
    return max((max(mine, value[peer]) + (stages[b].send if p2p else 0.0) for peer, b in n.transfers), default=mine)


def _instant(n: _Node, value: list, stages, p2p: bool, post: float) -> float:
    """The value of a non-compute node once its dependencies' values are known."""
    start = max((value[d] for d in n.deps), default=0.0)
    if n.kind == "active":
        return start
    if n.kind == "posted":
        return start + (post if p2p else 0.0)
    return _transfer_end(n, value, stages, p2p)


def _resumed(a, part: float, resume: tuple[float, float], overhead: float) -> float:
    """Compute ``a``'s compute part ``part`` when its rank sat idle before it (see *resume*)."""
    return part * (resume[0] if a.kind is F else resume[1]) + overhead


def _run_shared(nodes: list[_Node], stages: Sequence[StageTimes], p2p: bool, sharing: "Sharing",
                post: float = 0.0, wake: float = 0.0, resume: tuple[float, float] = (1.0, 1.0),
                overhead: float = 0.0):
    """The timed run with processor sharing (see *sharing*): (values, per rank seconds spent computing).

    Events in time order: a compute whose dependencies have ended is *ready* at the latest of their
    ends; from then its compute part runs at the host's current rate, which changes whenever a compute
    on that host starts or finishes its compute part; its tp part follows at full duration.  Groups'
    values are the same formulas as in ``_run`` once their dependencies are known.  A compute that
    waited for its transfer is delayed by ``wake`` once, when it would start (see *wake*); one that starts
    after its rank sat idle is stretched by ``resume`` (see *resume*)."""
    n_nodes = len(nodes)
    value: list = [None] * n_nodes
    missing = [len(n.deps) for n in nodes]
    users: list[list[int]] = [[] for _ in nodes]
    for k, n in enumerate(nodes):
        for d in n.deps:
            users[d].append(k)
    ready: list = []                     # heap of (ready time, node) for computes
    tails: list = []                     # heap of (end time, node): computes in their tp part
    running: dict[int, list] = {}        # rank -> [node, compute seconds left (unshared)]
    busy = [0.0] * (max(n.rank for n in nodes) + 1)
    woken: set[int] = set()              # computes already delayed by ``wake``
    host_free = [0.0] * len(busy)        # per rank: when its last compute or post ended

    def resolve(k: int, t: float) -> None:
        stack = [(k, t)]
        while stack:
            k, t = stack.pop()
            value[k] = t
            if nodes[k].kind in ("compute", "posted"):
                host_free[nodes[k].rank] = max(host_free[nodes[k].rank], t)
            for u in users[k]:
                missing[u] -= 1
                if missing[u] == 0:
                    n = nodes[u]
                    if n.kind == "compute":
                        heapq.heappush(ready, (max((value[d] for d in n.deps), default=0.0), u))
                    else:
                        stack.append((u, _instant(n, value, stages, p2p, post)))

    for k, n in enumerate(nodes):
        if not n.deps:         # (not ``missing[k] == 0``: resolving one node may zero its users' counts)
            if n.kind == "compute":
                heapq.heappush(ready, (0.0, k))
            else:
                resolve(k, _instant(n, value, stages, p2p, post))
    now = 0.0
    while ready or tails or running:
        rates = sharing.rates(running)
        finish = min(((now + left * rates[r], r) for r, (_, left) in running.items()), default=(float("inf"), -1))
        t_next = min(finish[0], ready[0][0] if ready else float("inf"), tails[0][0] if tails else float("inf"))
        for r, entry in running.items():                  # advance every running compute to t_next
            entry[1] -= (t_next - now) / rates[r]
            busy[r] += t_next - now
        now = t_next
        for r in [r for r, (_, left) in running.items() if left <= 1e-12 * max(1.0, now)]:
            k = running.pop(r)[0]
            n = nodes[k]
            tail = _tp_part(n.action, stages[n.action.stage])
            if tail > 0:
                heapq.heappush(tails, (now + tail, k))
            else:
                resolve(k, now)
        while tails and tails[0][0] <= now:
            _, k = heapq.heappop(tails)
            resolve(k, now)
        while ready and ready[0][0] <= now:
            _, k = heapq.heappop(ready)
            n = nodes[k]
            if wake and p2p and k not in woken and _waited_for_transfer(n, value) \
                    and sharing.busy_others(running, n.rank) >= sharing.wake_busy():
                woken.add(k)
                heapq.heappush(ready, (now + wake, k))
                continue
            t = stages[n.action.stage]
            part = _duration(n.action, t) - _tp_part(n.action, t)
            if now > host_free[n.rank] + 1e-12 * max(1.0, now):     # the rank sat idle: see *resume*
                part = _resumed(n.action, part, resume, overhead)
            running[n.rank] = [k, part]
    return value, busy


def _waited_for_transfer(n: _Node, value: list) -> bool:
    """Did compute ``n`` wait for its input's transfer (its group ended after everything else it waited for)?"""
    if n.feed < 0:
        return False
    return value[n.feed] > max((value[d] for d in n.deps if d != n.feed), default=0.0)


@dataclass(frozen=True)
class Sharing:
    """How pipeline ranks share hosts (see *sharing*): ``slowdown[n-1]`` with n processes computing."""
    slowdown: tuple[float, ...]
    group: int = 1

    def rates(self, running) -> dict[int, float]:
        """Per running pipeline rank, seconds of wall time per second of its own compute."""
        per_host = len(self.slowdown)
        ranks_per_host = max(1, per_host // self.group)
        active: dict[int, int] = {}
        for r in running:
            active[r // ranks_per_host] = active.get(r // ranks_per_host, 0) + 1
        out = {}
        for r in running:
            n = min(per_host, active[r // ranks_per_host] * self.group)
            out[r] = self.slowdown[n - 1]
        return out

    def busy_others(self, running, rank: int) -> int:
        """Processes computing on pipeline rank ``rank``'s host, not counting its own group."""
        ranks_per_host = max(1, len(self.slowdown) // self.group)
        host = rank // ranks_per_host
        return sum(self.group for r in running if r != rank and r // ranks_per_host == host)

    def wake_busy(self) -> int:
        """How many other processes computing make a waiting rank pay ``wake``: as measured, the host's
        processes but the two relaying (see *wake*)."""
        return max(1, len(self.slowdown) - 2)


def sharing_of(profile, group: int) -> "Sharing | None":
    """The Sharing a profile implies for pipeline ranks of ``group`` processes; None where nothing is shared."""
    slowdown = getattr(profile, "sharing", None)
    if not slowdown or all(x <= 1.0 for x in slowdown):
        return None
    return Sharing(tuple(max(1.0, x) for x in slowdown), group)


def _run(nodes: list[_Node], stages: Sequence[StageTimes], p2p: bool, post: float = 0.0,
         resume: tuple[float, float] = (1.0, 1.0), overhead: float = 0.0) -> tuple[list[float], list[float]]:
    """The timed run without sharing, in topological order: (values, per rank seconds spent computing)."""
    value = [0.0] * len(nodes)
    busy = [0.0] * (max(n.rank for n in nodes) + 1)
    host_free = [0.0] * len(busy)        # per rank: when its last compute or post ended
    for k, n in enumerate(nodes):
        if n.kind == "compute":
            start = max((value[d] for d in n.deps), default=0.0)
            t = stages[n.action.stage]
            part = _duration(n.action, t) - _tp_part(n.action, t)
            if start > host_free[n.rank] + 1e-12 * max(1.0, start):   # the rank sat idle: see *resume*
                part = _resumed(n.action, part, resume, overhead)
            value[k] = start + part + _tp_part(n.action, t)
            busy[n.rank] += part
        else:
            value[k] = _instant(n, value, stages, p2p, post)
        if n.kind in ("compute", "posted"):
            host_free[n.rank] = max(host_free[n.rank], value[k])
    return value, busy


def _rank_ends(nodes, value, pp: int) -> list[float]:
    ends = [0.0] * pp
    for k, n in enumerate(nodes):
        if n.kind != "active":
            ends[n.rank] = max(ends[n.rank], value[k])
    return ends


def predict_step(schedule: str, pp: int, num_microbatches: int, chunks_per_rank: int,
                 stages: Sequence[StageTimes], sharing: Sharing | None = None, post: float = 0.0,
                 wake: float = 0.0, fixed: float = 0.0,
                 resume: tuple[float, float] = (1.0, 1.0), overhead: float = 0.0) -> StepPrediction:
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
    """
    nodes, rank_of, S = _structure(schedule, pp, num_microbatches, chunks_per_rank, post > 0)
    if len(stages) != S:
        raise ValueError(f"{len(stages)} StageTimes for pp({pp}) * chunks_per_rank({chunks_per_rank}) = {S} stages")
    tp, last_bwd = [0.0] * pp, [0.0] * S
    if sharing is None:
        timed, compute = _run(nodes, stages, p2p=True, post=post, resume=resume, overhead=overhead)
        free, _ = _run(nodes, stages, p2p=False, resume=resume, overhead=overhead)
    else:   # the free run: transfers and posting cost nothing
        (timed, compute), (free, _) = (_run_shared(nodes, stages, p2p, sharing, post, wake, resume, overhead)
                                       for p2p in (True, False))
    ends, free_ends = _rank_ends(nodes, timed, pp), _rank_ends(nodes, free, pp)
    for k, n in enumerate(nodes):
        if n.kind == "compute":
            a, t = n.action, stages[n.action.stage]
            tp[n.rank] += _tp_part(a, t)
            if a.kind is not F:
                last_bwd[a.stage] = max(last_bwd[a.stage], timed[k])
    totals = []
    for r in range(pp):
        clock = 0.0
        for s in sorted((s for s in range(S) if rank_of[s] == r), key=lambda s: last_bwd[s]):
            clock = max(clock, last_bwd[s]) + stages[s].dp
        totals.append(max(ends[r], clock) + fixed)
    r = max(range(pp), key=lambda q: (totals[q], -q))
    exposed = tp[r] + max(0.0, ends[r] - free_ends[r]) + fixed
    return StepPrediction(total=totals[r], compute=compute[r], bubble=ends[r] + fixed - compute[r] - exposed,
                          exposed_comm=exposed, dp_comm=totals[r] - fixed - ends[r], rank=r, rank_ends=tuple(totals))


def plan_stage_times(plan, device=None) -> list[StageTimes]:
    """StageTimes of a compiled Plan, from what its StageInfos hold: fwd / bwd / W seconds, dp sync, and
    ``comm_time`` split into the tp collectives (priced again per stage from ``plan.graph``, the same
    ``collective_time`` the compiler summed) and the boundary (the rest: send forward + gradient back).

    Args:
        plan: an autosplit Plan (read, not imported: the cost model sits below the compiler).
        device: the profile the plan was compiled with; default ``plan.profile`` where a Plan carries
            one, else ``plan.device`` by name ("h100", "cpu", ...).
    """
    from autosplit.cost_model.comm import collective_time
    from autosplit.cost_model.profiles import get_profile
    profile = get_profile(device or getattr(plan, "profile", None) or plan.device)
    tp = [[0.0, 0.0] for _ in plan.stages]
    for n in plan.graph.graph.nodes:
        stage = n.meta.get("stage")
        if stage is not None:
            f, b = collective_time(n, plan.mesh.tp, profile)
            tp[stage][0] += f
            tp[stage][1] += b
    split = plan_deferred_w_stages(plan, profile)
    return [StageTimes(fwd=s.fwd_time, bwd=s.bwd_time, w=s.w_time if k in split else 0.0, tp_fwd=f, tp_bwd=b,
                       send=max(0.0, (s.comm_time - f - b) / 2), dp=s.dp_time)
            for k, (s, (f, b)) in enumerate(zip(plan.stages, tp))]


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
                             plan.mesh.tp, profile.device_type)


def predict_plan(plan, device=None) -> StepPrediction:
    """``predict_step`` of a compiled Plan (its schedule, mesh and StageInfos; see plan_stage_times)."""
    from autosplit.cost_model.profiles import get_profile
    profile = get_profile(device or getattr(plan, "profile", None) or plan.device)
    mesh = plan.mesh
    return predict_step(plan.schedule, mesh.pp, plan.num_microbatches, plan.chunks_per_rank,
                        plan_stage_times(plan, profile), sharing_of(profile, mesh.tp * mesh.dp),
                        profile.p2p_post, profile.p2p_wake, step_collectives(profile, mesh.pp * mesh.tp * mesh.dp),
                        profile.resume, profile.pass_overhead)


CALL_ROW_BYTES = 5 * 8      # runtime/call_gate.py: one row of five int64 per rank
LOSS_BYTES = 2 * 8          # runtime/gradients.py global_mean: loss and overflow flag, float64


def step_collectives(profile, world_size: int) -> float:
    """Seconds of *fixed*: the call check's all-gather of one row per rank and the loss all-reduce, over
    ``world_size`` ranks with ``profile``'s collectives (0 for one rank).

    Args:
        profile: a DeviceProfile or a profile name.
        world_size: ranks of the job (pp * tp * dp).
    """
    from autosplit.cost_model.comm import all_gather_time, all_reduce_time
    return all_gather_time(CALL_ROW_BYTES * world_size, world_size, profile) + \
        all_reduce_time(LOSS_BYTES, world_size, profile)


def lower_bound(schedule: str, pp: int, num_microbatches: int, chunks_per_rank: int,
                stages: Sequence[StageTimes]) -> float:
    """A bound ``predict_step(...).total`` never goes below, without running the schedule (the search
    prunes with it).  For each rank r, whose lowest stage is l (looped or V placement):
      its first compute is a forward of some stage >= l, after that microbatch's forwards of stages < l;
      its computes run one after another (m forwards and backwards of each of its stages);
      without a split backward its last compute is a backward of a stage >= l, and that microbatch's
      backwards of stages < l all follow it.
    So the step lasts at least sum_{s<l} F_s + m * sum_{s on r} (F_s + B_s) [+ sum_{s<l} B_s]; transfers (and wake),
    posting, dp sync and the step's own collectives only add, and so do sharing and resume (factors of at
    least 1).  With equal stages and 1F1B this is the exact (m + pp - 1)(F + B)."""
    place = placement_of(schedule, pp, chunks_per_rank)
    split = schedule in SPLIT_BACKWARD
    fwd = [t.fwd + t.tp_fwd for t in stages]
    bwd = [t.bwd + t.tp_bwd for t in stages]
    bound = 0.0
    for r in range(pp):
        mine = place.stages(r)
        low = min(mine)
        busy = num_microbatches * sum(fwd[s] + bwd[s] for s in mine)
        bound = max(bound, sum(fwd[:low]) + busy + (0.0 if split else sum(bwd[:low])))
    return bound
