"""The pipeline schedule as bars on a time axis, per pipeline rank: what the report's Gantt chart draws.

Terms:
  grid     -- ``plan.schedule_grid``, the simulator's step x rank table (format in schedule/simulate.py):
              per step and rank the compute label ``{stage}{kind}{microbatch}`` or ``.`` (idle).  Labels
              are read with a generic pattern, so action kinds added later (e.g. ``I``, ``W``) show up.
  bar      -- one compute: (rank, stage, chunk, kind, microbatch, start, end).
  steps view -- start/end in simulator steps: every compute takes one step (exactly what the simulator
              and the lowering pass use).
  time view  -- start/end in predicted seconds: each rank runs its computes in the simulator's order;
              a compute starts when its rank is free and each compute it depends on
              (``schedule.timing.dependencies``) has finished, plus the point-to-point time of the
              boundary tensors when that compute ran on another rank.  Durations come from the plan's
              stage predictions (``F``: fwd_time, ``B``: bwd_time, any other kind ``X``: a StageInfo
              field ``x_time``) plus the tensor-parallel collectives of that stage, which the stage's
              fwd/bwd times leave out.  A kind with no predicted duration leaves only the steps view.
  bubble   -- time a rank is idle between 0 and the makespan.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from autosplit.schedule.actions import Action, ActionKind
from autosplit.schedule.timing import dependencies

_LABEL = re.compile(r"^(\d+)([A-Za-z_]+)(\d+)$")
_FIELD = {"F": "fwd_time", "B": "bwd_time"}       # StageInfo fields; other kinds: f"{kind.lower()}_time"


@dataclass
class Bar:
    rank: int
    stage: int
    chunk: int
    kind: str
    microbatch: int
    start: float
    end: float


def parse_grid(text: str) -> list[list[str | None]]:
    """``grid[t][r]``: the compute label rank r ran at step t, None when idle."""
    rows = [line.split() for line in text.strip().splitlines()[1:]]
    return [[None if cell == "." else cell for cell in row[1:]] for row in rows if row]


def step_bars(grid: list[list[str | None]], pp: int) -> list[Bar]:
    bars = []
    for t, row in enumerate(grid):
        for r, label in enumerate(row):
            if label is not None:
                stage, kind, mb = _split(label)
                bars.append(Bar(r, stage, stage // pp, kind, mb, float(t), float(t + 1)))
    return bars


def _split(label: str) -> tuple[int, str, int]:
    found = _LABEL.match(label)
    if found is None:
        raise ValueError(f"schedule grid cell {label!r} is not <stage><kind><microbatch>")
    return int(found.group(1)), found.group(2), int(found.group(3))


def time_bars(step_view: list[Bar], stages, edge_time, extra: dict[tuple[int, str], float]) -> tuple[list[Bar], str]:
    """The time view (see the module docstring), or ([], why) when some kind has no predicted duration
    or no dependency rule.  ``edge_time(lower_stage)``: seconds to move stage ``lower_stage``'s
    boundary tensors (activations forward, or their gradients back) to the neighbouring rank."""
    by_stage = {s.index: s for s in stages}
    n_stages = len(stages)
    bars, end, free = [], {}, {}
    for bar in sorted(step_view, key=lambda b: (b.start, b.rank)):
        field = _FIELD.get(bar.kind, f"{bar.kind.lower()}_time")
        stage = by_stage[bar.stage]
        if not hasattr(stage, field):
            return [], f"no predicted duration for action kind {bar.kind} (StageInfo has no {field})"
        if bar.kind not in ActionKind.__members__:
            return [], f"action kind {bar.kind} is not an ActionKind: no dependency rule to replay it"
        action = Action(bar.stage, ActionKind[bar.kind], bar.microbatch)
        start = free.get(bar.rank, 0.0)
        for dep in dependencies(action, n_stages):
            if dep not in end:
                return [], f"{action} depends on {dep}, which the grid does not hold before it"
            hop = edge_time(min(dep.stage, bar.stage)) if by_stage[dep.stage].pp_rank != stage.pp_rank else 0.0
            start = max(start, end[dep] + hop)
        finish = start + getattr(stage, field) + extra.get((bar.stage, bar.kind), 0.0)
        end[action] = free[bar.rank] = finish
        bars.append(Bar(bar.rank, bar.stage, bar.chunk, bar.kind, bar.microbatch, start, finish))
    return bars, ""


def timeline(plan, edge_time, extra: dict[tuple[int, str], float]) -> dict:
    """JSON-ready: both views' bars, per-rank busy time and the makespan of each."""
    pp = plan.mesh.pp
    steps = step_bars(parse_grid(plan.schedule_grid), pp) if plan.schedule_grid else []
    timed, why = time_bars(steps, plan.stages, edge_time, extra) if steps else ([], "no schedule grid in the plan")
    views = {"steps": _view(steps, pp, "step")}
    if timed:
        views["time"] = _view(timed, pp, "ms", scale=1e3)
    return {"views": views, "time_unavailable": why, "kinds": sorted({b.kind for b in steps}, key=_kind_order)}


def _kind_order(kind: str) -> tuple[int, str]:
    known = [k.name for k in ActionKind]
    return (known.index(kind) if kind in known else len(known), kind)


def _view(bars: list[Bar], pp: int, unit: str, scale: float = 1.0) -> dict:
    makespan = max((b.end for b in bars), default=0.0)
    busy = [sum(b.end - b.start for b in bars if b.rank == r) for r in range(pp)]
    rows = []
    for b in bars:
        d = asdict(b)
        d["start"], d["end"] = b.start * scale, b.end * scale
        rows.append(d)
    return {"unit": unit, "makespan": makespan * scale, "busy": [x * scale for x in busy], "bars": rows,
            "idle_fraction": 1 - sum(busy) / (makespan * pp) if makespan else 0.0}
