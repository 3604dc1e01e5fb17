"""The space the search enumerates, and the refusals it knows before pricing anything.

Terms:
  world     -- the number of ranks, W = pp * cp * tp * dp.
  layout    -- (tp, tp_mode, sequence_parallel, tp_depth, cp): tp_mode "1d" (sequence parallelism on or off
               when tp > 1), "2d" (tp = q * q, q >= 2), "2.5d" (tp = q * q * d for every depth d >= 2
               with q >= 2) or "3d" (tp = q^3, q >= 2); sequence parallelism applies to 1d only.
               cp >= 2 (a context-parallel axis: the tokens of every op split over cp ranks,
               passes/sharding/context.py) for every divisor of W, beside 1D tensor parallelism without
               sequence parallelism (tp >= 1, cp * tp dividing W): what compile builds with a cp axis
               (autosplit/options.py).  Listed after every cp = 1 layout.
  Bd        -- the per-replica batch, global_batch / dp (dp must divide it).
  m, b      -- microbatches per step and microbatch size, m * b = Bd.  m runs over the divisors of Bd
               with pp <= m <= 4 pp when pp > 1 (fewer leave the pipeline mostly idle; interleaved
               needs m >= pp anyway) and m in {1, 2, 4, 8} when pp = 1 (gradient accumulation saves
               activation memory); a grid mode needs its row split to divide b (2D q, 2.5D d * q,
               3D q * q: ``Layout.unit``).
  schedule  -- pp = 1: "1f1b" (every schedule is the same single stage); pp > 1: "1f1b", "interleaved"
               with chunks_per_rank 2 and 4, "zb-h1", "zb-v" (chunks 2).  GPipe is left out: the same
               bubble as 1F1B with m instead of pp microbatches in flight.
  stages    -- pp * chunks_per_rank <= the segments the graph can be cut into, and <= 2 per layer
               (``model_layers.layer_paths``): a stage holds at least half a layer.
  recompute -- None, "stage", "block".   dp_shard -- False, or "stage" / "layer" when dp > 1;
               zero-bubble schedules only with False (the compiler refuses FSDP with a split backward).
"""
from __future__ import annotations

from dataclasses import dataclass

from autosplit.schedule import SPLIT_BACKWARD
from autosplit.segment_costs import RECOMPUTE
from autosplit.tp.axes import GRID_MODES, batch_ways, grid_layouts, tp_axes


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Layout:
    tp: int
    tp_mode: str
    sequence_parallel: bool
    tp_depth: int | None = None
    cp: int = 1

    @property
    def block(self) -> int:
        """The ranks that share a microbatch: cp * tp (autosplit/mesh.py *block*)."""
        return self.cp * self.tp

    @property
    def unit(self) -> int:
        """The rows a microbatch's size must be a multiple of (``tp/axes.py`` ``batch_ways``)."""
        if self.tp_mode not in GRID_MODES:
            return 1
        return batch_ways(tp_axes(self.tp_mode, self.tp, self.tp_depth))

    @property
    def name(self) -> str:
        """The mode as the search's tables and refusals write it: "2.5d" with its depth."""
        return f"{self.tp_mode} d={self.tp_depth}" if self.tp_depth else self.tp_mode


def layouts(world: int, context: bool = True) -> list[Layout]:
    """Every layout of ``world`` ranks (see *layout*); ``context``: with the cp layouts."""
    out = []
    for tp in divisors(world):
        out.append(Layout(tp, "1d", False))
        if tp > 1:
            out.append(Layout(tp, "1d", True))
            out += [Layout(tp, mode, False, depth) for mode, depth in grid_layouts(tp)]
    if context:
        out += [Layout(tp, "1d", False, None, cp) for cp in divisors(world)[1:] for tp in divisors(world // cp)]
    return out


def schedules(pp: int) -> list[tuple[str, int]]:
    """(schedule, chunks_per_rank) pairs for pp pipeline ranks."""
    if pp == 1:
        return [("1f1b", 1)]
    return [("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zb-h1", 1), ("zb-v", 2)]


def microbatch_counts(pp: int, per_replica: int) -> list[int]:
    if pp == 1:
        return [m for m in (1, 2, 4, 8) if per_replica % m == 0]
    return [m for m in divisors(per_replica) if pp <= m <= 4 * pp]


def shardings(dp: int, schedule: str) -> list[tuple[object, str | None]]:
    """(dp_shard, why not) pairs: why not is the compiler's refusal, or None."""
    if dp == 1:
        return [(False, None)]
    out = [(False, None)]
    for s in ("stage", "layer"):
        why = None
        if schedule in SPLIT_BACKWARD:
            why = (f"schedule={schedule!r} with dp_shard={s!r}: FSDP2 reduce-scatters a module's gradients when "
                   f"its backward ends, but a zero-bubble schedule computes the weight gradients later, in W")
        out.append((s, why))
    return out


def recompute_modes() -> tuple:
    return RECOMPUTE
