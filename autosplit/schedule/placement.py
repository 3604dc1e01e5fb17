"""Where each global stage lives: which pipeline rank holds it, as which of its chunks.

Terms:
  pp     -- number of pipeline ranks; ``v`` chunks (stages) per rank; ``S = pp * v`` global stages.
  looped -- chunk ``c`` of rank ``r`` is stage ``c*pp + r`` (Megatron's interleaved placement; also
            every schedule with v = 1): stage ``s`` lives on rank ``s % pp``.
  V      -- zigzag placement (the zero-bubble paper's ZB-V, v = 2): even chunks go down the ranks,
            odd chunks come back up, so chunk ``c`` of rank ``r`` is stage ``c*pp + r`` for even ``c``
            and ``c*pp + pp-1-r`` for odd ``c``.  With v = 2, rank ``r`` holds stages ``r`` and
            ``2pp-1-r``: the first and the last stage share rank 0, and the hand-off from stage
            ``pp-1`` to ``pp`` stays on rank ``pp-1`` (no communication).

The placement belongs to the schedule (``Schedule.placement``, ``Plan.placement``): every place that
maps stages to ranks (lowering, simulator, executor, plan, state-dict owners) asks it, never a
formula of its own.
"""
from __future__ import annotations

from dataclasses import dataclass

PLACEMENT_KINDS = ("looped", "v")


@dataclass(frozen=True)
class Placement:
    pp: int
    v: int = 1
    kind: str = "looped"

    def __post_init__(self):
        if self.kind not in PLACEMENT_KINDS:
            raise ValueError(f"unknown placement {self.kind!r}; expected one of {', '.join(PLACEMENT_KINDS)}")

    @property
    def num_stages(self) -> int:
        return self.pp * self.v

    def stage(self, rank: int, chunk: int) -> int:
        """The global stage chunk ``chunk`` of pipeline rank ``rank`` runs."""
        if self.kind == "v" and chunk % 2:
            return chunk * self.pp + self.pp - 1 - rank
        return chunk * self.pp + rank

    def rank(self, stage: int) -> int:
        """The pipeline rank holding global stage ``stage``."""
        chunk, offset = divmod(stage, self.pp)
        return self.pp - 1 - offset if self.kind == "v" and chunk % 2 else offset

    def chunk(self, stage: int) -> int:
        return stage // self.pp

    def stages(self, rank: int) -> list[int]:
        """The stages rank ``rank`` holds, in chunk order (= increasing stage order)."""
        return [self.stage(rank, c) for c in range(self.v)]

    def describe(self, stage: int) -> str:
        """How a message explains where ``stage`` lives, with the arithmetic."""
        if self.kind == "looped":
            return f"stage {stage} lives on rank {stage} % {self.pp} = {self.rank(stage)}"
        return f"stage {stage} lives on rank {self.rank(stage)} (V placement: rank r holds stages r and " \
               f"{2 * self.pp - 1}-r)"


def placement_of(schedule: str, pp: int, v: int) -> Placement:
    """The placement schedule ``schedule`` uses: V for "zb-v", looped for every other."""
    return Placement(pp, v, "v" if schedule == "zb-v" else "looped")
