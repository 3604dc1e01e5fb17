"""Memory and traffic of sharded data parallelism (``dp_shard``: FSDP2 over the dp axis), per stage.

Terms (runtime/parallel/fsdp.py runs what this predicts):
  P          -- the stage's parameter bytes on this rank (its tensor-parallel shard), float32.
  state      -- what a rank keeps between steps: parameter, gradient and two Adam moments.
                Replicated: 4 P.  Sharded: 4 P / dp (parameters the ranks cannot shard, tp partial-sum
                norms, are a rounding error and counted as sharded).
  step       -- what a sharded stage holds only during a step: the gradients, accumulated unsharded
                over the step's microbatches and reduce-scattered once at its last backward (P), and
                the unsharded parameters in the all-gather dtype (``gather_ratio`` x P for "stage",
                which keeps them through the step; two layer units' worth for "layer": the one
                computing and the one prefetched).
  traffic    -- bytes each rank's dp collectives move per step (ring, (dp - 1) / dp of the full size):
                replicated, one all-reduce of P (2 x); "stage", one all-gather (in the gather dtype)
                and one reduce-scatter (float32); "layer", 2 m all-gathers (forward and backward of
                every microbatch) and one reduce-scatter.
  pieces     -- how the runtime sends it, each message paying its own latency at its own size's
                bandwidth: replicated, DDP-style buckets of DP_BUCKET_BYTES (the last one the remainder);
                "layer", one reduce-scatter per unit and one all-gather per unit and pass (k units of
                P / k, k = ceil(P / the largest unit)); "stage", one of each over P.
  time       -- the gradient sync after the final backward (all-reduces or reduce-scatters: step_time.py
                *dp sync*); ``gather``, one pass's all-gathers, is placed inside the computes that wait
                for them (step_time.py *fsdp gathers*).
  choice     -- ``dp_shard=True``: "stage" (least traffic) when it fits the memory budget, else "layer".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autosplit.cost_model.comm import all_gather_time, all_reduce_time, group_nodes, reduce_scatter_time
from autosplit.model_layers import path_layer

GRANULARITIES = ("stage", "layer")
DP_BUCKET_BYTES = 25 * 2**20    # the runtime's default gradient bucket (runtime/parallel/data_parallel.py)
STATE_FACTOR = 4            # parameter + gradient + two Adam moments


@dataclass(frozen=True)
class DataParallelCost:
    """One stage's data-parallel memory (bytes per rank) and traffic (per step)."""
    sharding: str | None      # None (replicated), "stage" or "layer"
    state_bytes: float
    step_bytes: float
    traffic_bytes: float
    time: float               # predicted seconds of the gradient sync per step (all-reduces / reduce-scatters)
    buckets: int = 1          # pieces the sync is sent in as the final backward produces them (step_time.py)
    gather: float = 0.0       # seconds of one pass's all-gathers ("layer": per forward and per backward;
    #                           "stage": once a step)
    units: int = 1            # the units those gathers go out in
    microbatches: int = 1     # m (the "layer" gathers run once per pass of every microbatch)

    @property
    def collective_time(self) -> float:
        """Seconds of all dp collectives of a step, where none overlapped anything."""
        passes = 2 * self.microbatches if self.sharding == "layer" else 1
        return self.time + passes * self.gather

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.step_bytes


