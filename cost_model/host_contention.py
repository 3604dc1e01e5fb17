"""What ranks sharing one host cost each other: the CPU-host terms of the step predictor.

A GPU is its own device: none of this applies there (``DeviceProfile.sharing`` None, ``p2p_wake`` 0,
``resume`` (1, 1), ``pass_overhead`` 0), and step_time.py's plain timed run prices it.  On a CPU host that
runs several ranks of the job (how autosplit is tested), the measured profile holds these terms and the
timed run becomes event-driven (``run_shared``).

Terms (see step_time.py for the timed run they stretch):
  sharing  -- processes of the job that compute at once on one host share its cores: while n of them
              compute, each compute progresses at 1 / ``slowdown[n-1]`` of its own speed
              (``DeviceProfile.sharing``, measured on the machine; None: devices are not shared).
              Pipeline rank r stands for its ``group`` = tp * dp processes (ranks r*group ..
              (r+1)*group - 1, mesh.py's layout), which compute in lockstep; a host holds
              ``len(slowdown)`` consecutive ranks.  Only compute is shared: tp collectives, transfers and
              dp sync take their own time.
  wake     -- a compute that waited for its input's transfer starts ``wake`` later (``p2p_wake``) if, when
              the data arrives, at least as many of the host's other processes compute as did while it was
              measured (all but the two relaying): the rank must win a core back.
  resume   -- a compute that starts after its rank sat idle runs its compute part ``resume[0]`` (F) or
              ``resume[1]`` (B, I, W) times as long, and then ``overhead`` (``pass_overhead``) seconds longer.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from autosplit.cost_model.step_events import StageTimes, _duration, _instant, _Node, _tp_part
from autosplit.schedule.actions import F


def resumed(a, part: float, resume: tuple[float, float], overhead: float) -> float:
    """Compute ``a``'s compute part ``part`` when its rank sat idle before it (see *resume*)."""
    return part * (resume[0] if a.kind is F else resume[1]) + overhead


def run_shared(nodes: list[_Node], stages: Sequence[StageTimes], p2p: bool, sharing: "Sharing",
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
                part = resumed(n.action, part, resume, overhead)
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
