"""Feature-factor layouts: how each dim of a tensor is built from the output features of linears.

Terms:
  factor  -- a named run of indices.  Each column-candidate linear's output features start as one
             factor; a reshape that splits a dim refines the factors inside it (qkv's 3*C features
             become factors (3, heads, head_dim) when reshaped to (B, N, 3, heads, head_dim)).
             Dims that do not come from features (batch, tokens) are factors too, of kind "other".
  layout  -- per tensor dim, the list of leaf factors it flattens, outermost first.
  align   -- two factors that ops pair index by index (the head dim of q and of k in q @ k^T);
             they form one class (union-find) that must be sharded together or not at all.
  forbid  -- a factor an op reduces or contracts over (softmax dim, layer_norm dims, the k of a
             matmul, head_dim in attention): sharding it would need a collective inside the region.

The analysis works on shapes only (``node.meta['val']``); it never looks at module names.
"""
from __future__ import annotations

import math


class Factors:
    def __init__(self):
        self.size: list[int] = []
        self.children: dict[int, list[int]] = {}
        self.parent: list[int] = []          # union-find over alignment classes

    def new(self, size: int) -> int:
        self.size.append(size)
        self.parent.append(len(self.parent))
        return len(self.size) - 1

    def leaves(self, f: int) -> list[int]:
        kids = self.children.get(f)
        return [f] if kids is None else [leaf for k in kids for leaf in self.leaves(k)]

    def flat(self, dim: list[int]) -> list[int]:
        return [leaf for f in dim for leaf in self.leaves(f)]

    def split(self, f: int, sizes: list[int]) -> list[int]:
        assert f not in self.children and math.prod(sizes) == self.size[f]
        self.children[f] = [self.new(s) for s in sizes]
        return self.children[f]

    def find(self, f: int) -> int:
        while self.parent[f] != f:
            self.parent[f] = self.parent[self.parent[f]]
            f = self.parent[f]
        return f

    def union(self, a: int, b: int) -> None:
        self.parent[self.find(a)] = self.find(b)

    def align(self, da: list[int], db: list[int]) -> bool:
        """Pair two dims factor by factor; False if their factorizations cannot be matched."""
        la, lb = self.flat(da), self.flat(db)
        la = [f for f in la if self.size[f] > 1]
        lb = [f for f in lb if self.size[f] > 1]
        if [self.size[f] for f in la] != [self.size[f] for f in lb]:
            return False
        for a, b in zip(la, lb):
            self.union(a, b)
        return True

    def reshape(self, dims: list[list[int]], new_shape: list[int]) -> list[list[int]] | None:
        """Layout after reshaping a tensor with layout ``dims`` to ``new_shape`` (None if impossible)."""
        queue = [f for dim in dims for f in self.flat(dim) if self.size[f] > 1]
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
            out.append(dim)
        return out if not queue else None

    def split_leading(self, dim: list[int], n: int) -> list[int] | None:
        """Make the dim's leading factor exactly n (for chunk(n)); returns the remaining factors."""
        flat = [f for f in self.flat(dim) if self.size[f] > 1]
        if not flat:
            return None
        f = flat[0]
        if self.size[f] == n:
            return flat[1:]
        if self.size[f] % n:
            return None
        _, rest = self.split(f, [n, self.size[f] // n])
        return [rest] + flat[1:]


def index_set(factors: Factors, leaves: list[int], shard: int, n: int, rank: int):
    """Indices into a dim made of ``leaves`` that rank ``rank`` keeps when factor ``shard`` is split n ways."""
    import torch
    leaves = [f for f in leaves if factors.size[f] > 1 or f == shard]
    sizes = [factors.size[f] for f in leaves]
    k = leaves.index(shard)
    part = sizes[k] // n
    return torch.arange(math.prod(sizes)).reshape(sizes).narrow(k, rank * part, part).reshape(-1)
