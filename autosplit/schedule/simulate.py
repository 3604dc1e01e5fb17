"""A discrete-time simulator for lowered schedules: proves a schedule is deadlock-free and counts idle.

Terms:
  step      -- one unit of time.  Each compute action (F or B of one chunk) takes exactly one step
               on its rank; communication actions take zero time.
  rank      -- a pipeline rank; it runs its list strictly in order.  Stage ``s`` lives on ``s % pp``.
  ready     -- a SEND is always ready (sends never block).  A RECV is ready once the matching SEND
               (same microbatch, from the peer stage) ran in an *earlier* step.  A compute is ready
               once its data dependencies ran in an earlier step: F(s, i) needs F(s-1, i); B(s, i)
               needs F(s, i) and, unless s is the last stage, B(s+1, i).  So an F at step t on stage
               s lets stage s+1 run F at step t+1, whether on another rank (via SEND_F/RECV_F) or on
               the same rank (local hand-off).
  in one step, each rank runs every ready communication action at the head of its list, at most
               one ready compute, then the ready communication actions after it, and stops at the
               next compute or at the first action that is not ready.
  deadlock  -- a step in which no rank can run anything while some lists are unfinished.
  busy / idle -- steps in which a rank did / did not run a compute.  ``idle_fraction`` is the total
               idle rank-steps over ``steps * pp``.
  in flight -- on one rank, the (stage, microbatch) pairs whose F ran and whose B has not: the
               activations that rank must hold.  ``peak_activations[r]`` is its maximum over time.

Grid format (``SimResult.format_grid``): a header row ``step  rank 0  rank 1 ...``, then one row per
step holding, per rank, the compute it ran in compact action form (``2F0`` = stage 2 forward of
microbatch 0, ``1B3`` = stage 1 backward of microbatch 3) or ``.`` when idle.
"""
from __future__ import annotations

from dataclasses import dataclass

from autosplit.errors import AutosplitError

from .actions import Action, B, F
from .generate import Schedule, build_schedule
from .lower import lower


class ScheduleDeadlock(RuntimeError):
    """No rank can make progress; the message names each stuck rank and what it waits on."""


@dataclass
class SimResult:
    steps: int                      # makespan in steps
    busy: list[int]                 # compute steps per rank
    grid: list[list[str | None]]    # grid[t][r]: compute label rank r ran at step t, or None
    peak_activations: list[int]     # per rank, max (stage, microbatch) pairs in flight

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


def simulate(schedule_or_lowered: Schedule | dict[int, list[Action]],
             num_stages: int | None = None) -> SimResult:
    """Run every rank's lowered list together, one step at a time (see the module docstring).

    A ``Schedule`` is lowered first.  A dict maps rank -> lowered list; ``num_stages`` defaults to
    one more than the largest stage in it.
    """
    if isinstance(schedule_or_lowered, Schedule):
        lists, num_stages = lower(schedule_or_lowered), schedule_or_lowered.num_stages
    else:
        lists = schedule_or_lowered
        if num_stages is None:
            num_stages = 1 + max((a.stage for acts in lists.values() for a in acts), default=0)
    return _Sim(lists, num_stages).run()


class _Sim:
    def __init__(self, lists: dict[int, list[Action]], num_stages: int):
        self.pp = len(lists)
        if sorted(lists) != list(range(self.pp)):
            raise AutosplitError(f"lists are keyed by ranks {sorted(lists)}; expected 0..{self.pp - 1}")
        for rank, acts in lists.items():
            for a in acts:
                if a.stage % self.pp != rank:
                    raise AutosplitError(f"{a} is in rank {rank}'s list but stage {a.stage} lives on "
                                         f"rank {a.stage} % {self.pp} = {a.stage % self.pp}")
        self.lists, self.num_stages = lists, num_stages
        self.pos = [0] * self.pp
        self.done: dict[Action, int] = {}  # action -> step it ran in
        self.inflight = [0] * self.pp
        self.peak = [0] * self.pp
        self.busy = [0] * self.pp

    def run(self) -> SimResult:
        grid: list[list[str | None]] = []
        t = 0
        while any(self.pos[r] < len(self.lists[r]) for r in range(self.pp)):
            row: list[str | None] = [None] * self.pp
            progressed = [self._advance(r, t, row) for r in range(self.pp)]
            if not any(progressed):
                raise ScheduleDeadlock(self._explain(t))
            grid.append(row)
            t += 1
        while grid and not any(grid[-1]):  # a trailing step of communication only
            grid.pop()
        return SimResult(len(grid), self.busy, grid, self.peak)

    def _advance(self, r: int, t: int, row: list[str | None]) -> bool:
        """Run what rank r can run in step t; True if it ran anything."""
        acts, start, computed = self.lists[r], self.pos[r], False
        while self.pos[r] < len(acts):
            a = acts[self.pos[r]]
            if a.is_compute and (computed or self._missing(a, t)):
                break
            if a.kind.is_recv and not self._ran_before(a.matching(), t):
                break
            if a.is_compute:
                computed, row[r] = True, str(a)
                self._account(r, a)
            self.done[a] = t
            self.pos[r] += 1
        return self.pos[r] > start

    def _account(self, r: int, a: Action) -> None:
        self.busy[r] += 1
        self.inflight[r] += 1 if a.kind is F else -1
        self.peak[r] = max(self.peak[r], self.inflight[r])

    def _ran_before(self, a: Action, t: int) -> bool:
        return self.done.get(a, t) < t

    def _deps(self, a: Action) -> list[Action]:
        s, i = a.stage, a.microbatch
        if a.kind is F:
            return [Action(s - 1, F, i)] if s > 0 else []
        deps = [Action(s, F, i)]
        return deps + [Action(s + 1, B, i)] if s < self.num_stages - 1 else deps

    def _missing(self, a: Action, t: int) -> list[Action]:
        return [d for d in self._deps(a) if not self._ran_before(d, t)]

    def _explain(self, t: int) -> str:
        lines = []
        for r in range(self.pp):
            if self.pos[r] == len(self.lists[r]):
                continue
            a = self.lists[r][self.pos[r]]
            needs = [a.matching()] if a.kind.is_recv else self._missing(a, t)
            why = "; ".join(self._where(n) for n in needs)
            lines.append(f"rank {r} waits at {a}, which needs {why}")
        return f"schedule deadlocks at step {t}:\n  " + "\n  ".join(lines)

    def _where(self, need: Action) -> str:
        p = need.stage % self.pp
        acts = self.lists[p]
        if need not in acts[self.pos[p]:]:
            return f"{need} that rank {p}'s list does not hold (after its current position)"
        return f"{need} that rank {p} has not reached (it is at {acts[self.pos[p]]})"
