"""Choose one strategy per node: the plan of least predicted time, as an integer program.

Terms (strategy, transition: strategies.py):
  x[v, s]   -- 1 when node v runs strategy s (binary; one per node).
  z[e, a, b] -- 1 when edge e's producer runs a and its consumer b (continuous in [0, 1]: the
               equalities below make it the product x[p, a] * x[c, b] at any integer x).  Only pairs
               with a possible transition exist, so an impossible pair is excluded, not penalised.
  objective -- sum of compute(v, s) x[v, s] + sum of transition(e, a, b) z[e, a, b].
  shared    -- y[p, a, key] (continuous in [0, 1]): the lowering inserts one collective per producer p,
               its place a and the place its consumers need (lower.py ``transition`` caches it by that
               key), so edges whose pairs carry the same key pay its time once, on y, with y >= z for
               each of them (y is their OR at any integer x).  Priced per edge instead, a tensor read by
               three split projections (q, k, v) paid its collective three times.
  memory    -- optionally, sum of bytes(v, s) x[v, s] <= budget: what a rank keeps (tp_mode="auto").
  ties      -- plans of equal time (an all-to-all before or after a permute of the same bytes): each
               collective costs TIE seconds more per node index of its producer, so the program puts
               collectives at the earliest of equal-priced places.  The difference between two such
               places is local (their distance in the node order), so identical layers break the tie
               alike (the strategy search copies one rewritten layer: passes/repeats.py ``expand``),
               which the solver's own choice between tied optima did not.  1e-11 s a node: 1e-7 s over
               a 10,000-node graph, below any difference the cost model resolves.
  must      -- options the caller requires one of (tp_mode="1d": a Linear's weight is split when any
               rule can split it; Megatron's contract): a penalty above any plan's time on the others,
               so a requirement no plan can meet (a split no consumer can take) is given up alone,
               not with every other one.

Why an integer program and not a DP over the chain of blocks: a ViT's graph is a chain of blocks, but a
block is not a chain (the residual forks), and models pass tensors past blocks (eva02's rotary table
feeds every block); the program is exact on any DAG.  This is meta-pytorch/autoparallel's formulation
(per-edge pair variables, the marginal equalities), solved with scipy's HiGHS (``scipy.optimize.milp``):
the well-kept open solver, already a wheel on every platform torch has, unlike PuLP's CBC binary.
"""
from __future__ import annotations

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from autosplit.errors import PlanError

TIE = 1e-11         # seconds per node index of a collective's producer (*ties*)


def solve(nodes: list, edges: list, must: list[list[tuple[int, int]]] = (), memory: tuple | None = None) -> list[int]:
    """Chosen option index per node.

    Args:
        nodes: per node, the compute cost of each option (seconds).
        edges: (producer index, consumer index, {(a, b): seconds}[, {(a, b): key}]) for every tensor
            edge; pairs missing from the dict are impossible; pairs of one producer's edges with equal
            keys at the same producer option share one collective (*shared*).
        must: groups of (node index, option index); one of each group's options is chosen wherever
            some plan allows it.
        memory: (per node, the bytes each option keeps on a rank; the budget), or None.  Raises
            Infeasible when no plan fits.
    """
    offset, nvar = [], 0
    for costs in nodes:
        offset.append(nvar)
        nvar += len(costs)
    cost = [c for costs in nodes for c in costs]
    rows, cols, vals, lo, hi = [], [], [], [], []
    row = 0

    def add(entries, low, high):
        nonlocal row
        for col, v in entries:
            rows.append(row)
            cols.append(col)
            vals.append(v)
        lo.append(low)
        hi.append(high)
        row += 1

    for v, costs in enumerate(nodes):
        add([(offset[v] + s, 1.0) for s in range(len(costs))], 1.0, 1.0)
    moves = sum(max(edge[2].values(), default=0.0) for edge in edges)
    penalty = 1e3 * (sum(max(c) for c in nodes) + moves + 1.0)   # above any plan's time: a violation never pays
    for group in must:
        allowed = {(v, s) for v, s in group}
        for v in {v for v, _ in group}:
            for s in range(len(nodes[v])):
                if (v, s) not in allowed:
                    cost[offset[v] + s] += penalty
    if memory is not None:
        per_node, budget = memory
        add([(offset[v] + k, float(b)) for v, opts in enumerate(per_node) for k, b in enumerate(opts) if b],
            -np.inf, float(budget))
    z_first = nvar
    shared: dict[tuple, list] = {}                # (producer, its option, key) -> [(z, seconds)]
    for edge in edges:
        p, c, pairs = edge[:3]
        keys = edge[3] if len(edge) > 3 else {}
        by_a: dict[int, list[int]] = {a: [] for a in range(len(nodes[p]))}
        by_b: dict[int, list[int]] = {b: [] for b in range(len(nodes[c]))}
        for (a, b), t in pairs.items():
            by_a[a].append(nvar)
            by_b[b].append(nvar)
            if t > 0:
                t += TIE * p                    # *ties*: of equal-priced plans, collectives earliest
            key = keys.get((a, b))
            if key is not None and t > 0:
                shared.setdefault((p, a, key), []).append((nvar, t))
                cost.append(0.0)
            else:
                cost.append(t)
            nvar += 1
        for a, zs in by_a.items():
            add([(z, 1.0) for z in zs] + [(offset[p] + a, -1.0)], 0.0, 0.0)
        for b, zs in by_b.items():
            add([(z, 1.0) for z in zs] + [(offset[c] + b, -1.0)], 0.0, 0.0)
    for zs in shared.values():                   # y >= z of every edge sharing the collective
        y = nvar
        cost.append(max(t for _, t in zs))
        nvar += 1
        for z, _ in zs:
            add([(z, 1.0), (y, -1.0)], -np.inf, 0.0)
    a = coo_matrix((vals, (rows, cols)), shape=(row, nvar)).tocsr()
    integrality = np.zeros(nvar)
    integrality[:z_first] = 1
    # microseconds: HiGHS's tolerances suit O(1) coefficients; solved to optimality (no relative gap), so
    # that *ties* decide between equal-priced plans, not where the branch and bound stopped
    res = milp(np.asarray(cost) * 1e6, constraints=LinearConstraint(a, lo, hi), integrality=integrality,
               bounds=Bounds(0, 1), options={"mip_rel_gap": 0.0})
    if res.x is None:
        raise Infeasible(f"the sharding engine's program has no solution ({res.message}); this is an autosplit "
                         f"bug unless a memory budget was given")
    x = res.x
    return [int(np.argmax(x[offset[v]:offset[v] + len(costs)])) for v, costs in enumerate(nodes)]


class Infeasible(PlanError):
    """No assignment meets the constraints: the memory budget (the requirements are penalties, and every
    node keeps a Replicate option whose edges are always possible)."""
