"""``passes.partition.balanced_bounds`` without a memory budget, vectorized over cut positions.

Terms: see passes/partition.py (segment, stage cost, bottleneck; the objective is lexicographic:
parameter-less stages, then the bottleneck, then the sum of squared stage costs).

Why a second implementation: the search cuts the same (layout, microbatch size, recompute) graph into
many stage counts, and the plain DP is O(S K^2) Python steps (a 48-block ViT has ~450 segments: seconds
per call).  This one runs the same recurrence with numpy over all (first, last) segment pairs of a stage
at once: the same float operations in the same order (prefix sums from ``itertools.accumulate``, one
max, one multiply-add), and the same tie-break (the first start segment reaching the lexicographic
minimum), so it returns exactly ``balanced_bounds``' cut (``tests/test_search.py`` compares them).

With a budget, a cut that this returns and that fits the budget is also ``balanced_bounds``' answer
under that budget: the budget only removes options, and the DP keeps the first optimal option it
meets, which is still there (see docs/design.md, "Strategy search").
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import numpy as np

from autosplit.errors import PlanError


_BLOCK = 128          # last segments per block of _extend (see there)


class CutSolver:
    """Exact balanced cuts of one segment table into any number of stages.

    The DP state best[s][k] (stages 0..s cover segments 0..k) does not depend on the total stage count:
    ``balanced_bounds``' bound ``k < K - (S-1-s)`` only skips states that cannot be completed, and
    every predecessor of a kept state is itself kept.  So one run, extended a stage at a time, answers
    every stage count: the cut into S stages backtracks from best[S-1][K-1].
    """

    def __init__(self, seg_time: Sequence[float], out_time: Sequence[float], seg_params: Sequence[int] | None = None):
        K = self.K = len(seg_time)
        prefix = np.array([0.0, *accumulate(seg_time)])
        out = np.array([*out_time[:K - 1], 0.0])
        self.j, self.k = np.arange(K)[:, None], np.arange(K)[None, :]
        self.cost = (prefix[1:][None, :] - prefix[:K][:, None]) + out[None, :]    # (j, k): stage = segments j..k
        self.square = self.cost * self.cost
        if seg_params is not None:
            params = np.array([0, *accumulate(seg_params)])
            self.empty = (params[1:][None, :] == params[:K][:, None]).astype(np.int64)
        else:
            self.empty = np.zeros((K, K), dtype=np.int64)
        self.best: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.back: list[np.ndarray] = []

    def _extend(self) -> None:
        """best[s] from best[s-1], on the (first j, last k) pairs with j, k >= s only: the rest are
        unreachable (stage s needs s segments before it), so the minima and their first index (plus s)
        are those of the whole matrix.  Column blocks of ``_BLOCK`` last segments at a time, each over the
        first segments j <= its last k (j > k is no stage): every column's minima are over the same
        candidates, in the same order, as on the whole matrix, on blocks that stay in the CPU's cache
        (the whole matrix of a 48-block ViT's ~440 segments does not: 2-3x slower per element)."""
        s, K, inf = len(self.best), self.K, np.inf
        if s:
            be, bm, bq = self.best[-1]
            pe, pm, pq = be[s - 1:K - 1], bm[s - 1:K - 1], bq[s - 1:K - 1]     # best[s-1] ending at j - 1
            finite = np.isfinite(pm)
        else:                                          # the first stage starts at segment 0
            pe, pm, pq, finite = np.zeros(1, dtype=np.int64), np.zeros(1), np.zeros(1), np.ones(1, dtype=bool)
        e_best, m_best, q_best = np.zeros(K, dtype=np.int64), np.full(K, inf), np.full(K, inf)
        back = np.full(K, -1)
        for c0 in range(s, K, _BLOCK):
            c1 = min(K, c0 + _BLOCK)
            rows = c1 - s if s else 1                  # first segments s .. c1 - 1 (only 0 for stage 0)
            j, k = self.j[s:s + rows], self.k[:, c0:c1]
            cost, square, empty = (a[s:s + rows, c0:c1] for a in (self.cost, self.square, self.empty))
            ok = (j <= k) & finite[:rows, None]
            e = np.where(ok, pe[:rows, None] + empty, np.iinfo(np.int64).max)
            m = np.maximum(pm[:rows, None], cost)
            q = pq[:rows, None] + square
            e_min = e.min(axis=0)
            first = ok & (e == e_min[None, :])
            m_min = np.where(first, m, inf).min(axis=0)
            second = first & (m == m_min[None, :])
            q_min = np.where(second, q, inf).min(axis=0)
            third = second & (q == q_min[None, :])
            reached = third.any(axis=0)
            back[c0:c1] = np.where(reached, third.argmax(axis=0) + s, -1)
            e_best[c0:c1] = np.where(reached, e_min, 0)
            m_best[c0:c1] = np.where(reached, m_min, inf)
            q_best[c0:c1] = np.where(reached, q_min, inf)
        self.back.append(back)
        self.best.append((e_best, m_best, q_best))

    def bounds(self, n_stages: int) -> list[int]:
        """Last segment of each of ``n_stages`` stages (``balanced_bounds`` without a budget)."""
        K = self.K
        if n_stages > K:
            raise PlanError(f"cannot cut {K} segments into {n_stages} stages: the graph has only {K - 1} "
                            f"places where a pipeline cut is possible; use at most {K} stages")
        while len(self.best) < n_stages:
            self._extend()
        bounds, last = [], K - 1
        for s in range(n_stages - 1, -1, -1):
            bounds.append(last)
            last = int(self.back[s][last]) - 1
        return bounds[::-1]
