"""The configurations the numerics part runs: which the world allows, which ``--quick`` keeps.

Terms: see autosplit/check/__init__.py (configuration).
  fixed axes -- a configuration names pp and tp; dp takes the rest of the world (world / (pp * tp)),
                so every configuration uses every rank and ``pp2-1f1b`` on 8 ranks is mesh (2, 1, 4).
  allowed    -- pp * tp divides the world and dp is at least the configuration's ``min_dp`` (2 for
                the ``dp_shard`` ones: FSDP2 over one replica shards nothing); a compiled one also
                needs inductor to work here (``inductor_problem``).
  quick      -- the configurations ``--quick`` runs: one per family (dp, pp schedule, tp with sequence
                parallelism, pp x tp, sharded dp), none compiled (a compile alone takes longer than
                the rest together).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from autosplit.errors import AutosplitError


@dataclass(frozen=True)
class Config:
    name: str
    pp: int = 1
    tp: int = 1
    options: dict = field(default_factory=dict, hash=False)   # parallelize keywords beyond the mesh
    min_dp: int = 1
    quick: bool = False

    @property
    def compiled(self) -> bool:
        return bool(self.options.get("compile_stages"))

    def mesh(self, world: int) -> tuple[int, int, int] | None:
        """(pp, tp, dp) on ``world`` ranks, or None where the world does not allow it (see *allowed*)."""
        if world % (self.pp * self.tp):
            return None
        dp = world // (self.pp * self.tp)
        return (self.pp, self.tp, dp) if dp >= self.min_dp else None

    def needs(self) -> str:
        """Why a world may not allow it, in words."""
        fixed = self.pp * self.tp
        return (f"a world divisible by pp*tp={fixed}" if fixed > 1 else "any world") + \
            (f" with dp >= {self.min_dp} (world >= {fixed * self.min_dp})" if self.min_dp > 1 else "")


_PP2 = dict(num_microbatches=4)
CONFIGS = [
    Config("dp", options=dict(num_microbatches=2), quick=True),
    Config("zb-h1", options=dict(schedule="zb-h1", num_microbatches=2)),
    Config("recompute-block", options=dict(num_microbatches=2, recompute="block")),
    Config("dp-shard-stage", options=dict(num_microbatches=2, dp_shard="stage"), min_dp=2, quick=True),
    Config("dp-shard-layer", options=dict(num_microbatches=2, dp_shard="layer"), min_dp=2),
    Config("pp2-gpipe", pp=2, options=dict(schedule="gpipe", **_PP2)),
    Config("pp2-1f1b", pp=2, options=dict(schedule="1f1b", **_PP2), quick=True),
    Config("pp2-interleaved", pp=2, options=dict(schedule="interleaved", chunks_per_rank=2, **_PP2)),
    Config("pp2-zb-h1", pp=2, options=dict(schedule="zb-h1", **_PP2)),
    Config("pp2-zb-v", pp=2, options=dict(schedule="zb-v", chunks_per_rank=2, **_PP2)),
    Config("pp4-1f1b", pp=4, options=dict(schedule="1f1b", num_microbatches=4)),
    Config("tp2", tp=2, options=dict(num_microbatches=2)),
    Config("tp2-sp", tp=2, options=dict(num_microbatches=2, sequence_parallel=True), quick=True),
    Config("tp4", tp=4, options=dict(num_microbatches=2)),
    Config("tp4-2d", tp=4, options=dict(num_microbatches=2, tp_mode="2d")),
    Config("pp2-tp2", pp=2, tp=2, options=dict(schedule="1f1b", **_PP2), quick=True),
    Config("tp2-dp-shard", tp=2, options=dict(num_microbatches=2, dp_shard="stage"), min_dp=2),
    Config("pp2-tp2-sp-dp-shard", pp=2, tp=2, options=dict(sequence_parallel=True, dp_shard="layer", **_PP2),
           min_dp=2),
    Config("compiled", options=dict(num_microbatches=2, compile_stages=True)),
    Config("pp2-compiled", pp=2, options=dict(compile_stages=True, **_PP2)),
    Config("tp2-compiled", tp=2, options=dict(num_microbatches=2, compile_stages=True)),
]
BY_NAME = {c.name: c for c in CONFIGS}


def global_batch(world: int) -> int:
    """Rows of each global batch: divisible by dp * num_microbatches of every configuration (at most
    2 * world: dp = world / (pp * tp) and num_microbatches <= 2 * pp * tp), at least 2 rows a microbatch."""
    return max(8, 4 * world)


def select(world: int, quick: bool, names: list[str] | None = None,
           inductor_problem: str | None = None) -> tuple[list[Config], list[tuple[Config, str]]]:
    """(the configurations to run, in order; the skipped ones with the reason).

    Args:
        world: the number of ranks.
        quick: keep only the ``quick`` ones (ignored when ``names`` are given).
        names: run exactly these (``--configs``); an unknown name is refused with the known ones.
        inductor_problem: why torch.compile's inductor does not work here, or None where it does.
    """
    if names:
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            raise AutosplitError(f"unknown configuration{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: "
                                 f"the check knows {', '.join(BY_NAME)}")
        wanted = [BY_NAME[n] for n in names]
    else:
        wanted = [c for c in CONFIGS if c.quick or not quick]
    run, skipped = [], []
    for c in wanted:
        if c.mesh(world) is None:
            skipped.append((c, f"needs {c.needs()}; the world has {world} rank{'s' if world > 1 else ''}"))
        elif c.compiled and inductor_problem:
            skipped.append((c, f"torch.compile does not work here: {inductor_problem}"))
        else:
            run.append(c)
    return run, skipped
