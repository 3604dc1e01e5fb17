"""Lower the engine's choice to a per-rank graph: collectives, local shards, local sizes; one axis or several.

Terms (place, strategy, transition: strategies.py; Sharding: engine.py; TensorParallelPlan: tp_plan.py):
  axes       -- the tp mesh axes, each with its own Sharding, outermost first ("tp"; "tp_row",
                "tp_col"; autosplit/tp/axes.py).  An operand that changes place on several axes gets
                one collective per axis, chained (``chain``).  Placements on different dims commute; a
                dim split over several axes holds its parts nested in axis order (the first axis
                outermost, DeviceMesh's convention: 2.5D's rows over tp_dep, then tp_row).
  transition node -- the collective inserted between a producer and the consumers that need another
                place (autosplit/tp/ops.py): ``copy_to_axis`` (R for a split consumer: identity forward,
                all-reduce of the gradient backward), ``all_reduce`` (P -> R), ``reduce_scatter``
                (P -> S), ``all_gather`` (S -> R for a split consumer: its backward reduce-scatters the
                partial gradients), ``gather`` (S -> R for a whole consumer: backward only slices),
                ``local_slice`` (R -> S: backward all-gathers), ``all_to_all`` (S of one dim -> S of
                another: cp's tokens -> heads, Ulysses; backward the reverse).  One per (axis, producer,
                kind).
  pending bias -- a Linear split by input features gives a Partial sum; its bias is added once, after
                the reduction (Megatron's row-parallel linear).
  local sizes -- the graph keeps the model's global arithmetic: a size read off a split dim
                (``x.size(d)``, ``x.shape[d]``, ``x.numel()``) is multiplied by the axis size where it is
                read, and a size written at a split dim (reshape / view / expand / split) is divided.
  partial grads -- one axis: a whole parameter read by a split strategy gets a partial gradient, summed
                over tp by the runtime once per step.  Several axes (``param_copies``): the runtime's
                sum runs over the whole tp group, which is wrong for a parameter split on one axis and
                whole on another, so the graph reduces instead: ``copy_to_axis`` on the parameter.
  replicated axis -- an axis (cp) whose parameters are never split and whose gradients the runtime sums
                over the axis together with dp (its buckets span dp x cp; runtime/parallel/data_parallel.py):
                a parameter read only by ops split on it, as it is, has a part of its gradient on each
                rank (summed there); one read whole, or sliced, or by split and whole ops alike (copied
                for the split reads), has it whole on each rank: ``plan.whole_grads``, which the buckets
                divide by the axis size too.  No copy in the graph, no once-a-step partial sum.
  stored split -- with several axes, a parameter whose every reader runs split over a ``store`` axis
                is kept split over that axis too and all-gathered at its use (backward: the
                reduce-scatter that sums its gradient over the axis): 2D's q*q-way parameter split.
  grid forms -- 2D and 2.5D (``grid``): a column-split ``F.linear`` whose input is split on its features
                runs as ``linear_2d`` (the input gathered over tp_col, the weight block over tp_row,
                inside the op; or SUMMA).  Grid modes (``stats``): a layer norm over features split on
                one of those axes runs as ``layer_norm_2d``.
  pending bias, several axes -- the bias is brought whole to the axes that sum and to the linear's
                output places on the others (``pending``), and added once the sum is reduced, which is
                the first collective on it.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from autosplit.errors import PlanError, at_node
from autosplit.passes import op_dims as D
from autosplit.passes.op_dims import shape_index, whole_shape
from autosplit.passes.op_names import inplace_base
from autosplit.passes.op_registry import functional_linear, op
from autosplit.passes.sharding import nesting
from autosplit.passes.sharding.factors import index_sets
from autosplit.passes.sharding.strategies import P, R
from autosplit.passes.sharding.tp_plan import fetch
from autosplit.tp import ops as C
from autosplit.tp.local_modules import column_linear, row_linear
from autosplit.tp.shards import RankSlices, ShardedParam



def out_of_place(node: fx.Node) -> None:
    """Turn the in-place op ``node`` into the op it computes (``y.mul_(g)`` -> ``y.mul(g)``).  Only where
    nothing else reads the written tensor (the engine's edges allow a redistributed operand only then)."""
    base = inplace_base(node)
    if node.op == "call_method":
        node.target = base
    elif node.kwargs.get("inplace") is True:
        node.kwargs = {**node.kwargs, "inplace": False}
    elif getattr(node.target, "__module__", None) in ("_operator", "operator"):
        node.target = getattr(operator, base)
    else:
        module = torch.nn.functional if hasattr(torch.nn.functional, base) and \
            getattr(node.target, "__module__", "").startswith("torch.nn.functional") else torch
        node.target = getattr(module, base)


class Lowering:
    """Args:
        shardings: axis name -> the engine's Sharding over it, in the order collectives are applied.
        plan: the TensorParallelPlan to fill (shards, makers, partial grads).
        coords: fn(tp rank) -> {axis: coordinate on it}; default: the one axis's coordinate is the rank.
        store: an axis to store whole parameters split over (2D: "tp_row"), or None.
        grid: (row axis, col axis, form chooser) for 2D's ``linear_2d``, or None.
        stats: the axes whose feature splits a layer norm handles by partial statistics (grid modes).
        replicated: the *replicated axes* (cp).
    """

    def __init__(self, shardings: dict, plan, coords=None, store: str | None = None, grid=None, stats=(),
                 replicated=()):
        self.sh = shardings
        self.axes = list(shardings)
        first = shardings[self.axes[0]]
        self.first, self.plan, self.gm, self.graph = first, plan, first.gm, first.gm.graph
        self.coords = coords or (lambda r: {self.axes[0]: r})
        self.ranks = plan.tp
        self.store, self.grid, self.stats = store, grid, tuple(stats)
        self.pending: dict = {}           # weighted node -> its bias, placed on the axes with no pending sum
        self.rows: dict = {}              # axis -> the classes of the model inputs' rows (``grid_rows``)
        self.replicated = tuple(replicated)
        self.param_copies = len(self.axes) > 1
        self.made: dict = {}              # (axis, source, have, need, kind) -> transition node
        self.spec: dict = {}              # node -> {axis: torch placement}
        self.stored: dict = {}            # param node -> (dim, gather node or None)
        # whole parameters read by split and by whole ops alike: the runtime's once-a-step sum of a
        # partial gradient would count the whole ops' part n times, so their split reads get copies
        self.mixed = {a: {v for v in self.graph.nodes if v.op == "get_attr" and
                          len({self.sh[a].chosen[u].sharded for u in v.users if u in self.sh[a].chosen}) > 1}
                      for a in self.axes}
        self.whole_grads()

    # -- helpers --------------------------------------------------------------------------------
    def n(self, axis) -> int:
        return self.sh[axis].n

    def grid_rows(self, axis, p: fx.Node, have) -> bool:
        """Is ``have`` (a Shard) a split of the model inputs' rows under a grid mode (several axes)?"""
        if not self.param_copies or p.op == "get_attr":
            return False
        if axis not in self.rows:
            f = self.sh[axis].factors
            self.rows[axis] = {f.find(leaf) for r in self.sh[axis].table.values() if r.kind == "input" and r.out
                               for leaf in f.flat(r.out[0])}
        return have[1] in self.rows[axis]

    def axis_meta(self, axis) -> dict:
        """For the cost model (cost_model/comm.py ``collective_time``): the ranks a collective over
        ``axis`` runs on, and how far apart they sit in the tp group (the sizes of the axes inside it:
        tp rank is mixed radix over the axes, the first outermost)."""
        ranks = [a for a, _ in getattr(self.plan, "axes", ())] or self.axes    # the ranks' order (may differ from
        inner = ranks[ranks.index(axis) + 1:]                                    # the nesting order: context.py)
        return {"axis_size": self.n(axis), "axis_stride": math.prod(self.n(b) for b in inner)}

    def whole_grads(self) -> None:
        """``plan.whole_grads``: the parameters whose gradient is whole on every rank of a replicated axis
        (see *replicated axis*), from the engine's choice before anything is lowered."""
        for axis in self.replicated:
            sh = self.sh[axis]
            for v in self.graph.nodes:
                if v.op == "call_module":
                    s = sh.chosen.get(v)
                    if s is None or not s.sharded:           # a module holding parameters, run whole
                        self.plan.whole_grads.update(f"{v.target}.{k}" for k, _ in
                                                     self.gm.get_submodule(v.target).named_parameters())
                if v.op != "get_attr" or not isinstance(fetch(self.gm, v.target), nn.Parameter):
                    continue
                parts = True
                for u in v.users:
                    s = sh.chosen.get(u)
                    ops = sh.nodes[u].rule.operands if u in sh.nodes else []
                    reads = [k for k, (a, _) in enumerate(ops) if a is v]
                    after = s is not None and s.pending_bias and op(u, self.gm).weighted   # bias after a sum
                    if s is None or not s.sharded or \
                            any(s.ins[k] != R or (after and k == 2 and not self._bias_on_rows(axis, u)) for k in reads):
                        parts = False
                if not parts or v in self.mixed[axis]:
                    self.plan.whole_grads.add(v.target)

    def _bias_on_rows(self, axis, u: fx.Node) -> bool:
        """Is the bias ``u`` leaves pending added, for every reader, to a sum scattered over rows or tokens
        (``_add_bias``: each rank adds the whole bias to its own rows, so its gradient is a part)?  Not
        where a reader takes the sum whole or scattered over the features (the bias sliced): there its
        gradient is whole."""
        sh, last = self.sh[axis], u.meta["val"].dim() - 1
        needs = [sh.chosen[c].ins[j] if c in sh.chosen else R for c in u.users
                 for j, (a, _) in (enumerate(sh.nodes[c].rule.operands) if c in sh.nodes else [(0, (u, None))])
                 if a is u]
        for need in needs:
            d = self._dim(axis, u, need) if isinstance(need, tuple) else None
            if d is None or d == last:
                return False
        return bool(needs)

    def keys_partial(self, axis, node) -> bool:
        """Is ``node`` a key copy (passes/sharding/context.py) whose readers all run split on ``axis``?  Its
        value is whole but its gradient a part (each rank's queries' share of dK), so the copy passes the
        part on unsummed, and the gather before it is ``all_gather``, whose backward reduce-scatters the
        parts: one reduce-scatter of dK, not an all-reduce after it and a slice (torchtitan's lowering)."""
        sh = self.sh[axis]
        return C.is_key_copy(node) and bool(node.users) and \
            all(u in sh.chosen and sh.chosen[u].sharded for u in node.users)

    def layout(self, axis, node):
        return self.sh[axis].nodes[node].rule.out if node in self.sh[axis].nodes else None

    def split_dim(self, axis, node):
        w = self.sh[axis].where(node)
        return None if w is None else w[0]

    def indices(self, axis, layout_dim, cls) -> list[torch.Tensor]:
        f, n = self.sh[axis].factors, self.n(axis)
        leaf = next(x for x in f.flat(layout_dim) if f.find(x) == cls)
        return index_sets(f, layout_dim, leaf, n)

    def _new(self, after, fn, args, like, axis, place):
        with self.graph.inserting_after(after):
            node = self.graph.call_function(fn, args)
        node.meta.update(module_path=like.meta.get("module_path", ""), val=like.meta.get("val"),
                         **self.axis_meta(axis))
        self.spec.setdefault(node, {})[axis] = place
        return node

    # -- the pass -------------------------------------------------------------------------------
    def run(self) -> None:
        for node in self.graph.nodes:        # F.linear(input=x, weight=w) -> F.linear(x, w, None)
            if op(node, self.gm).weighted and node.op == "call_function":
                names = ("input", "weight", "bias")
                head = tuple(D.arg(node, i, k) for i, k in enumerate(names))
                node.args = head + tuple(node.args[3:])
                node.kwargs = {k: v for k, v in node.kwargs.items() if k not in names}
        self.plan_storage()
        for node in list(self.graph.nodes):
            if node not in self.first.nodes:
                continue
            with at_node("the sharding engine's lowering", node):
                self.lower_node(node)
        out = next(v for v in self.graph.nodes if v.op == "output")
        for p in list(out.all_input_nodes):
            if p in self.first.nodes:
                src = self.chain(p, {a: R for a in self.axes}, {a: False for a in self.axes})
                if src is not p:
                    out.replace_input_with(p, src)
        for axis in self.axes:
            for node in list(self.graph.nodes):
                self.size_reads(axis, node)
        for node in self.graph.nodes:
            if node.target is C.copy_to_axis and node.users and \
                    all(op(u, self.gm).fresh_grad for u in node.users):
                node.args = (*node.args[:2], True)      # its gradient is its own: summed in place
        for node in self.graph.nodes:
            spec = {}
            for axis in self.axes:
                place = self.spec.get(node, {}).get(axis)
                if place is None and node in self.sh[axis].chosen:
                    s = self.sh[axis].chosen[node].out
                    d = self.split_dim(axis, node)
                    place = Partial() if s == P else Shard(d) if d is not None else Replicate()
                spec[axis] = place or Replicate()
            node.meta["spec"] = spec

    def lower_node(self, node: fx.Node) -> None:
        chosen = {axis: self.sh[axis].chosen[node] for axis in self.axes}
        rule = self.first.nodes[node].rule
        grid2d = self.grid is not None and self._linear_2d(node) and rule.operands[1][0] in self.stored
        entry = op(node, self.gm)
        held = {a for a, c in chosen.items() if c.pending_bias} if entry.weighted and len(rule.operands) > 2 else set()
        for k, (p, _lay) in enumerate(rule.operands):
            if p not in self.first.nodes:
                continue
            skip = set()
            if grid2d:                # linear_2d gathers its input over tp_col and its weight over tp_row
                skip = {self.grid[1]} if k == 0 else {self.grid[0]} if k == 1 else set()
            if held and k == 2:
                # the bias waits for the sum: whole on the axes that sum (the add after the sum slices or
                # copies it there, _add_bias, so those axes' transitions are a whole consumer's), placed
                # on the others
                self.pending[node] = self.chain(p, {a: c.ins[k] for a, c in chosen.items()},
                                                {a: c.sharded and a not in held for a, c in chosen.items()})
                continue
            src = self.chain(p, {a: c.ins[k] for a, c in chosen.items()},
                             {a: c.sharded or self.keys_partial(a, node) for a, c in chosen.items()}, skip=skip)
            if src is not p:
                node.replace_input_with(p, src)
        for axis, s in chosen.items():
            if s.sharded and not self.param_copies and axis not in self.replicated:
                self.plan.partial_grads.update(self._whole_params(axis, node, s))
        s = chosen[self.axes[0]]
        if rule.kind == "linear" and s.params:
            self.linear_module(node, s)
        elif rule.kind == "param" and (any(isinstance(c.out, tuple) for c in chosen.values()) or node in self.stored):
            self.param(node, chosen)
        if any(c.pending_bias for c in chosen.values()) and entry.weighted:
            node.args = node.args[:2] + (None,) + node.args[3:]       # F.linear(x, w, b): b after the sum
        if inplace_base(node, self.gm) is not None and node.args and node.args[0] is not rule.operands[0][0]:
            if rule.kind == "opaque":
                # no rule: its out-of-place name may be no op (x.zero_(), x.fill_(v), x.uniform_()) or
                # another one (x.bernoulli_(p) overwrites x, gradient zero; x.bernoulli(p) has no
                # gradient): it keeps its own op and writes a copy of its redistributed operand
                with self.graph.inserting_before(node):
                    copy = self.graph.call_function(torch.clone, (node.args[0],))
                copy.meta.update(module_path=node.meta.get("module_path", ""), val=node.args[0].meta.get("val"))
                node.args = (copy, *node.args[1:])
            else:
                out_of_place(node)   # its operand was redistributed: the write would land on a copy no one reads
        if entry.lower == "sizes":
            self.spell_sizes(node)
        for axis, c in chosen.items():
            d = self.split_dim(axis, node) if isinstance(c.out, tuple) else None
            if d is not None and entry.lower == "sizes":
                self.local_view(axis, node, d)
            elif d is not None and entry.lower == "unflatten":
                self.local_unflatten(axis, node, d)
            if isinstance(c.out, tuple) and entry.lower == "split" and isinstance(D.arg(node, 1, "split_size"), int):
                src_d = self.sh[axis].where(node.args[0]) if node.args[0] in self.sh[axis].nodes else None
                if src_d is not None and src_d[0] == D.dim(node, 2, "dim", node.args[0].meta["val"].dim()):
                    node.args = (node.args[0], D.arg(node, 1, "split_size") // self.n(axis), *node.args[2:])
        if grid2d:
            self.as_linear_2d(node)
        elif self.stats and entry.lower == "stats":
            self.as_layer_norm_2d(node, chosen)

    def _whole_params(self, axis, node, s) -> list[str]:
        """Whole parameters a split strategy reads: their gradient is partial over the axis."""
        sh = self.sh[axis]
        ops = sh.nodes[node].rule.operands
        after = s.pending_bias and len(ops) > 2 and op(node, self.gm).weighted   # its bias: after the sum
        names = [a.target for k, (a, _) in enumerate(ops)
                 if a.op == "get_attr" and s.ins[k] == R and a in sh.chosen and sh.chosen[a].out == R
                 and isinstance(fetch(self.gm, a.target), nn.Parameter) and not (after and k == 2)
                 and a not in self.mixed[axis]]
        if node.op == "call_module":
            split = {k for k, d in s.params if d is not None}
            module = self.gm.get_submodule(node.target)
            bias_after = s.pending_bias and sh.nodes[node].rule.kind == "linear"
            names += [f"{node.target}.{k}" for k, _ in module.named_parameters()
                      if k not in split and not (bias_after and k == "bias")]
        return names

    # -- transitions ----------------------------------------------------------------------------
    def chain(self, p: fx.Node, needs: dict, sharded: dict, skip=()) -> fx.Node:
        """``p`` in the place ``needs[axis]`` on every axis but ``skip``: one collective per axis that
        changes, in this order (why): first the sums (a Partial reduced before anything moves it, so a
        pending bias meets the linear's own output places); then the gathers, innermost axis first (a
        dim split over several axes is nested in axis order, so only the innermost part can be
        gathered alone); then the new splits, outermost axis first (nesting.py).  A step that breaks
        the nesting (a split outside another axis's split of the dim, a gather of an outer part while an
        inner axis still splits it) would hold blocks the layout does not name: refused."""
        axes = [a for a in self.axes if a not in skip]
        state = {a: self.sh[a].place(p) for a in self.axes}
        states = [(self._state(a, p, state[a]), self._state(a, p, needs[a])) for a in axes]
        steps = [axes[i] for i in nesting.order(states)]
        if p in self.stored and self.store in steps and state[self.store] != P and \
                not (isinstance(state[self.store], tuple) and needs[self.store] != state[self.store]):
            # a stored split is the innermost part of the parameter (``param``): gathered first
            steps.remove(self.store)
            steps.insert(sum(have == P for have, _ in states), self.store)     # after the sums
        checked = [i for i, a in enumerate(axes) if not (p in self.stored and a == self.store)]
        bad = nesting.fault(states, [axes.index(a) for a in steps if axes.index(a) in checked])
        if bad:
            i, d, kind, later = bad
            what = {"split": f"would be split on dim {d} over '{axes[i]}' inside its split over",
                    "gathered": f"would have its split of dim {d} over '{axes[i]}' gathered outside its split over"}
            raise PlanError(f"'{p.name}' {what[kind]} {', '.join(repr(axes[j]) for j in later)}: a dim split over "
                            f"several tp axes must be split outermost axis first and gathered innermost first "
                            f"({' > '.join(self.axes)}); this model's layout on this grid is not supported")
        src = p
        # a pending bias is added once, after the last sum: summed over several axes (cp's rows and tp_1d's
        # features of one row-parallel linear), a bias added after the first would be summed again
        last_sum = next((a for a in reversed(steps) if state[a] == P), None)
        if any(needs[a] == P for a in axes):
            last_sum = None              # (still a partial sum after the chain: no axis adds it yet)
            pending = any(p in self.sh[a].chosen and self.sh[a].chosen[p].pending_bias for a in axes)
            if pending and any(state[a] == P and needs[a] != P for a in axes):
                raise PlanError(f"'{p.name}' would be summed over {', '.join(a for a in axes if state[a] == P and needs[a] != P)} "
                                f"and passed on partial over {', '.join(a for a in axes if needs[a] == P)}, with its bias "
                                f"pending: no sum could add the bias once; this model's layout on this mesh is not "
                                f"supported")
        for axis in steps:
            have, need = state[axis], needs[axis]
            d = self._dim(axis, p, have) if isinstance(have, tuple) else None
            outer = 1                  # the other axes' splits of the dim this gather restores
            for b in self.axes:
                if b != axis and d is not None and isinstance(state[b], tuple) and self._dim(b, p, state[b]) == d:
                    outer *= self.n(b)
            src = self.transition(axis, p, src, need, sharded[axis], outer, bias=axis == last_sum)
            state[axis] = need if not (p in self.stored and axis == self.store) else state[axis]
        return src

    def _state(self, axis, p: fx.Node, place):
        """``place`` of ``p`` as nesting.py reads it."""
        return nesting.state(place, self.sh[axis].enum, self.layout(axis, p), (axis, place))

    def _dim(self, axis, p: fx.Node, place):
        """The tensor dim ``place`` (a Shard) splits of ``p``; None for a tuple's (moved per element)."""
        d = nesting.state(place, self.sh[axis].enum, self.layout(axis, p), None)
        return d if isinstance(d, int) else None

    def transition(self, axis, p: fx.Node, src: fx.Node, need, consumer_sharded: bool, outer: int = 1,
                   bias: bool = True) -> fx.Node:
        """``src`` (``p``, after the earlier axes' transitions) in the place ``need`` on ``axis``;
        ``outer``: how many ways other axes still split the dim a gather restores; ``bias``: a sum adds
        the bias ``p`` left pending (False: another axis's sum comes after it)."""
        if p in self.stored and axis == self.store:
            return self._stored_gather(p, src)
        sh = self.sh[axis]
        have = sh.place(p)
        grads = p.op != "placeholder" and (p.op != "get_attr" or p in self.mixed[axis] or
                                           (self.param_copies and axis not in self.replicated))
        if have == need and not (need == R and consumer_sharded and grads and not self.keys_partial(axis, p)):
            return src
        key = (axis, src, have, need, consumer_sharded if need == R else None, bias)
        if key in self.made:
            return self.made[key]
        n = self.n(axis)
        if have == need:                                          # R for a split consumer
            node = self._new(src, C.copy_to_axis, (src, axis), p, axis, Replicate())
        elif have == P:
            node = self._reduce(axis, p, src, need)
            node = self._add_bias(axis, p, node) if bias else node
            if need == R and consumer_sharded:     # a split consumer's input gradient is a part: sum it
                node = self._new(node, C.copy_to_axis, (node, axis), p, axis, Replicate())
        elif have == R:
            d = sh.enum.where(self.layout(axis, p), need[1])[0]
            node = self._new(src, C.local_slice, (src, d, axis, n), p, axis, Shard(d))
        elif isinstance(need, tuple):                             # another split dim: one all-to-all
            d, at = self.split_dim(axis, p), sh.enum.where(self.layout(axis, p), need[1])[0]
            full = p.meta["val"].shape[d] // outer
            full = None if full % n == 0 else full
            node = self._new(src, C.all_to_all, (src, at, d, axis, n, full), p, axis, Shard(at))
        else:
            d = self.split_dim(axis, p)
            fn = C.all_gather if consumer_sharded else C.gather
            full = p.meta["val"].shape[d] // outer
            # an even split of a grid's rows: no size in the graph (the same graph serves any microbatch)
            full = None if self.grid_rows(axis, p, have) and full % n == 0 else full
            node = self._new(src, fn, (src, d, axis, n, full), p, axis, Replicate())
        self.made[key] = node
        return node

    def _reduce(self, axis, p: fx.Node, src: fx.Node, need) -> fx.Node:
        if need == R:
            if len(src.users) > 1:
                # the all-reduce sums in place (no copy, as Megatron's): another reader of the partial
                # sum (a view of it taken for a second consumer) would see it reduced twice
                src = self._new(src, torch.clone, (src,), p, axis, Partial())
            return self._new(src, C.all_reduce, (src, axis), p, axis, Replicate())
        d = self.sh[axis].enum.where(self.layout(axis, p), need[1])[0]
        return self._new(src, C.reduce_scatter, (src, d, axis, self.n(axis)), p, axis, Shard(d))

    def _add_bias(self, axis, p: fx.Node, reduced: fx.Node) -> fx.Node:
        """``reduced`` plus the bias ``p``'s strategy left pending; the bias as the sum holds it: this
        rank's slice when the sum was scattered over its features (the last dim), whole otherwise.
        The slice's backward all-gathers, so the bias gradient is whole on every rank."""
        sh = self.sh[axis]
        s, rule = sh.chosen[p], sh.nodes[p].rule
        if not s.pending_bias:
            return reduced
        if rule.kind == "linear":
            target = f"{p.target}.bias"
            if fetch(self.gm, target) is None:
                return reduced
            with self.graph.inserting_after(reduced):
                bias = self.graph.get_attr(target)
            bias.meta.update(module_path=p.meta.get("module_path", ""), val=None)
            self.spec[bias] = {axis: Replicate()}
            at = bias                          # created right after the reduced sum
        else:
            bias, at = self.pending.get(p, rule.operands[2][0]), reduced
        raw = rule.operands[2][0] if rule.kind != "linear" else bias
        place, last = self.spec[reduced][axis], reduced.meta["val"].dim() - 1
        if isinstance(place, Shard) and place.dim == last:
            bias = self._new(at, C.local_slice, (bias, 0, axis, self.n(axis)), bias, axis, Shard(0))
            at = bias
        elif isinstance(place, Shard):
            # scattered over rows or tokens: each rank adds the whole bias to its own rows, so its
            # gradient is a part: summed by the runtime once a step (one axis, a parameter), or by a
            # copy in the graph (several axes; or a bias computed in the graph, as beit's
            # cat(q_bias, k_bias, v_bias), whose gradient flows on to the parameters it is made of)
            # (on a replicated axis a bias whose gradient is whole elsewhere (``whole_grads``) is copied too)
            if raw.op != "get_attr" or (self.param_copies and axis not in self.replicated) or \
                    (axis in self.replicated and raw.target in self.plan.whole_grads):
                bias = self._new(at, C.copy_to_axis, (bias, axis), bias, axis, Replicate())
                at = bias      # after the sum (``at``): the add follows it
            elif axis not in self.replicated:          # (on a replicated axis the buckets sum the part)
                self.plan.partial_grads.add(raw.target)
        return self._new(at, operator.add, (reduced, bias), p, axis, place)

    # -- parameters -----------------------------------------------------------------------------
    def plan_storage(self) -> None:
        """Which whole parameters are stored split over the ``store`` axis (module docstring)."""
        if self.store is None:
            return
        sh = self.sh[self.store]
        for node, ns in sh.nodes.items():
            if ns.rule.kind != "param" or not isinstance(fetch(self.gm, node.target), nn.Parameter) or \
                    sh.chosen[node].out != R or not node.users:
                continue
            if not all(u in sh.chosen and sh.chosen[u].sharded for u in node.users):
                continue
            dim = self._store_dim(node)
            if dim is not None:
                self.stored[node] = (dim, None)

    def _store_dim(self, node: fx.Node):
        n = self.n(self.store)
        local = list(node.meta["val"].shape)
        col_dim = None
        for axis in self.axes:
            if axis != self.store and isinstance(self.sh[axis].chosen[node].out, tuple):
                col_dim = self.split_dim(axis, node)
                local[col_dim] //= self.n(axis)
        users = list(node.users)
        if len(users) == 1 and self.grid is not None and functional_linear(users[0]) and \
                users[0].args[1:2] == (node,) and self._linear_2d(users[0]):
            return 1 if local[1] % n == 0 else None                 # linear_2d's weight block
        order = ([col_dim] if col_dim is not None else []) + [d for d in range(len(local)) if d != col_dim]
        return next((d for d in order if local[d] % n == 0 and local[d] >= n), None)

    def _stored_gather(self, p: fx.Node, src: fx.Node) -> fx.Node:
        dim, gathered = self.stored[p]
        if gathered is None:
            full = p.meta["val"].shape[dim]
            for axis in self.axes:
                if axis != self.store and self.split_dim(axis, p) == dim:
                    full //= self.n(axis)
            gathered = self._new(src, C.all_gather, (src, dim, self.store, self.n(self.store), full), p,
                                 self.store, Replicate())
            self.stored[p] = (dim, gathered)
        return gathered

    def param(self, node: fx.Node, chosen: dict) -> None:
        """Record the parameter's shards: per tp rank, the indices it holds along each split dim."""
        shape = tuple(node.meta["val"].shape)
        per_axis = {}
        for axis, s in chosen.items():
            if isinstance(s.out, tuple):
                d = self.split_dim(axis, node)
                per_axis[axis] = (d, self.indices(axis, self.layout(axis, node)[d], s.out[1]))
        if not per_axis and node not in self.stored:
            return
        stored = self.stored[node][0] if node in self.stored else None
        if stored is not None:
            self.spec.setdefault(node, {})[self.store] = Shard(stored)
        whole = torch.arange(shape[stored]) if stored is not None else None   # one for every rank: slices view it

        coords, store, ways = self.coords, self.store, self.n(self.store) if stored is not None else 1

        def slice_of(rank: int) -> dict[int, torch.Tensor]:
            at = coords(rank)
            sl = {d: idx[at[axis]] for axis, (d, idx) in per_axis.items()}
            if stored is not None:
                base = sl.get(stored, whole)
                part = len(base) // ways
                sl[stored] = base[at[store] * part:(at[store] + 1) * part]
            return sl
        slices = RankSlices(self.ranks, slice_of)
        sp = ShardedParam(node.target, shape, slices)
        self.plan.sharded[node.target] = sp
        tensor = fetch(self.gm, node.target)
        self.plan.makers[node.target] = (
            lambda r, sp=sp, t=tensor: nn.Parameter(sp.select(t.detach(), r), requires_grad=t.requires_grad)
            if isinstance(t, nn.Parameter) else sp.select(t, r))

    # -- modules (one axis) -----------------------------------------------------------------------
    def linear_module(self, node: fx.Node, s) -> None:
        axis = self.axes[0]
        lin: nn.Linear = self.gm.get_submodule(node.target)
        w = self.first.nodes[node].rule.params["weight"]
        dims = dict(s.params)
        if dims.get("weight") == 0:
            rows = self.indices(axis, w[0], s.cls)
            self.plan.makers[node.target] = lambda r, lin=lin, rows=rows: column_linear(lin, rows[r])
            self._record(f"{node.target}.weight", 0, lin.weight.shape, rows)
            if lin.bias is not None:
                self._record(f"{node.target}.bias", 0, lin.bias.shape, rows)
        elif dims.get("weight") == 1:
            cols = self.indices(axis, w[1], s.cls)
            self.plan.makers[node.target] = lambda r, lin=lin, cols=cols: row_linear(lin, cols[r])
            self._record(f"{node.target}.weight", 1, lin.weight.shape, cols)

    def _record(self, name, dim, shape, parts) -> None:
        self.plan.sharded[name] = ShardedParam.along(name, dim, tuple(shape), parts)

    # -- 2D grid forms --------------------------------------------------------------------------
    def _linear_2d(self, node: fx.Node) -> bool:
        """A column-split ``F.linear`` of a parameter whose input is split on its features over tp_col."""
        row, col, _ = self.grid
        if not functional_linear(node) or node not in self.sh[col].chosen:
            return False
        s, sh = self.sh[col].chosen[node], self.sh[col]
        rule = sh.nodes[node].rule
        if len(rule.operands) < 2 or rule.operands[1][0].op != "get_attr" or s.ins[1] == R or s.ins[1] == P:
            return False
        if sh.enum.where(rule.operands[1][1], s.ins[1][1])[0] != 0:
            return False
        x = rule.operands[0][0]
        have = sh.place(x)
        w = sh.where(x) if isinstance(have, tuple) else None
        return w is not None and w[0] == x.meta["val"].dim() - 1 and w[2] and s.ins[0] == R

    def as_linear_2d(self, node: fx.Node) -> None:
        row, col, form = self.grid
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        weight = self.first.nodes[node].rule.operands[1][0]
        chosen = form(node, node.args[0].meta["val"], tuple(weight.meta["val"].shape))
        self.plan.forms.append((node.meta.get("module_path") or node.name, chosen))
        args = (x, w, row, col, self.n(col), chosen)
        spans = {"axis_strides": (self.axis_meta(col)["axis_stride"], self.axis_meta(row)["axis_stride"])}
        if bias is None:
            node.target, node.args, node.kwargs = C.linear_2d, args, {}
            node.meta.update(spans)
            return
        # the node itself becomes the bias add, so it stays the one the engine's tables name
        with self.graph.inserting_before(node):
            product = self.graph.call_function(C.linear_2d, args)
        product.meta.update(module_path=node.meta.get("module_path", ""), val=node.meta.get("val"), **spans)
        self.spec[product] = {a: self._place(a, node) for a in self.axes}
        node.target, node.args, node.kwargs = operator.add, (product, bias), {}

    def _place(self, axis, node):
        s = self.sh[axis].chosen[node].out
        d = self.split_dim(axis, node)
        return Partial() if s == P else Shard(d) if d is not None else Replicate()

    def as_layer_norm_2d(self, node: fx.Node, chosen: dict) -> None:
        """A layer norm over features split over a ``stats`` axis: statistics from partial sums."""
        last = node.meta["val"].dim() - 1
        axes = [a for a in self.stats if isinstance(chosen[a].out, tuple) and self.split_dim(a, node) == last]
        if not axes:
            return
        if len(axes) > 1:
            raise PlanError(f"'{node.name}' (layer_norm) has its features split over {axes}: partial statistics "
                            f"over one axis only")
        col = axes[0]
        x = node.args[0]
        shape = D.arg(node, 1, "normalized_shape")
        features = shape if isinstance(shape, int) else shape[-1]
        w, b = D.arg(node, 2, "weight"), D.arg(node, 3, "bias")
        eps = D.arg(node, 4, "eps", 1e-5)
        node.target, node.args, node.kwargs = C.layer_norm_2d, (x, features, w, b, eps, col), {}
        node.meta.update(self.axis_meta(col))

    # -- sizes ----------------------------------------------------------------------------------
    def spell_sizes(self, node: fx.Node) -> None:
        """``y.reshape(x.shape)`` -> ``y.reshape(x.shape[0], ..., x.shape[k])``: each size then is read
        (made global where x is split) and written (made local where the view is split) on its own."""
        if len(node.args) != 2 or not isinstance(node.args[1], fx.Node) or \
                not isinstance(node.args[1].meta.get("val"), torch.Size):
            return
        shape = node.args[1]
        sizes = []
        for i in range(len(shape.meta["val"])):
            with self.graph.inserting_before(node):
                g = self.graph.call_function(operator.getitem, (shape, i))
            g.meta.update(module_path=node.meta.get("module_path", ""), val=shape.meta["val"][i])
            sizes.append(g)
        node.args = (node.args[0], *sizes)

    def local_view(self, axis, node: fx.Node, d: int) -> None:
        packed = len(node.args) == 2 and isinstance(node.args[1], (tuple, list))
        sizes = list(node.args[1] if packed else node.args[1:])
        s, n = sizes[d], self.n(axis)
        # a padded split (the engine passes one through a view only as a dim of its own) holds
        # ceil(full / n) rows on every rank, the last one's padding included
        padded = node.meta["val"].shape[d] % n != 0
        if isinstance(s, int) and s != -1:
            sizes[d] = -(-s // n) if padded else s // n
        elif isinstance(s, fx.Node):
            with self.graph.inserting_before(node):
                sizes[d] = self.graph.call_function(C.local_size if padded else operator.floordiv, (s, n))
            sizes[d].meta.update(module_path=node.meta.get("module_path", ""))
        node.args = (node.args[0], tuple(sizes)) if packed else (node.args[0], *sizes)

    def local_unflatten(self, axis, node: fx.Node, d: int) -> None:
        """``x.unflatten(dim, sizes)``: the size of the split dim among the new ones, divided."""
        ndim = node.args[0].meta["val"].dim()
        at = D.dim(node, 1, "dim", ndim)
        sizes = list(D.arg(node, 2, "sizes"))
        if at <= d < at + len(sizes) and isinstance(sizes[d - at], int) and sizes[d - at] != -1:
            n = self.n(axis)
            sizes[d - at] = -(-sizes[d - at] // n) if sizes[d - at] % n else sizes[d - at] // n
            node.args = (node.args[0], D.arg(node, 1, "dim"), tuple(sizes))
            node.kwargs = {}

    def size_reads(self, axis, node: fx.Node) -> None:
        """Sizes read off a split dim are local at run time: make them global where they are read."""
        place = self.spec.get(node, {}).get(axis)
        sh = self.sh[axis]
        if place is None and node in sh.chosen and isinstance(sh.chosen[node].out, tuple):
            d = self.split_dim(axis, node)
        elif isinstance(place, Shard) and node not in self.stored:
            d = place.dim
        else:
            return
        if d is None or not isinstance(node.meta.get("val"), torch.Tensor):
            return
        ndim, full = node.meta["val"].dim(), node.meta["val"].shape[d]
        n = self.n(axis)
        padded = full % n != 0
        if padded and any(op(u, self.gm).kind == "count" for u in node.users):
            raise PlanError(f"'{node.name}' is split with padding over '{axis}' and its numel() is read: "
                            f"a padded shard cannot give the model's count")
        for u in list(node.users):
            kind = op(u, self.gm).kind
            if whole_shape(u):
                for w in list(u.users):
                    if shape_index(w, ndim) == d:
                        self._globalize(w, n, full if padded else None)
                continue
            at = D.arg(u, 1, "dim") if kind == "shape" else None
            if kind == "count" or (at is not None and D.norm(at, ndim) == d):
                self._globalize(u, n, full if padded else None)

    def _globalize(self, node: fx.Node, n: int, full: int | None) -> None:
        """Every reader of the size ``node`` reads the global one: ``node * n``, or ``full`` for a
        padded split (``global_size``)."""
        with self.graph.inserting_after(node):
            g = self.graph.call_function(operator.mul, (node, n)) if full is None else \
                self.graph.call_function(C.global_size, (node, full))
        g.meta.update(module_path=node.meta.get("module_path", ""))
        node.replace_all_uses_with(g, delete_user_cb=lambda u: u is not g)
