"""Which part of a full parameter each tensor-parallel rank holds, as plain data.

Terms:
  slice   -- for one tp rank, ``{dim: indices}``: the indices along each listed dim that the rank keeps, in
             the order it stores them (dims not listed are whole).  1D tensor parallelism lists one dim
             (fused qkv rows by heads: not contiguous); 2D lists up to two (a linear's output rows by the
             ``tp_col`` coordinate, its input columns by ``tp_row``).
  box     -- a contiguous block of the full tensor a rank holds: global offsets, sizes, and where the block
             sits in the rank's local tensor.  A slice is the product of the contiguous runs of its index
             lists; sharded checkpoints store boxes (one chunk each, with its global offset).
  tp rank -- the rank's index in its tensor-parallel group (for 2D, ``row * q + col``).

Pure data: no process group.  The runtime gathers (``place``) and scatters (``select``) with it.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


class RankSlices(Sequence):
    """Per tp rank, its slice, computed when first read: a plan of a 1024-way layout would otherwise
    build a million index dicts for the few ranks anyone asks about (the search reads rank 0's)."""

    def __init__(self, n: int, slice_of: Callable[[int], dict[int, torch.Tensor]]):
        self._n, self._slice_of, self._done = n, slice_of, {}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, rank):
        if isinstance(rank, slice):
            return [self[r] for r in range(*rank.indices(self._n))]
        if not -self._n <= rank < self._n:
            raise IndexError(f"tp rank {rank} of {self._n}")
        rank %= self._n
        if rank not in self._done:
            self._done[rank] = self._slice_of(rank)
        return self._done[rank]


@dataclass
class ShardedParam:
    name: str
    full_shape: tuple[int, ...]
    slices: Sequence[dict[int, torch.Tensor]]    # per tp rank: dim -> indices kept along dim

    @classmethod
    def along(cls, name: str, dim: int, full_shape, indices: list[torch.Tensor]) -> "ShardedParam":
        """Split along one dim: tp rank r keeps ``indices[r]``."""
        return cls(name, tuple(full_shape), [{dim: i} for i in indices])

    @property
    def dims(self) -> list[int]:
        """Tensor dims split on some rank."""
        return sorted({d for s in self.slices for d in s})

    def local_shape(self, rank: int) -> tuple[int, ...]:
        s = self.slices[rank]
        return tuple(len(s[d]) if d in s else n for d, n in enumerate(self.full_shape))

    def select(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s local tensor, cut out of the full one."""
        for d, index in sorted(self.slices[rank].items()):
            full = full.index_select(d, index.to(full.device))
        return full

    def place(self, full: torch.Tensor, local: torch.Tensor, rank: int) -> None:
        """Write rank ``rank``'s local tensor into its place in ``full`` (in place)."""
        index = [torch.arange(n, device=full.device) for n in full.shape]
        for d, ix in self.slices[rank].items():
            index[d] = ix.to(full.device)
        grid = [ix.view([-1 if k == d else 1 for k in range(full.dim())]) for d, ix in enumerate(index)]
        full[tuple(grid)] = local.to(full.dtype)

    def boxes(self, rank: int) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """(global offsets, sizes, local offsets) of the contiguous blocks rank ``rank`` holds."""
        runs_per_dim = []
        for d, n in enumerate(self.full_shape):
            ix = self.slices[rank].get(d)
            runs_per_dim.append([(0, n, 0)] if ix is None else _runs(ix.tolist()))
        out = []
        for combo in itertools.product(*runs_per_dim):
            out.append((tuple(c[0] for c in combo), tuple(c[1] for c in combo), tuple(c[2] for c in combo)))
        return out

    def first_copy(self, rank: int) -> bool:
        """Is ``rank`` the lowest tp rank holding this slice?  2D keeps some tensors whole over one axis
        (a bias too short to split over tp_row), so several ranks hold the same slice; sums over the
        ranks (a gradient norm) must count it once."""
        mine = self.slices[rank]
        return not any(other.keys() == mine.keys() and all(torch.equal(other[d], mine[d]) for d in mine)
                       for other in self.slices[:rank])

    def describe(self) -> str:
        """Short text for plan listings: the split dims and the local shape on rank 0."""
        return f"dims {self.dims} -> {list(self.local_shape(0))} of {list(self.full_shape)}"


def _runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """Contiguous ascending runs of ``indices``: (global start, length, local start)."""
    runs, start = [], 0
    for k in range(1, len(indices) + 1):
        if k == len(indices) or indices[k] != indices[k - 1] + 1:
            runs.append((indices[start], k - start, start))
            start = k
    return runs
