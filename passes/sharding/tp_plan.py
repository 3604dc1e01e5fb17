"""The tensor-parallel plan: how each tp rank's modules and parameters are built from the one graph.

Terms:
  ShardedParam  -- a parameter split across tp ranks (autosplit/tp/shards.py): per rank, the indices it
                   keeps along the split dim (fused qkv rows by heads, not contiguous thirds).
  maker         -- fn(tp rank) -> the module or tensor that rank runs a graph target with.
  partial grads -- whole parameters read by a split op: each rank's gradient is a part, which the
                   runtime sums over tp once per step (not in the dp buckets).
  local root    -- for tp rank t, the modules and parameters the rewritten graph calls, with rank t's
                   shards; ``TensorParallelPlan.local_root(t)`` builds it.
  regions       -- readable lines on what was split (one per split Linear / attention).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx
from torch import nn


@dataclass
class TensorParallelPlan:
    tp: int
    root: nn.Module
    sharded: dict = field(default_factory=dict)           # name -> ShardedParam
    makers: dict = field(default_factory=dict)            # module / attribute target -> fn(rank)
    notes: list[str] = field(default_factory=list)
    regions: list[str] = field(default_factory=list)
    partial_grads: set[str] = field(default_factory=set)
    # a replicated axis's (cp's) parameters whose gradient is whole on each of its ranks (lower.py
    # *replicated axis*); every other parameter's is a part there, summed with the dp buckets
    whole_grads: set[str] = field(default_factory=set)
    forms: list = field(default_factory=list)             # 2D: (layer, "allgather" | "summa") per linear
    axes: tuple = ()                                      # grid modes: ((axis, size), ...) (autosplit/tp/axes.py)
    mode: str = ""                                        # tp_mode="auto": the layout it chose (passes/tp_auto.py)
    sharding: object = field(default=None, repr=False)    # the engine's Sharding (1D), for explain()
    sequence_parallel: bool = False
    _cache: dict = field(default_factory=dict)

    def local_root(self, rank: int, graph: fx.Graph) -> dict:
        """Targets of ``graph`` -> the objects tp rank ``rank`` runs them with."""
        out = {}
        for n in graph.nodes:
            if n.op not in ("call_module", "get_attr"):
                continue
            owner = next((t for t in self.makers if n.target == t or str(n.target).startswith(t + ".")), None)
            if owner is not None:
                key = (owner, rank)
                if key not in self._cache:
                    self._cache[key] = self.makers[owner](rank)
                module = self._cache[key]
                out[n.target] = module if n.target == owner else fetch(module, n.target[len(owner) + 1:])
            else:
                out[n.target] = fetch(self.root, n.target)
        return out


def fetch(root, target: str):
    """The attribute at dotted ``target`` under ``root``."""
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