def dp_cost(param_bytes: float, largest_unit: float, dp: int, microbatches: int, sharding: str | None,
            profile, gather_ratio: float = 1.0, nodes: int | None = None) -> DataParallelCost:
    """Args:
        param_bytes: P, the stage's float32 parameter bytes on this rank.
        largest_unit: bytes of the stage's largest FSDP unit under "layer" (its largest layer, or what
            lies outside the layers).
        dp: ranks in the dp group.  microbatches: m.  sharding: None, "stage" or "layer".
        profile: the cost model's DeviceProfile (link bandwidth and latency).
        gather_ratio: all-gather bytes per parameter byte (0.5 when FSDP gathers bfloat16 copies).
        nodes: the nodes the dp group spans (comm.group_nodes); None: consecutive ranks.
    """
    state, step = dp_memory(param_bytes, largest_unit, dp, sharding, gather_ratio)
    if sharding is None or dp == 1:
        k = dp_buckets(param_bytes, None)
        return DataParallelCost(None, state, step, 2 * (dp - 1) / dp * param_bytes,
                                _pieces(all_reduce_time, param_bytes, k, dp, profile, nodes, DP_BUCKET_BYTES), k)
    gathered = gather_ratio * param_bytes
    gathers = 1 if sharding == "stage" else 2 * microbatches
    traffic = (dp - 1) / dp * (gathers * gathered + param_bytes)
    k = dp_buckets(param_bytes, sharding, largest_unit)
    sync = _pieces(reduce_scatter_time, param_bytes, k, dp, profile, nodes)
    gather = _pieces(all_gather_time, gathered, k, dp, profile, nodes)
    return DataParallelCost(sharding, state, step, traffic, sync, k, gather, k, microbatches)


def dp_memory(param_bytes: float, largest_unit: float, dp: int, sharding: str | None,
              gather_ratio: float = 1.0) -> tuple[float, float]:
    """(state, step) bytes per rank of ``dp_cost`` with the same arguments, without pricing any time (a
    memory-budgeted cut asks for every range of segments)."""
    if sharding is None or dp == 1:
        return STATE_FACTOR * param_bytes, 0.0
    if sharding not in GRANULARITIES:
        raise ValueError(f"sharding={sharding!r}: expected None or one of {GRANULARITIES}")
    gathered = gather_ratio * param_bytes
    unsharded = gathered if sharding == "stage" else 2 * gather_ratio * largest_unit
    return STATE_FACTOR * param_bytes / dp, param_bytes + min(unsharded, gathered)


def _pieces(fn, nbytes: float, k: int, dp: int, profile, nodes, size: float | None = None) -> float:
    """Seconds of ``nbytes`` sent as k messages, one after another: of ``size`` bytes each and the
    remainder last, or (size None) k equal ones."""
    if k <= 1 or nbytes <= 0:
        return fn(nbytes, dp, profile, nodes)
    if size is None:
        return k * fn(nbytes / k, dp, profile, nodes)
    return (k - 1) * fn(size, dp, profile, nodes) + fn(nbytes - (k - 1) * size, dp, profile, nodes)


def dp_buckets(param_bytes: float, sharding: str | None, largest_unit: float = 0.0) -> int:
    """Pieces a stage's dp sync goes out in while its final backward runs: replicated, its 25 MiB
    buckets (runtime/parallel/data_parallel.py); "layer", one reduce-scatter per layer unit (FSDP2 reduces a unit
    as soon as its backward is done); "stage", one reduce-scatter after the whole backward."""
    if sharding == "stage" or param_bytes <= 0:
        return 1
    size = largest_unit if sharding == "layer" and largest_unit > 0 else DP_BUCKET_BYTES
    return max(1, math.ceil(param_bytes / size))


def unit_sums(nodes, layers) -> dict[str | None, float]:
    """Parameter bytes per FSDP unit over ``nodes`` (fx nodes with ``meta['cost']``): per layer
    (``layers``: module paths), and None for everything outside the layers together; the largest
    unit of a stage is the largest of its segments' sums added up."""
    per_unit: dict[str | None, float] = {}
    for n in nodes:
        layer = path_layer(n.meta.get("module_path", ""), layers)
        per_unit[layer] = per_unit.get(layer, 0.0) + n.meta["cost"].param_bytes
    return per_unit


