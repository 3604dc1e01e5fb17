"""Find the places in a graph where a pipeline cut is cheap and legal.

Terms:
  position  -- index i in the graph's node order; a cut at i puts nodes [.., i] before the cut and
               nodes [i+1, ..] after it.
  crossing  -- the values a cut must send: nodes at or before i (not get_attr) with a user after i.
  candidate -- a position where every crossing value is a tensor, no parameter or module is used on
               both sides (tied weights stay together), work lies on both sides, and at most one more
               tensor crosses than the fewest the graph allows.  In a transformer the fewest (one) is
               the residual stream between blocks and between the attention and MLP halves of a
               block; one more is the residual plus a branch tensor (after fc1, after the attention
               projection), which lets the partitioner balance below half-block granularity; the cost
               model charges the larger transfer.
  work      -- a node whose cost (``meta['cost']``, when annotated) moves bytes or does FLOPs; of
               several candidates with no work between them only the last is kept (a cut between two
               parameter reads or two views is the same cut).
  segment   -- the nodes between two consecutive candidates: the unit the partitioner assigns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

from autosplit.errors import AutosplitError
from autosplit.passes.infra import MetaPass
from autosplit.passes.shape_prop import tensor_bytes

_NO_COMPUTE = ("placeholder", "output", "get_attr")


@dataclass(frozen=True)
class Cut:
    position: int               # cut after nodes[position]
    crossing: tuple[str, ...]   # names of the values sent across, in graph order
    nbytes: int                 # bytes of those values for one microbatch


def _owners(nodes: list[fx.Node]) -> list[str | None]:
    """The parameter-holding thing each node touches: the module it calls, or for a parameter read
    the module that holds it when that module is also called (a row-parallel layer's bias is read
    after the all-reduce), else the attribute itself."""
    modules = {str(n.target) for n in nodes if n.op == "call_module"}

    def owner(n: fx.Node) -> str | None:
        if n.op == "call_module":
            return str(n.target)
        if n.op != "get_attr":
            return None
        parts = str(n.target).split(".")
        prefixes = (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1))
        return next((p for p in prefixes if p in modules), str(n.target))

    return [owner(n) for n in nodes]


def crossing_sets(nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """crossing[i]: the non-get_attr values defined at or before i that are used after i."""
    index = {n: i for i, n in enumerate(nodes)}
    last_use = {n: max((index[u] for u in n.users), default=index[n]) for n in nodes}
    live: list[fx.Node] = []
    out = []
    for i, n in enumerate(nodes):
        if n.op != "get_attr":
            live.append(n)
        live = [v for v in live if last_use[v] > i]
        out.append(list(live))
    return out


def _split_owners(nodes: list[fx.Node]) -> list[bool]:
    """split[i]: some module or parameter is used both at/before i and after i.  A parameter read
    is placed with its users (split_stages copies it there), so its users' positions count."""
    index = {n: i for i, n in enumerate(nodes)}
    first, last = {}, {}
    for n, owner in zip(nodes, _owners(nodes)):
        if owner is None:
            continue
        used_at = [index[u] for u in n.users] if n.op == "get_attr" and n.users else [index[n]]
        first[owner] = min(first.get(owner, len(nodes)), *used_at)
        last[owner] = max(last.get(owner, -1), *used_at)
    split = [False] * len(nodes)
    for owner, lo in first.items():
        for i in range(lo, last[owner]):
            split[i] = True
    return split


def find_cuts(gm: fx.GraphModule) -> list[Cut]:
    """Candidate cuts of ``gm`` (requires node.meta['val']), in graph order."""
    nodes = list(gm.graph.nodes)
    crossing = crossing_sets(nodes)
    split = _split_owners(nodes)
    compute = [n.op not in _NO_COMPUTE for n in nodes]
    first_compute = compute.index(True)
    last_compute = len(compute) - 1 - compute[::-1].index(True)
    legal = []
    for i in range(first_compute, last_compute):
        values = crossing[i]
        if split[i] or not values:
            continue
        if all(isinstance(v.meta.get("val"), torch.Tensor) for v in values):
            legal.append(i)
    if not legal:
        return []
    fewest = min(len(crossing[i]) for i in legal)
    kept = _drop_empty([i for i in legal if len(crossing[i]) <= fewest + 1], nodes)
    return [Cut(i, tuple(v.name for v in crossing[i]), sum(tensor_bytes(v.meta["val"]) for v in crossing[i]))
            for i in kept]


def _does_work(node: fx.Node) -> bool:
    if node.op in _NO_COMPUTE:
        return False
    cost = node.meta.get("cost")
    return cost is None or cost.fwd_flops > 0 or cost.fwd_bytes > 0


def _drop_empty(positions: list[int], nodes: list[fx.Node]) -> list[int]:
    """Of candidates with no work between them keep the last, so no segment is empty."""
    kept: list[int] = []
    for i in positions:
        if kept and not any(_does_work(n) for n in nodes[kept[-1] + 1:i + 1]):
            kept[-1] = i
        else:
            kept.append(i)
    return kept


class FindCuts(MetaPass):
    """``find_cuts`` as a pipeline step.  Requires meta['val'] and meta['cost'] (work between
    candidates).  Ensures ``state.cuts`` and ``state.segments``; refuses more stages than cuts allow."""

    requires_meta = ("val", "cost")
    ensures_state = ("cuts", "segments")

    def __init__(self, state):
        self.state = state

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        s = self.state
        cuts = find_cuts(graph_module)
        if s.n_stages > len(cuts) + 1:
            raise AutosplitError(
                f"pp({s.mesh.pp}) * chunks_per_rank({s.options.chunks_per_rank}) = {s.n_stages} stages, but the "
                f"graph has only {len(cuts)} places to cut (at most {len(cuts) + 1} stages); use fewer pipeline stages")
        nodes, segments, start = list(graph_module.graph.nodes), [], 0
        for end in [c.position for c in cuts] + [len(nodes) - 1]:
            segments.append(nodes[start:end + 1])
            start = end + 1
        s.put(cuts=cuts, segments=segments)
        return PassResult(graph_module, False)
