"""Schedule generators: per pipeline rank, the ordered list of compute actions (F and B, or F, I, W).

Terms:
  pp     -- number of pipeline ranks.
  v      -- ``chunks_per_rank``: model chunks (stages) held by each rank.
  m      -- ``num_microbatches`` per optimizer step.
  S      -- ``pp * v`` global stages, placed on ranks by the schedule's placement (placement.py):
            looped (chunk ``c`` of rank ``r`` is stage ``c*pp + r``) for all but zb-v, which uses V.
  chunk-step -- one F (or one B, I or W) of one chunk on one microbatch; it takes one time step.
  warmup / steady / cooldown -- the forwards a rank runs before its first backward, the
            alternating one-forward-one-backward middle, and the backwards left at the end.

Schedules are data: ``Schedule.actions[r]`` is rank ``r``'s compute-only list.  The communication
actions are added by ``lower.lower`` and the timing is checked by ``simulate.simulate``.

Schedules and the microbatch counts each accepts (every accepted count runs with the ideal bubble,
idle fraction ``(pp-1) / (v*m + pp-1)``, when each chunk-step takes one time step):
  gpipe       -- all forwards, then all backwards (backwards in *forward* microbatch order, chunks
                 last-to-first).  v == 1: any m >= 1.  v >= 2 (looped): m >= pp, else chunk c+1 on
                 rank 0 would wait for chunk c's wrap-around from rank pp-1.
  1f1b        -- v == 1 only; any m >= 1.  Rank r: ``min(pp-r-1, m)`` warmup forwards, then F/B
                 pairs, then the remaining backwards.  At most ``pp - r`` microbatches in flight.
  interleaved -- Megatron's interleaved 1F1B, v >= 2; any m >= pp.  Microbatches run in groups:
                 a group goes through chunk 0, then chunk 1, ..., then the next group.  With
                 m a multiple of pp every group has pp microbatches and the warmup on rank r is
                 ``(pp-r-1)*2 + (v-1)*pp`` chunk-steps (Megatron), capped at ``v*m``.  Otherwise the
                 ``m % pp`` extra microbatches are spread over the ``m // pp`` groups (sizes >= pp,
                 differing by at most one, larger first) and the warmup uses the first group's size:
                 ``(pp-r-1)*2 + (v-1)*size0``.  m < pp cannot fill the loop: chunk 1 on rank 0 would
                 wait for chunk 0's wrap-around.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from autosplit.errors import AutosplitError
from autosplit.validate import one_of, positive_int

from .actions import Action, B, F
from .placement import Placement, placement_of
from .zero_bubble import zb_h1, zb_v

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
SPLIT_BACKWARD = ("zb-h1", "zb-v")      # schedules whose backward is split into I and W


@dataclass
class Schedule:
    name: str
    pp: int
    num_microbatches: int
    chunks_per_rank: int
    actions: dict[int, list[Action]] = field(default_factory=dict)
    placement_kind: str | None = None      # None: the placement the schedule's name implies

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks_per_rank

    @property
    def placement(self) -> Placement:
        if self.placement_kind is not None:
            return Placement(self.pp, self.chunks_per_rank, self.placement_kind)
        return placement_of(self.name, self.pp, self.chunks_per_rank)

    def stage(self, rank: int, chunk: int) -> int:
        return self.placement.stage(rank, chunk)

    def __str__(self) -> str:
        rows = [f"{self.name} pp={self.pp} m={self.num_microbatches} v={self.chunks_per_rank}"]
        rows += [f"  rank {r}: {' '.join(map(str, acts))}" for r, acts in sorted(self.actions.items())]
        return "\n".join(rows)


def build_schedule(name: str, pp: int, num_microbatches: int, chunks_per_rank: int = 1) -> Schedule:
    """Compute-only action lists for schedule ``name`` (one of ``SCHEDULES``)."""
    validate(name, pp, num_microbatches, chunks_per_rank)
    make = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved, "zb-h1": zb_h1, "zb-v": zb_v}[name]
    place = placement_of(name, pp, chunks_per_rank)
    actions = {r: make(r, pp, num_microbatches, chunks_per_rank, place) for r in range(pp)}
    return Schedule(name, pp, num_microbatches, chunks_per_rank, actions)


def forward_schedule(name: str, pp: int, num_microbatches: int, chunks_per_rank: int = 1,
                     placement: str | None = None) -> Schedule:
    """Schedule ``name`` with its backwards left out: the forward-only lists ``predict`` runs.

    Args:
        placement: "looped" or "v" to run ``name``'s forward order on another schedule's placement
            (``predict`` of a zb-v plan runs GPipe's forwards on the V); None: ``name``'s own.
    """
    kind = placement or placement_of(name, pp, chunks_per_rank).kind
    validate(name, pp, num_microbatches, chunks_per_rank, check_chunks=placement is None)
    make = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved, "zb-h1": zb_h1, "zb-v": zb_v}[name]
    place = Placement(pp, chunks_per_rank, kind)
    forwards = {r: [a for a in make(r, pp, num_microbatches, chunks_per_rank, place) if a.kind is F]
                for r in range(pp)}
    return Schedule(f"{name} (forward only)", pp, num_microbatches, chunks_per_rank, forwards, kind)


def validate(name: str, pp: int, m: int, v: int, check_chunks: bool = True) -> None:
    """Raise AutosplitError (a ValueError) naming the arithmetic if the schedule cannot be built.

    The one validator of (schedule, pp, num_microbatches, chunks_per_rank): ``build_schedule`` and
    ``autosplit.options.PlanOptions.check`` (so ``compile`` and ``parallelize``) both call it.
    """
    one_of("schedule", name, SCHEDULES)
    for label, value in (("pp", pp), ("num_microbatches", m), ("chunks_per_rank", v)):
        positive_int(label, value)
    if not check_chunks:
        return
    if name in ("1f1b", "zb-h1") and v != 1:
        raise AutosplitError(f"schedule={name!r} runs one chunk per rank (got chunks_per_rank={v}); "
                             f"use schedule='interleaved' or 'zb-v' for several")
    if name == "zb-v" and v != 2:
        raise AutosplitError(f"schedule='zb-v' runs two chunks per rank in a V (rank r holds stages r and "
                             f"2*pp-1-r); got chunks_per_rank={v}, use 2")
    if name == "gpipe" and v > 1 and m < pp:
        raise AutosplitError(
            f"schedule='gpipe' with chunks_per_rank({v}) > 1 needs num_microbatches({m}) >= pp({pp}); "
            f"use num_microbatches >= {pp} or chunks_per_rank=1")
    if name == "interleaved":
        if v < 2:
            raise AutosplitError(
                f"schedule='interleaved' needs chunks_per_rank >= 2 (got {v}); use schedule='1f1b' for 1")
        if m < pp:
            raise AutosplitError(
                f"schedule='interleaved' needs num_microbatches({m}) >= pp({pp}), else chunk 1 on "
                f"rank 0 waits for chunk 0 to come round the loop; use num_microbatches >= {pp}")


def _gpipe(rank: int, pp: int, m: int, v: int, place: Placement) -> list[Action]:
    forwards = [Action(place.stage(rank, c), F, i) for c in range(v) for i in range(m)]
    backwards = [Action(place.stage(rank, c), B, i) for c in reversed(range(v)) for i in range(m)]
    return forwards + backwards


def _one_f_one_b(rank: int, pp: int, m: int, v: int, place: Placement) -> list[Action]:
    forwards = [Action(rank, F, i) for i in range(m)]
    backwards = [Action(rank, B, i) for i in range(m)]
    return _fill_drain(forwards, backwards, warmup=min(pp - rank - 1, m))


def _interleaved(rank: int, pp: int, m: int, v: int, place: Placement) -> list[Action]:
    forwards = [Action(place.stage(rank, c), F, i) for c, i in _chunk_order(pp, m, v, reverse=False)]
    backwards = [Action(place.stage(rank, c), B, i) for c, i in _chunk_order(pp, m, v, reverse=True)]
    warmup = min((pp - rank - 1) * 2 + (v - 1) * len(microbatch_groups(pp, m)[0]), v * m)
    return _fill_drain(forwards, backwards, warmup)


def microbatch_groups(pp: int, m: int) -> list[range]:
    """Split ``range(m)`` into ``m // pp`` consecutive groups: sizes >= pp, within one, larger first."""
    count, extra = divmod(m, pp)
    sizes = [pp + (1 if g < extra % count else 0) + extra // count for g in range(count)]
    starts = [sum(sizes[:g]) for g in range(count)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def _chunk_order(pp: int, m: int, v: int, reverse: bool) -> list[tuple[int, int]]:
    """(chunk, microbatch) in the order one rank runs them: each group through every chunk in turn."""
    chunks = list(reversed(range(v))) if reverse else list(range(v))
    return [(c, i) for group in microbatch_groups(pp, m) for c in chunks for i in group]


def _fill_drain(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """``warmup`` forwards, then alternate one forward / one backward, then the rest backward."""
    steady = len(forwards) - warmup
    out = forwards[:warmup]
    for k in range(steady):
        out += [forwards[warmup + k], backwards[k]]
    return out + backwards[steady:]
