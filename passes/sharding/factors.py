"""Logical dims: the factors every tensor dim is built from, and which of them are the same dim.

Terms:
  factor  -- a run of indices of one tensor dim, identified by an int.  A dim starts as one factor; a
             reshape that splits it refines it into children (qkv's 3*C features become (3, heads,
             head_dim) when viewed as (B, N, 3, heads, head_dim)).  Only leaves (unrefined factors) are
             ever sharded.
  class   -- factors that ops pair index by index (q's heads and k's heads in ``q @ k^T``, the model
             dim of a residual add's two operands) are one class (union-find): one logical dim, which
             a placement shards everywhere it appears or not at all at that op.  Refining one member of
             a class refines every member alike, so a class always has leaves of equal sizes.
  layout  -- per tensor dim, the factors it flattens, outermost first (``flat`` expands them to leaves).

Why not DTensor's own view rules (torch.distributed.tensor._ops._view_ops): they shard a flattened
dim only on its leading factor, so a fused qkv weight would be split into contiguous thirds (q of
rank 0, k of rank 1), not by heads.  A factor is what ``_StridedShard`` expresses for one reshape;
here it survives any chain of reshapes, permutes and chunks between the linear and the attention.
"""
from __future__ import annotations

import math

import torch


class Factors:
    def __init__(self):
        self.size: list[int] = []
        self.children: dict[int, list[int]] = {}
        self._parent: list[int] = []
        self._members: dict[int, list[int]] = {}       # class root -> its unrefined factors

    def new(self, size: int) -> int:
        f = len(self.size)
        self.size.append(int(size))
        self._parent.append(f)
        self._members[f] = [f]
        return f

    def find(self, f: int) -> int:
        while self._parent[f] != f:
            self._parent[f] = self._parent[self._parent[f]]
            f = self._parent[f]
        return f

    def members(self, cls: int) -> list[int]:
        """The unrefined factors of class ``cls`` (a root), all of one size."""
        return self._members[self.find(cls)]

    def leaves(self, f: int) -> list[int]:
        kids = self.children.get(f)
        return [f] if kids is None else [leaf for k in kids for leaf in self.leaves(k)]

    def flat(self, dim: list[int]) -> list[int]:
        """The dim's leaves of size > 1, outermost first."""
        return [leaf for f in dim for leaf in self.leaves(f) if self.size[leaf] > 1]

    def union(self, a: int, b: int) -> None:
        """Make two unrefined factors of equal size one class."""
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        assert self.size[a] == self.size[b], (self.size[a], self.size[b])
        self._parent[ra] = rb
        self._members[rb] += self._members.pop(ra)

    def split(self, f: int, sizes: list[int]) -> list[int]:
        """Refine leaf ``f`` into factors of ``sizes`` (outermost first), and every leaf of its class alike."""
        assert f not in self.children and math.prod(sizes) == self.size[f]
        members = [m for m in self._members[self.find(f)] if m not in self.children]
        first = None
        for m in members:
            self.children[m] = [self.new(s) for s in sizes]
            if first is None:
                first = self.children[m]
            else:
                for a, b in zip(first, self.children[m]):
                    self.union(a, b)
        return self.children[f]

    def align(self, da: list[int], db: list[int]) -> bool:
        """Pair two dims of equal extent factor by factor, refining either side where the other is
        finer; False (nothing changed) when their extents differ."""
        la, lb = self.flat(da), self.flat(db)
        if math.prod(self.size[f] for f in la) != math.prod(self.size[f] for f in lb):
            return False
        while la and lb:
            a, b = la.pop(0), lb.pop(0)
            sa, sb = self.size[a], self.size[b]
            if sa == sb:
                self.union(a, b)
            elif sa > sb and sa % sb == 0:
                first, rest = self.split(a, [sb, sa // sb])
                self.union(first, b)
                la.insert(0, rest)
            elif sb > sa and sb % sa == 0:
                first, rest = self.split(b, [sa, sb // sa])
                self.union(a, first)
                lb.insert(0, rest)
            else:
                return False            # co-prime runs: the dims pair, their factors cannot
        return True

    def reshape(self, dims: list[list[int]], new_shape) -> list[list[int]] | None:
        """The layout after viewing a tensor laid out as ``dims`` with ``new_shape`` (None: the view
        regroups indices in a way no factor survives)."""
        queue = [f for dim in dims for f in self.flat(dim)]
        out = []
        for size in new_shape:
            dim, have = [], 1
            while have < size:
                if not queue:
                    return None
                f = queue.pop(0)
                if have * self.size[f] <= size:
                    dim.append(f)
                    have *= self.size[f]
                    continue
                need = size // have
                if size % have or self.size[f] % need:
                    return None
                first, rest = self.split(f, [need, self.size[f] // need])
                dim.append(first)
                queue.insert(0, rest)
                have = size
            out.append(dim if dim else [self.new(1)])
        return out if not queue else None

    def split_leading(self, dim: list[int], n: int) -> list[int] | None:
        """Make the dim's outermost factor exactly n long (``chunk(n)``); the factors after it, or None."""
        flat = self.flat(dim)
        if not flat or self.size[flat[0]] % n:
            return None
        if self.size[flat[0]] == n:
            return flat[1:]
        first, rest = self.split(flat[0], [n, self.size[flat[0]] // n])
        return [rest] + self.flat(dim)[2:]


def index_sets(factors: Factors, dim: list[int], leaf: int, n: int) -> list[torch.Tensor]:
    """Per rank r < n, the indices of a dim laid out as ``dim`` that rank r holds when ``leaf`` is split
    n ways.  One ``arange`` serves every rank (each entry is a slice of it, a view where the slice is
    contiguous): building one per rank cost O(n * size) time and, since a leading slice stays a view of
    its own full ``arange``, O(n * size) memory (38 GB for the 1024-way layouts of a 6144-wide ViT)."""
    leaves = factors.flat(dim)
    sizes = [factors.size[f] for f in leaves]
    k = leaves.index(leaf)
    part = sizes[k] // n
    full = torch.arange(math.prod(sizes)).reshape(sizes)
    return [full.narrow(k, rank * part, part).reshape(-1) for rank in range(n)]


def index_set(factors: Factors, dim: list[int], leaf: int, n: int, rank: int) -> torch.Tensor:
    """The indices of a dim laid out as ``dim`` that rank ``rank`` holds when ``leaf`` is split n ways."""
    return index_sets(factors, dim, leaf, n)[rank]
