"""A discrete-time simulator of lowered schedules under NCCL's rules: proves a schedule finishes, counts idle.

Terms:
  step      -- one unit of time.  Each compute action (F, B, I or W of one chunk) takes exactly one
               step on its rank; communication takes zero time.
  host      -- a rank's program counter; it runs the rank's lowered list strictly in order: it *posts*
               each group (without waiting for it) and runs each compute once the compute is ready.
  queue     -- per rank, the posted groups not yet done, in posting order.  As on NCCL, where one
               rank's point-to-point groups run one after another on one stream, only the head of the
               queue is in progress; the groups behind it wait.
  matched   -- a send and its receive (same microbatch, the peer stage) are matched when each is in
               the head group of its rank's queue at the same time: sends are rendezvous, they do not
               complete on their own.  A send can only match once the compute that produces it ran.
  done      -- a group is done (and leaves the queue) when every one of its actions is matched.
  ready     -- a compute is ready once its data dependencies ran in an *earlier* step (F(s, i) needs
               F(s-1, i); B(s, i) needs F(s, i) and, unless s is the last stage, B(s+1, i); I the same
               with I; W(s, i) needs I(s, i)) and the group holding the receive that feeds it is done.  So an F at step t on stage s lets
               stage s+1 run F at step t+1, whether on another rank or on the same rank.
  in one step, first every queue makes what progress it can (matching repeats until nothing changes),
               then each host posts the groups at its position, runs at most one ready compute, and
               posts the groups after it, stopping at the next compute.  A bare SEND_*/RECV_* action
               in a list is a group of one (the executor's posting order before fusion can be replayed).
  deadlock  -- a step in which no action matches, no group finishes and no host moves while some list
               or queue is unfinished.
  pair order -- NCCL matches the transfers between two ranks in one direction by position, not tag:
               rank a's sends to b, in posting order, must be b's receives from a, in posting order
               (checked before the run).
  busy / idle -- steps in which a rank did / did not run a compute.  ``idle_fraction`` is the total
               idle rank-steps over ``steps * pp``.
  in flight -- on one rank, the (stage, microbatch) pairs whose F ran and whose B (or I) has not:
               the activations that rank must hold.  ``peak_activations[r]`` is its maximum over time.
  pending W -- the (stage, microbatch) pairs whose I ran and whose W has not: each holds the inputs
               and output gradients of its weight GEMMs.  ``peak_pending_w[r]`` is its maximum.
  placement -- which rank holds each stage (placement.py); a Schedule brings its own.

Grid format (``SimResult.format_grid``): a header row ``step  rank 0  rank 1 ...``, then one row per
step holding, per rank, the compute it ran in compact action form (``2F0`` = stage 2 forward of
microbatch 0, ``1B3`` = stage 1 backward of microbatch 3, ``1I3`` / ``0W2`` its input / weight
halves) or ``.`` when idle.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from autosplit.errors import AutosplitError

from .actions import RECV_B, RECV_F, SEND_F, Action, B, F, Group, I, Item, W
from .generate import Schedule, build_schedule
from .lower import flatten, lower
from .placement import Placement
from .timing import ScheduleDeadlock, dependencies


@dataclass
class SimResult:
    steps: int                      # makespan in steps
    busy: list[int]                 # compute steps per rank
    grid: list[list[str | None]]    # grid[t][r]: compute label rank r ran at step t, or None
    peak_activations: list[int]     # per rank, max (stage, microbatch) pairs in flight
    peak_pending_w: list[int] = None  # per rank, max (stage, microbatch) pairs with I done, W not

    @property
    def pp(self) -> int:
        return len(self.busy)

    @property
    def idle(self) -> list[int]:
        return [self.steps - b for b in self.busy]

    @property
    def idle_fraction(self) -> float:
        total = self.steps * self.pp
        return sum(self.idle) / total if total else 0.0

    def format_grid(self) -> str:
        header = ["step"] + [f"rank {r}" for r in range(self.pp)]
        rows = [[str(t)] + [cell or "." for cell in row] for t, row in enumerate(self.grid)]
        widths = [max(len(row[k]) for row in [header] + rows) for k in range(len(header))]

        def line(row: list[str]) -> str:
            cells = [row[0].rjust(widths[0])] + [c.ljust(w) for c, w in zip(row[1:], widths[1:])]
            return "  ".join(cells).rstrip()

        return "\n".join(line(row) for row in [header] + rows)


def check_schedule(name: str, pp: int, num_microbatches: int, chunks_per_rank: int = 1) -> SimResult:
    """Build, lower and simulate a schedule; raises ScheduleDeadlock if it cannot finish."""
    return simulate(build_schedule(name, pp, num_microbatches, chunks_per_rank))


def peak_in_flight(schedule: Schedule) -> list[int]:
    """``simulate(schedule).peak_activations`` without running it: a rank runs its computes in list
    order whatever the timing, and the in-flight count changes only at its own computes (``_account``),
    so the peak is a scan of each rank's list.  It proves nothing about deadlock (``check_schedule``
    does); the strategy search uses it to price memory for sizes the simulator would take seconds on."""
    peaks = []
    for r in range(schedule.pp):
        live = peak = 0
        for a in schedule.actions.get(r, ()):
            live += 1 if a.kind is F else -1 if a.kind.sends_grad else 0
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def simulate(schedule_or_lowered: Schedule | dict[int, list[Item]],
             num_stages: int | None = None, placement: Placement | None = None) -> SimResult:
    """Run every rank's lowered list together, one step at a time (see the module docstring).

    Args:
        schedule_or_lowered: a ``Schedule`` (lowered first), or a dict rank -> lowered list.
        num_stages: for a dict; defaults to one more than the largest stage in it.
        placement: for a dict; defaults to the looped placement.
    """
    if isinstance(schedule_or_lowered, Schedule):
        sched = schedule_or_lowered
        lists, num_stages, placement = lower(sched), sched.num_stages, sched.placement
    else:
        lists = schedule_or_lowered
        if num_stages is None:
            num_stages = 1 + max((a.stage for acts in lists.values() for a in flatten(acts)), default=0)
        if placement is None:
            placement = Placement(len(lists), -(-num_stages // max(len(lists), 1)))
    return _Sim(lists, num_stages, placement).run()


class _Posted:
    """A group in a rank's queue: its actions not yet matched."""

    def __init__(self, group: Group):
        self.group, self.waiting = group, set(group.actions)


