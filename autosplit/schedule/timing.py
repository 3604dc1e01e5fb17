"""Unit-time timing of a compute-only schedule: the step at which each compute would run.

Terms:
  step  -- one unit of time; every compute (F, B, I or W of one chunk on one microbatch) takes one step.
  ready -- a compute runs at the first step after its data dependencies ran (F(s, i) needs F(s-1, i);
           B(s, i) needs F(s, i) and, unless s is the last stage, B(s+1, i); I likewise with I(s+1, i);
           W(s, i) needs I(s, i)), on whichever rank they ran, and after the computes before it in its
           rank's list.  Communication is free here.
  placement -- which rank holds each stage (placement.py); only the messages need it here.

The lowering pass uses these steps to place each transfer (see lower.py); the simulator then checks
the lowered lists under NCCL's rules, where communication is no longer free of ordering.
"""
from __future__ import annotations

from .actions import Action, ActionKind, F, W
from .placement import Placement


class ScheduleDeadlock(RuntimeError):
    """No rank can make progress; the message names each stuck rank and what it waits on."""


def dependencies(a: Action, num_stages: int) -> list[Action]:
    """The computes whose results ``a`` consumes."""
    return [Action(*key) for key in dependency_keys(a.stage, a.kind, a.microbatch, num_stages)]


def dependency_keys(s: int, kind: ActionKind, i: int, num_stages: int) -> list[tuple]:
    """``dependencies`` of the compute (stage s, kind, microbatch i) as (stage, kind, microbatch) tuples
    (the timed run's structure keys ~10^5 computes by them: cheaper to build and hash than Actions)."""
    if kind is F:
        return [(s - 1, F, i)] if s > 0 else []
    if kind is W:
        return [(s, ActionKind.I, i)]
    deps = [(s, F, i)]                             # B or I: the stage's forward, the next stage's B / I
    return deps + [(s + 1, kind, i)] if s < num_stages - 1 else deps


def compute_steps(lists: dict[int, list[Action]], num_stages: int,
                  placement: Placement | None = None) -> dict[Action, int]:
    """The step each compute of ``lists`` (rank -> compute-only list) runs at; raises
    ScheduleDeadlock naming every stuck rank when the lists' order makes some compute wait forever."""
    pos = {r: 0 for r in lists}
    steps: dict[Action, int] = {}
    t = 0
    while any(pos[r] < len(acts) for r, acts in lists.items()):
        ran = []
        for r, acts in lists.items():
            if pos[r] < len(acts) and all(steps.get(d, t) < t for d in dependencies(acts[pos[r]], num_stages)):
                ran.append(acts[pos[r]])
                pos[r] += 1
        if not ran:
            raise ScheduleDeadlock(_explain(lists, pos, steps, num_stages, placement or Placement(len(lists))))
        for a in ran:
            steps[a] = t
        t += 1
    return steps


def _explain(lists, pos, steps, num_stages, placement: Placement) -> str:
    lines = []
    for r, acts in sorted(lists.items()):
        if pos[r] == len(acts):
            continue
        a = acts[pos[r]]
        needs = []
        for d in dependencies(a, num_stages):
            if d in steps:
                continue
            p = placement.rank(d.stage)
            at = lists[p][pos[p]] if pos[p] < len(lists[p]) else "its end"
            held = d in lists[p][pos[p]:]
            needs.append(f"{d} that rank {p} has not reached (it is at {at})" if held else
                         f"{d} that rank {p}'s list does not hold (after its current position)")
        lines.append(f"rank {r} waits at {a}, which needs {'; '.join(needs)}")
    return "compute order deadlocks:\n  " + "\n  ".join(lines)
