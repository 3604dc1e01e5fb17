"""What the search returns: ranked Candidates, the Rejected ones with their reasons, and the table.

Terms:
  Candidate -- one full configuration: ``mesh`` (a SearchMesh: pp, cp, tp, dp) and ``options (the ``parallelize`` /
               ``compile`` keywords it implies), with its predicted ``step_time`` (seconds), ``parts``
               (compute, bubble, exposed_comm = tp_comm + pp_comm, dp_comm, optimizer: seconds of the
               slowest rank, adding up to step_time; cost_model/step_time.py) and ``memory`` (bytes on the fullest rank: the sum
               of its stages' predicted memory).
  Rejected  -- a configuration the search did not price, with ``why`` (the arithmetic) and ``kind``
               (what the table counts: "tensor parallel", "batch", "stages", "memory", "schedule").
  pruned    -- configurations whose lower bound on step time was already no better than the
               ``top``-th best found: dominated, not infeasible (counted, not listed).
  label     -- ``describe``: the mesh as ``(pp,tp,dp)`` where cp = 1 (as before the cp axis), as
               ``(pp=..,cp=..,tp=..,dp=..)`` where cp > 1, then the options.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from autosplit.deprecated import RENAMED_OPTIONS, RenamedKeys
from autosplit.mesh import MeshShape


def _renamed(obj) -> None:
    """``obj.options`` as a dict whose old keys (``options["checkpoint"]``) still read, with a warning."""
    object.__setattr__(obj, "options", RenamedKeys(obj.options, RENAMED_OPTIONS))


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


class SearchMesh(MeshShape):
    """A candidate's mesh: a MeshShape (``.pp``, ``.cp``, ``.tp``, ``.dp``; ``compile`` and ``parallelize``
    take it as ``mesh=``) that also reads as the ``(pp, tp, dp)`` tuple the search returned before the cp
    axis: ``mesh[2]`` is dp, ``pp, tp, dp = mesh`` unpacks, and it equals that tuple where cp = 1."""

    def _key(self) -> tuple[int, int, int, int]:
        return (self.pp, self.cp, self.tp, self.dp)

    def __iter__(self):
        return iter((self.pp, self.tp, self.dp))

    def __getitem__(self, i):
        return (self.pp, self.tp, self.dp)[i]

    def __len__(self) -> int:
        return 3

    def __eq__(self, other):
        if isinstance(other, MeshShape):
            return self._key() == (other.pp, other.cp, other.tp, other.dp)
        if isinstance(other, tuple):
            return self.cp == 1 and tuple(self) == other
        return NotImplemented

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash(tuple(self)) if self.cp == 1 else hash(self._key())


def search_mesh(pp: int, tp: int, dp: int, cp: int = 1) -> SearchMesh:
    return SearchMesh(pp=pp, tp=tp, dp=dp, cp=cp)


@dataclass(frozen=True)
class Candidate:
    mesh: SearchMesh
    options: dict
    step_time: float
    memory: int
    parts: dict = field(default_factory=dict)
    bounds: tuple[int, ...] = ()          # the stage cut (plan.bounds of the plan it compiles to)

    __post_init__ = _renamed

    @property
    def label(self) -> str:
        return describe(self.mesh, self.options)


@dataclass(frozen=True)
class Rejected:
    mesh: SearchMesh
    options: dict
    why: str
    kind: str

    __post_init__ = _renamed


def describe(mesh, options: dict) -> str:
    """A short text of a configuration: ``(2,4,8) 1d sp interleaved v2 m16 recompute=block shard=stage``;
    with a cp axis ``(pp=1,cp=4,tp=2,dp=8) 1d 1f1b m2`` (``mesh``: a MeshShape, or a (pp, tp, dp) tuple)."""
    o = options
    cp = getattr(mesh, "cp", 1)
    pp, tp, dp = (mesh.pp, mesh.tp, mesh.dp) if isinstance(mesh, MeshShape) else tuple(mesh)
    words = [f"(pp={pp},cp={cp},tp={tp},dp={dp})" if cp > 1 else f"({pp},{tp},{dp})"]
    if tp > 1:
        words.append(o.get("tp_mode", "1d") + (" sp" if o.get("sequence_parallel") else "") +
                     (f" d{o['tp_depth']}" if o.get("tp_depth") else ""))
    v = o.get("chunks_per_rank", 1)
    words.append(o.get("schedule", "1f1b") + (f" v{v}" if v > 1 else ""))
    words.append(f"m{o.get('num_microbatches')}")
    if o.get("recompute"):
        words.append(f"recompute={o['recompute']}")
    if o.get("dp_shard"):
        words.append(f"shard={o['dp_shard']}")
    return " ".join(words)


class SearchResult(list):
    """The ranked Candidates (fastest first), with ``rejected``, ``pruned`` and ``seconds``."""

    def __init__(self, ranked, rejected: list[Rejected], pruned: int, evaluated: int, seconds: float,
                 phases: dict[str, float] | None = None):
        super().__init__(ranked)
        self.rejected, self.pruned, self.evaluated, self.seconds = rejected, pruned, evaluated, seconds
        self.phases = phases or {}      # phase -> seconds (search.py ``PHASES``)

    def rejected_counts(self) -> Counter:
        return Counter(r.kind for r in self.rejected)

    def table(self) -> str:
        # with a cp axis, its collectives (key gathers, their gradients' reduce-scatters) are priced as
        # the block's communication, as compile prices them (plan.predicted_step().tp_comm)
        comm = "tp+cp comm" if any(getattr(c.mesh, "cp", 1) > 1 for c in self) else "tp comm"
        rows = [("rank", "configuration", "step ms", "compute", "bubble", comm, "pp comm", "dp sync", "optimizer",
                 "memory")]
        for i, c in enumerate(self, 1):
            p = c.parts
            rows.append((str(i), c.label, f"{c.step_time * 1e3:.3f}", *(f"{p.get(k, 0.0) * 1e3:.3f}" for k in
                         ("compute", "bubble", "tp_comm", "pp_comm", "dp_comm", "optimizer")), _bytes(c.memory)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        counts = self.rejected_counts()
        lines.append(f"priced {self.evaluated}, pruned {self.pruned} (time lower bound above the top {len(self)}), "
                     f"rejected {len(self.rejected)}" + (": " + ", ".join(f"{k} {n}" for k, n in
                                                                     sorted(counts.items())) if counts else ""))
        examples = {}
        for r in self.rejected:
            examples.setdefault(r.kind, r)
        lines += [f"  e.g. {describe(r.mesh, r.options)}: {r.why}" for r in examples.values()]
        lines.append(f"searched in {self.seconds:.2f} s" + (" (" + ", ".join(
            f"{k} {v:.1f}" for k, v in self.phases.items()) + ")" if self.phases else ""))
        return "\n".join(lines)
