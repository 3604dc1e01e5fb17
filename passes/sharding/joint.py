"""One integer program over two mesh axes at once: every node picks a pair of strategies.

Terms (strategy, transition: strategies.py; Problem, split dims: engine.py):
  pair      -- (option on axis a, option on axis b) of one node, kept only when the two split different
               tensor dims of every tensor the node reads and writes, and do not sum over one class
               (3D's cube: the axes tp_y and tp_z take a linear's input and output roles, never both the
               same one).
  price     -- compute: the op's time over the ranks both options split it on (the one-axis prices
               are base / n_a and base / n_b: their product over base).  A transition on one axis moves a
               tensor the other axis may already split, so it is priced at 1 / n_other of its bytes.
  why joint -- solved one after the other, the first axis would pick its layout blind to the second:
               column-parallel everywhere (each linear gathering its input), leaving the second only
               what is left.  The pair program finds the alternation a cube needs (a linear's output
               axis is the next one's input axis) because it prices both collectives of every edge.

  nesting   -- a dim split over both axes holds the first axis's parts outermost (nesting.py): an edge
               whose chain of collectives would break that (a split added outside another axis's, an
               outer part gathered while an inner axis still splits the dim) is left out.

The program is solve.py's, over pairs: its size is the product of the two axes' option counts per
node, and of the pair counts per edge.
"""
from __future__ import annotations

import torch.fx as fx

from autosplit.passes.sharding import nesting
from autosplit.passes.sharding.engine import Sharding, analyse, split_dims, take
from autosplit.passes.sharding.solve import solve
from autosplit.passes.sharding.strategies import R


def analyse_pair(gm: fx.GraphModule, axes: tuple[int, int], profile, base: Sharding, strides=(1, 1),
                 **kw) -> tuple[Sharding, Sharding]:
    """The Shardings of two axes of the sizes ``axes``, chosen together (module docstring).

    Args:
        gm: the traced graph with global shapes.
        axes: (ranks on the first axis, ranks on the second).
        profile: the DeviceProfile the costs are priced with.
        base: an earlier axis's Sharding of ``gm`` (its factors and op rules are shared).
        strides: how far apart each axis's ranks sit (engine.py ``analyse``).
        kw: ``analyse``'s candidate arguments (allowed_fn, must_split_fn, must_split_weights, grid,
            partial_linears, price_vals), the same for both axes.
    """
    (sa, pa), (sb, pb) = (analyse(gm, n, profile, base=base, defer=True, stride=st, **kw)
                          for n, st in zip(axes, strides))
    na, nb = axes
    pairs = []                                             # per node: [(option a, option b)]
    costs = []
    for i in range(len(pa.costs)):
        v = pa.order[i] if i < len(pa.order) else None
        opts = []
        for a in range(len(pa.costs[i])):
            for b in range(len(pb.costs[i])):
                if v is None or _compatible(sa, sb, v, a, b):
                    opts.append((a, b))
        pairs.append(opts)
        whole = pa.costs[i][0]                             # option 0 is Replicate: the op's whole time
        costs.append([pa.costs[i][a] * pb.costs[i][b] / whole if whole > 0 else pa.costs[i][a] + pb.costs[i][b]
                      for a, b in opts])
    edges = []
    for ea, eb, read in zip(pa.edges, pb.edges, pa.reads, strict=True):
        (p, c, ta), (p2, c2, tb) = ea[:3], eb[:3]
        ka, kb = (ea[3] if len(ea) > 3 else {}), (eb[3] if len(eb) > 3 else {})
        assert (p, c) == (p2, c2), "the two axes' programs list their edges in one order"
        split_a = _splits(sa, pa, p)
        split_b = _splits(sb, pb, p)
        joint, keys = {}, {}
        for x, (a1, b1) in enumerate(pairs[p]):
            for y, (a2, b2) in enumerate(pairs[c]):
                t, u = ta.get((a1, a2)), tb.get((b1, b2))
                if t is not None and u is not None and not _nests_wrong(sa, sb, base, pa.order[p], read, a1, a2,
                                                                        b1, b2):
                    joint[(x, y)] = t / (nb if split_b[b1] else 1) + u / (na if split_a[a1] else 1)
                    # one producer's collectives on both axes, as lowered (solve.py *shared*): shared where
                    # both axes' are (a free move shares trivially)
                    key = (ka.get((a1, a2)) if t else "free", kb.get((b1, b2)) if u else "free")
                    if None not in key:
                        keys[(x, y)] = key
        edges.append((p, c, joint, keys))
    must = [_lift(group, pairs, 0) for group in pa.must] + [_lift(group, pairs, 1) for group in pb.must]
    picks = solve(costs, edges, [g for g in must if g])
    take(sa, pa, [pairs[i][k][0] for i, k in enumerate(picks)])
    take(sb, pb, [pairs[i][k][1] for i, k in enumerate(picks)])
    return sa, sb


def _compatible(sa: Sharding, sb: Sharding, v: fx.Node, a: int, b: int) -> bool:
    s, t = sa.nodes[v].options[a], sb.nodes[v].options[b]
    if s.cls is None or t.cls is None:
        return True
    return not split_dims(sa.enum, sa.nodes[v].rule, s) & split_dims(sb.enum, sb.nodes[v].rule, t)


def _nests_wrong(sa: Sharding, sb: Sharding, base: Sharding | None, p: fx.Node, read, a1: int, a2: int,
                 b1: int, b2: int) -> bool:
    """Would the lowering's chain of this edge break the nesting (nesting.py ``fault``): over the base
    axis (fixed already), then the first, then the second?"""
    if read is None:
        return False
    v, k = read
    states = [(_state(sa, v, k, sa.nodes[p].options[a1].out), _state(sa, v, k, sa.nodes[v].options[a2].ins[k])),
              (_state(sb, v, k, sb.nodes[p].options[b1].out), _state(sb, v, k, sb.nodes[v].options[b2].ins[k]))]
    if base is not None and p.op != "get_attr" and v in base.chosen:     # (parameters: stored, gathered first)
        states.insert(0, (_state(base, v, k, base.place(p)), _state(base, v, k, base.chosen[v].ins[k])))
    return nesting.fault(states) is not None


def _state(sh: Sharding, v: fx.Node, k: int, place):
    """``place`` of ``v``'s operand ``k`` as nesting.py reads it."""
    return nesting.state(place, sh.enum, sh.nodes[v].rule.operands[k][1], (id(sh), place))


def _splits(sh: Sharding, pr, i: int) -> list[bool]:
    """Per option of program node ``i``: does its output differ across the axis's ranks?"""
    if i >= len(pr.order):
        return [False]
    return [s.out != R for s in sh.nodes[pr.order[i]].options]


def _lift(group: list, pairs: list, side: int) -> list:
    """A required group of one axis's options as the pairs that contain them."""
    want = set(group)
    return [(i, k) for i in {i for i, _ in group} for k, pair in enumerate(pairs[i]) if (i, pair[side]) in want]