class _Sim:
    def __init__(self, lists: dict[int, list[Item]], num_stages: int, placement: Placement):
        self.pp, self.place = len(lists), placement
        if sorted(lists) != list(range(self.pp)):
            raise AutosplitError(f"lists are keyed by ranks {sorted(lists)}; expected 0..{self.pp - 1}")
        for rank, items in lists.items():
            for a in flatten(items):
                if placement.rank(a.stage) != rank:
                    raise AutosplitError(f"{a} is in rank {rank}'s list but {placement.describe(a.stage)}")
        # a bare communication action is a group of one
        self.lists = {r: [Group((it,)) if isinstance(it, Action) and not it.is_compute else it for it in items]
                      for r, items in lists.items()}
        self.num_stages = num_stages
        self.recvs = [{a for a in flatten(items) if a.kind.is_recv} for _, items in sorted(lists.items())]
        # the gradient a SEND_B carries comes from B, or from I in a split-backward schedule
        self.grad_kind = I if any(a.kind is I for items in lists.values() for a in flatten(items)) else B
        self.pos = [0] * self.pp
        self.queue: list[deque[_Posted]] = [deque() for _ in range(self.pp)]
        self.ran: dict[Action, int] = {}        # compute -> step it ran in
        self.received: dict[Action, int] = {}   # receive -> step its group finished
        self.inflight = [0] * self.pp
        self.peak = [0] * self.pp
        self.pending_w = [0] * self.pp
        self.peak_w = [0] * self.pp
        self.busy = [0] * self.pp

    def _finished(self) -> bool:
        return all(self.pos[r] == len(self.lists[r]) and not self.queue[r] for r in range(self.pp))

    def _check_pair_order(self) -> None:
        """NCCL ignores tags: between two ranks, in one direction, the n-th send is matched with the
        n-th receive.  So rank a's sends to rank b, in posting order, must be exactly rank b's
        receives from rank a, in posting order (a tensor-by-tensor mismatch would pair wrong buffers)."""
        sends: dict[tuple[int, int], list[Action]] = {}
        recvs: dict[tuple[int, int], list[Action]] = {}
        for r, items in self.lists.items():
            for a in flatten(items):
                if not a.is_compute:
                    peer = self.place.rank(a.peer_stage)
                    book = sends if a.kind.is_send else recvs
                    book.setdefault((r, peer) if a.kind.is_send else (peer, r), []).append(a)
        for pair in sorted(set(sends) | set(recvs)):
            sent = [a.matching() for a in sends.get(pair, [])]
            got = recvs.get(pair, [])
            if sent != got:
                k = next((k for k, (x, y) in enumerate(zip(sent, got)) if x != y), min(len(sent), len(got)))
                src, dst = pair
                raise ScheduleDeadlock(
                    f"rank {src}'s sends to rank {dst} and rank {dst}'s receives from rank {src} are not in the "
                    f"same order (NCCL matches them by position, not by tag): at position {k} rank {src} sends "
                    f"for {sent[k] if k < len(sent) else 'nothing'}, rank {dst} receives "
                    f"{got[k] if k < len(got) else 'nothing'}")

    def run(self) -> SimResult:
        self._check_pair_order()
        grid: list[list[str | None]] = []
        t = 0
        while not self._finished():
            row: list[str | None] = [None] * self.pp
            communicated = self._communicate(t)
            moved = [self._advance(r, t, row) for r in range(self.pp)]
            if not communicated and not any(moved):
                raise ScheduleDeadlock(self._explain(t))
            grid.append(row)
            t += 1
        while grid and not any(grid[-1]):  # trailing steps of communication only
            grid.pop()
        return SimResult(len(grid), self.busy, grid, self.peak, self.peak_w)

    # ---- the queues ----------------------------------------------------------------------------
    def _can_match(self, a: Action, t: int) -> bool:
        """A send is only matchable once the compute producing its tensor has run."""
        if not a.kind.is_send:
            return True
        producer = Action(a.stage, F if a.kind is SEND_F else self.grad_kind, a.microbatch)
        return self.ran.get(producer, t) < t

    def _communicate(self, t: int) -> bool:
        progressed, changed = False, True
        while changed:
            changed = False
            for r in range(self.pp):
                if not self.queue[r]:
                    continue
                head = self.queue[r][0]
                for a in sorted(head.waiting, key=str):
                    peer = self.queue[self.place.rank(a.peer_stage)]
                    other = a.matching()
                    if peer and other in peer[0].waiting and self._can_match(a, t) and self._can_match(other, t):
                        head.waiting.discard(a)
                        peer[0].waiting.discard(other)
                        changed = True
                if not head.waiting:
                    self.queue[r].popleft()
                    for a in head.group.actions:
                        if a.kind.is_recv:
                            self.received[a] = t
                    changed = True
            progressed |= changed
        return progressed

    # ---- the hosts -----------------------------------------------------------------------------
    def _advance(self, r: int, t: int, row: list[str | None]) -> bool:
        """Post and run what rank r's host can in step t; True if it moved."""
        items, start, computed = self.lists[r], self.pos[r], False
        while self.pos[r] < len(items):
            item = items[self.pos[r]]
            if isinstance(item, Group):
                self.queue[r].append(_Posted(item))
            else:
                if computed or self._missing(item, t):
                    break
                computed, row[r] = True, str(item)
                self.ran[item] = t
                self._account(r, item)
            self.pos[r] += 1
        return self.pos[r] > start

    def _account(self, r: int, a: Action) -> None:
        self.busy[r] += 1
        self.inflight[r] += 1 if a.kind is F else -1 if a.kind.sends_grad else 0
        self.peak[r] = max(self.peak[r], self.inflight[r])
        self.pending_w[r] += 1 if a.kind is I else -1 if a.kind is W else 0
        self.peak_w[r] = max(self.peak_w[r], self.pending_w[r])

    def _feed(self, a: Action) -> Action | None:
        """The receive that would bring ``a`` its input (activation for F, gradient for B / I)."""
        if a.kind is W:
            return None
        return Action(a.stage, RECV_F if a.kind is F else RECV_B, a.microbatch)

    def _missing(self, a: Action, t: int) -> list[Action]:
        missing = [d for d in dependencies(a, self.num_stages) if self.ran.get(d, t) >= t]
        feed = self._feed(a)
        if feed is not None and feed in self.recvs[self.place.rank(a.stage)] and feed not in self.received:
            missing.append(feed)
        return missing

    # ---- explaining a deadlock -----------------------------------------------------------------
    def _explain(self, t: int) -> str:
        lines = []
        for r in range(self.pp):
            if self.queue[r]:
                head = self.queue[r][0]
                a = min(head.waiting, key=str)
                where = f"{a}" if len(head.group.actions) == 1 else f"{a} of {head.group}"
                lines.append(f"rank {r} waits at {where}, which needs {self._where(a.matching())}")
            elif self.pos[r] < len(self.lists[r]):
                a = self.lists[r][self.pos[r]]
                why = "; ".join(self._where(n) for n in self._missing(a, t))
                lines.append(f"rank {r} waits at {a}, which needs {why}")
        return f"schedule deadlocks at step {t} (NCCL rules: one queue of groups per rank, rendezvous " \
               f"sends):\n  " + "\n  ".join(lines)

    def _where(self, need: Action) -> str:
        p = self.place.rank(need.stage)
        queued = [q.group for q in self.queue[p] if need in q.waiting]
        if queued:
            return f"{need} that rank {p} has queued behind {self.queue[p][0].group}"
        items = self.lists[p][self.pos[p]:]
        if need not in flatten(items):
            if need.is_compute and need in self.ran:
                return f"{need}, which ran"
            return f"{need} that rank {p}'s list does not hold (after its current position)"
        at = items[0] if items else "its end"
        return f"{need} that rank {p} has not reached (it is at {at})"
