"""Choose pipeline stages: contiguous runs of segments that minimize the slowest stage.

Terms:
  segment    -- the nodes between two candidate cuts (see cut_points); segment k ends at cut k.
  stage cost -- forward + backward time of the stage's segments plus the time to send its boundary
                (output) tensors forward and receive their gradients back.
  bottleneck -- the largest stage cost; a pipeline's steady-state step time is proportional to it.
  budget     -- optional per-stage memory limit (bytes); a stage over it is infeasible.

The search is exact dynamic programming over cut positions, O(S * K^2) for S stages and K segments,
minimizing the number of stages without parameters first (where the caller gives parameter bytes),
then the bottleneck, then the sum of squared stage costs (so stages that do not set the bottleneck are
balanced too).  A plain DP rather than a networkx routine: min-max partition is
not a shortest-path problem networkx solves directly, and the DP is twenty lines.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

import numpy as np

from autosplit.errors import PlanError


def stage_costs(bounds: Sequence[int], seg_time: Sequence[float], out_time: Sequence[float]) -> list[float]:
    """Costs of the stages whose last segments are ``bounds`` (the final bound is the last segment)."""
    prefix = [0.0, *accumulate(seg_time)]
    costs, start = [], 0
    for b in bounds:
        comm = out_time[b] if b < len(seg_time) - 1 else 0.0
        costs.append(prefix[b + 1] - prefix[start] + comm)
        start = b + 1
    return costs


def balanced_bounds(seg_time: Sequence[float], out_time: Sequence[float], n_stages: int,
                    stage_memory: Callable[[int, int, int], float] | None = None,
                    budget: float | None = None, seg_params: Sequence[int] | None = None) -> list[int]:
    """Last segment index of each stage, minimizing the bottleneck (then the sum of squares).

    ``out_time[k]``: cost of sending the tensors at the end of segment k (forward and backward).
    ``stage_memory(stage, first_seg, last_seg)``: bytes the stage needs; checked against ``budget``.
    ``seg_params[k]``: parameter bytes of segment k.  When given, cuts with fewer parameter-less stages
    win first: a pipeline rank with no parameters gives its optimizer an empty list (torch refuses
    one), so a slightly slower cut that gives every rank parameters is preferred where one exists.
    """
    K = len(seg_time)
    if n_stages > K:
        raise PlanError(f"cannot cut {K} segments into {n_stages} stages: the graph has only {K - 1} "
                        f"places where a pipeline cut is possible; use at most {K} stages")
    prefix = [0.0, *accumulate(seg_time)]
    params = [0, *accumulate(seg_params)] if seg_params is not None else None
    inf = (float("inf"), float("inf"), float("inf"))
    best = [[inf] * K for _ in range(n_stages)]      # best[s][k]: stages 0..s cover segments 0..k
    back = [[-1] * K for _ in range(n_stages)]
    for s in range(n_stages):
        for k in range(s, K - (n_stages - 1 - s)):
            starts = [0] if s == 0 else range(s, k + 1)
            for j in starts:                           # stage s covers segments j..k
                prev = (0, 0.0, 0.0) if s == 0 else best[s - 1][j - 1]
                if prev == inf:
                    continue
                if budget is not None and stage_memory is not None and stage_memory(s, j, k) > budget:
                    continue
                cost = prefix[k + 1] - prefix[j] + (out_time[k] if k < K - 1 else 0.0)
                empty = params is not None and params[k + 1] == params[j]
                cand = (prev[0] + empty, max(prev[1], cost), prev[2] + cost * cost)
                if cand < best[s][k]:
                    best[s][k], back[s][k] = cand, j
    if best[-1][K - 1] == inf:
        raise PlanError(f"no cut into {n_stages} stages fits the memory budget of {budget / 2**30:.2f} GiB "
                        f"per stage; raise the budget, add pipeline stages, or use activation checkpointing")
    bounds, k = [], K - 1
    for s in range(n_stages - 1, -1, -1):
        bounds.append(k)
        k = back[s][k] - 1
    return bounds[::-1]


def torchtitan_bounds(layer_end_segment: Sequence[int], embed_end_segment: int, n_segments: int,
                      n_stages: int) -> list[int] | None:
    """The baseline cut torchtitan makes (``generate_llm_fqn_per_model_part`` with its default weights):
    the embedding and the head each count as one layer, so L layers are L + 2 units; stage s gets
    ``(L + 2) // S`` units, the first ``(L + 2) % S`` stages one more; the embedding is the first unit of
    stage 0 and the head the last unit of the last stage.  None where that rule has no cut: fewer
    units than stages, or no cut between the embedding (head) and the layers when a stage would hold
    only the embedding (head).

    ``layer_end_segment[l]``: the segment that ends right after layer l.
    ``embed_end_segment``: the segment that ends right before the first layer (-1 if none).
    """
    L = len(layer_end_segment)
    if n_stages == 1:
        return [n_segments - 1]
    per, extra = divmod(L + 2, n_stages)
    if L == 0 or per < 1:
        return None
    bounds, used = [], 0
    for s in range(n_stages - 1):
        used += per + (1 if s < extra else 0) - (1 if s == 0 else 0)   # stage 0's first unit: the embedding
        bounds.append(layer_end_segment[used - 1] if used > 0 else embed_end_segment)
    bounds.append(n_segments - 1)
    ok = bounds[0] >= 0 and all(a < b for a, b in zip(bounds, bounds[1:]))
    return bounds if ok else None


def equal_block_bounds(layer_end_segment: Sequence[int], n_segments: int, n_stages: int) -> list[int] | None:
    """The hand split most pipeline examples use (torch.distributed.pipelining's ViT/GPT tutorials): the
    L layers in equal runs of L / S, the embedding with the first run, the head with the last.  None
    when L does not divide by S."""
    L = len(layer_end_segment)
    if L == 0 or L % n_stages:
        return None
    per = L // n_stages
    return [layer_end_segment[(s + 1) * per - 1] for s in range(n_stages - 1)] + [n_segments - 1]


def rank_balanced_bounds(bounds: Sequence[int], seg_time: Sequence[float], out_time: Sequence[float],
                         stage_rank: Sequence[int], feasible: Callable[[int, int, int], bool] | None = None,
                         seg_params: Sequence[int] | None = None, max_shift: int = 3) -> list[int]:
    """``bounds`` with cuts moved until the busiest *rank* is as light as local moves make it.

    Where a rank holds several stages (interleaved: stages r, r + p, ...; ZB-V: stages r and 2p-1-r),
    a step is as long as the rank with the most work, not the slowest stage: the min-max stage cut can
    leave rank 0 of a V (embedding and head stages) several percent busier than the others.  An exact
    DP would carry every rank's running sum in its state, so this is a descent from the stage-balanced
    cut instead: each round tries moving every cut by up to ``max_shift`` segments either way and keeps
    the best move, while it lowers (stages without parameters, the busiest rank's load, the slowest
    stage, the sum of squared stage costs), in that order; at most ``4 S`` rounds.  Where the result
    has a stage ``feasible(stage, first_seg, last_seg)`` refuses (e.g. over the memory budget), the
    stage cut ``bounds`` is returned as it is: the descent itself ignores ``feasible``, so that its
    result depends on the costs alone and the strategy search can reuse it across configurations.

    ``stage_rank[s]``: the pipeline rank holding stage s.  With one stage per rank it returns ``bounds``.
    """
    start = list(bounds)
    S, K = len(start), len(seg_time)
    if len(set(stage_rank)) == S:
        return start
    # Every candidate of a round is keyed at once with numpy, by the same float operations in the same
    # order as a Python loop over the stages would (np.add.accumulate adds left to right), and the first
    # candidate in (cut, shift) order reaching the least key is taken: the plain loop's choice.
    prefix = np.array([0.0, *accumulate(seg_time)])
    out = np.array([*out_time[:K - 1], 0.0])                 # nothing is sent after the last segment
    params = np.array([0, *accumulate(seg_params)]) if seg_params is not None else None
    n_ranks = max(stage_rank) + 1
    held = [[s for s in range(S) if stage_rank[s] == r] for r in range(n_ranks)]

    def keys(cuts: np.ndarray) -> list[tuple]:
        """(stages without parameters, busiest rank's load, slowest stage, sum of squared stage costs) per
        row of ``cuts`` (candidates x S last segments)."""
        firsts = np.concatenate([np.zeros((len(cuts), 1), dtype=cuts.dtype), cuts[:, :-1] + 1], axis=1)
        costs = prefix[cuts + 1] - prefix[firsts] + out[cuts]
        empty = (params[cuts + 1] == params[firsts]).sum(axis=1) if params is not None else np.zeros(len(cuts), int)
        loads = np.stack([np.add.accumulate(costs[:, h], axis=1)[:, -1] if h else np.zeros(len(cuts))
                          for h in held], axis=1)
        squares = np.add.accumulate(costs * costs, axis=1)[:, -1]
        return list(zip(empty.tolist(), loads.max(axis=1).tolist(), costs.max(axis=1).tolist(), squares.tolist()))

    cut, best = list(start), keys(np.array([start]))[0]
    for _ in range(4 * S):                       # each round strictly improves the key: no cycle
        moved, to = [], []                       # candidate c: ``cut`` with cut[moved[c]] = to[c]
        for i in range(S - 1):                   # the last bound is the graph's end
            lo, hi = (cut[i - 1] + 1 if i else 0), cut[i + 1] - 1
            for new in range(max(lo, cut[i] - max_shift), min(hi, cut[i] + max_shift) + 1):
                if new != cut[i]:
                    moved.append(i)
                    to.append(new)
        if not moved:
            break
        # the candidates as one array (rows of ``cut``, one entry changed each), in (cut, shift) order
        candidates = np.tile(np.array(cut), (len(moved), 1))
        candidates[np.arange(len(moved)), moved] = to
        ranked = keys(candidates)
        k = min(range(len(ranked)), key=ranked.__getitem__)     # the first of the least keys
        if not ranked[k] < best:
            break
        cut, best = candidates[k].tolist(), ranked[k]
    return cut if cut_fits(cut, feasible) else start


def cut_fits(bounds: Sequence[int], feasible: Callable[[int, int, int], bool] | None) -> bool:
    """Does every stage of ``bounds`` pass ``feasible(stage, first_seg, last_seg)`` (None: no limit)?"""
    return feasible is None or all(feasible(s, a + 1, b) for s, (a, b) in enumerate(zip([-1, *bounds], bounds)))