def candidates(dp_shard, dp: int) -> list[str | None]:
    """The shardings to try, in order of preference, for ``compile(..., dp_shard=...)``."""
    if dp_shard not in (False, None, True, *GRANULARITIES):
        raise ValueError(f"dp_shard={dp_shard!r}: expected False, True (the cost model chooses), 'stage' or 'layer'")
    if not dp_shard:
        return [None]
    if dp_shard is True:
        return list(GRANULARITIES)
    return [dp_shard]


class UnitTable:
    """Per segment the bytes of each FSDP unit in it (``unit_sums``), and the largest unit of any range of
    segments: per unit the difference of its prefix sums.  Built once per segment table and kept by its
    owner (the search's group): every dp group, microbatch count and cut of it asks for the same ranges,
    and a memory-budgeted cut for every range."""

    def __init__(self, units: list[dict]):
        names = {u: j for j, u in enumerate(dict.fromkeys(u for part in units for u in part))}
        table = np.zeros((len(units) + 1, max(1, len(names))))
        for k, part in enumerate(units):
            for u, nbytes in part.items():
                table[k + 1, names[u]] = nbytes
        self.prefix = np.cumsum(table, axis=0)
        self._largest: dict[tuple[int, int], float] = {}

    def largest(self, first: int, last: int) -> float:
        key = (first, last)
        if key not in self._largest:
            self._largest[key] = float(max(0.0, (self.prefix[last + 1] - self.prefix[first]).max()))
        return self._largest[key]


class StageDataParallel:
    """``dp_cost`` of a stage spanning segments first..last (see segment_costs.SegmentCosts)."""

    def __init__(self, segments, params: list[float], layers, dp: int, microbatches: int, sharding: str | None,
                 profile, gather_ratio: float = 1.0, tp: int = 1, units: UnitTable | None = None):
        """``units``: the segments' UnitTable, where already built (the search keeps one per group)."""
        self.segments, self.params, self.layers = segments, params, list(layers)
        self.dp, self.m, self.sharding, self.profile, self.ratio = dp, microbatches, sharding, profile, gather_ratio
        self.nodes = group_nodes(profile, dp, tp)      # the dp group: every tp-th rank (mesh.py's layout)
        self._units = units             # None: built on first use
        self._costs: dict[tuple, DataParallelCost] = {}  # (first, last, param_bytes) -> its cost (a pure function)
        self._memory: dict[tuple, float] = {}            # the same key -> ``memory_bytes`` (bytes alone)

    def _unit(self, first: int, last: int) -> float:
        """Bytes of the largest FSDP unit of segments first..last (``UnitTable``)."""
        if self._units is None:
            self._units = UnitTable([unit_sums(s, self.layers) for s in self.segments])
        return self._units.largest(first, last)

    def memory_bytes(self, first: int, last: int, param_bytes: float | None = None) -> float:
        """``self(first, last, param_bytes).memory_bytes`` without pricing the collectives."""
        key = (first, last, param_bytes)
        if key in self._costs:
            return self._costs[key].memory_bytes
        if key not in self._memory:
            state, step = dp_memory(*self._sizes(first, last, param_bytes), self.dp, self.sharding, self.ratio)
            self._memory[key] = state + step
        return self._memory[key]

    def _sizes(self, first: int, last: int, param_bytes: float | None) -> tuple[float, float]:
        """(parameter bytes, largest FSDP unit) of segments first..last (``__call__``'s arguments)."""
        unit = self._unit(first, last) if self.sharding == "layer" else 0.0
        return (sum(self.params[first:last + 1]) if param_bytes is None else param_bytes), unit

    def __call__(self, first: int, last: int, param_bytes: float | None = None) -> DataParallelCost:
        """``param_bytes``: the stage module's own count, where known (default: its segments' sum).  Kept
        per range: a memory-budgeted cut, and the search's every price of one group, ask again."""
        key = (first, last, param_bytes)
        if key not in self._costs:
            total, unit = self._sizes(first, last, param_bytes)
            self._costs[key] = dp_cost(total, unit, self.dp, self.m, self.sharding, self.profile, self.ratio, self.nodes)
        return self._costs[key]
