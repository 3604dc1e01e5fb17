"""The sharding engine over one mesh axis: layouts for every node, strategies, the cheapest choice.

Terms: factors.py (factor, class, layout), rules.py (OpRule), strategies.py (place, strategy,
transition), solve.py (the integer program).
  Sharding    -- the engine's answer: per node its OpRule, its options and the chosen one; per edge the
                 transition the lowering must insert.  Pure data: no graph is changed here.
  priced at   -- the shapes the candidates are priced with: a plan's layout is chosen once for a model and
                 mesh, at the smallest microbatch the layout admits (2 rows, or 2q under 2D), whatever
                 microbatch size the plan runs; the strategy search prices one layout for every size,
                 and a plan at any size then has the layout the search priced.
  size read   -- a non-tensor read of a tensor: ``x.size(d)``, ``x.shape[i]``, ``x.numel()``, its rank,
                 dtype or device, or the whole ``x.shape`` as a view's size (``y.reshape(x.shape)``).  The lowering makes the sizes global; any other Python value read
                 from a tensor (``x.tolist()``, the whole ``x.shape`` handed on) needs it Replicate.
"""
from __future__ import annotations

import copy as copy_module
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autosplit.errors import rule_failure
from autosplit.passes.op_dims import shape_index, whole_shape
from autosplit.passes.op_names import inplace_base, op_name
from autosplit.passes.op_registry import functional_linear, op
from autosplit.passes.sharding.factors import Factors
from autosplit.passes.sharding.rules import Rules, tensorish
from autosplit.passes.sharding.solve import Infeasible, solve
from autosplit.tp.ops import is_key_copy
from autosplit.passes.sharding.strategies import P, R, Enumerator, NodeStrategies, Strategy, edge_bytes, operand_bytes

_SIZE_READS = ("shape", "count", "rank")      # registry kinds: size(), numel(), dim()
_SAME_ON_SHARDS = ("ndim", "dtype", "device", "is_cuda", "requires_grad")


@dataclass
class Sharding:
    gm: fx.GraphModule
    n: int
    factors: Factors
    nodes: dict[fx.Node, NodeStrategies]
    chosen: dict[fx.Node, Strategy] = field(default_factory=dict)
    enum: Enumerator | None = None
    notes: list[str] = field(default_factory=list)
    cost: float = 0.0
    memory: float = 0.0                 # bytes a rank keeps under the choice (strategies.py ``_priced``)
    price_vals: dict | None = None      # the values the candidates were priced with ("priced at")
    table: dict = field(default_factory=dict, repr=False)   # node -> OpRule (rules.py), every node

    def place(self, node: fx.Node):
        s = self.chosen.get(node)
        return s.out if s is not None else R

    def where(self, node: fx.Node, layout=None):
        """(tensor dim, leaf, leads) of ``node``'s split, or None when it is not Shard."""
        place = self.place(node)
        if not isinstance(place, tuple):
            return None
        lay = layout if layout is not None else self.nodes[node].rule.out
        return self.enum.where(lay, place[1]) if not isinstance(lay, tuple) else None


def _reads(n: fx.Node, gm) -> tuple[str | None, dict]:
    """Python values non-tensor readers take from ``n``: (why a shard would get one wrong, or None;
    {dim: why} for the dims a slice of its shape reads, whose sizes a shard of that dim would make
    local).  Sizes read one by one, rank, dtype and device are fine (the lowering globalizes sizes)."""
    ndim = n.meta["val"].dim() if isinstance(n.meta.get("val"), torch.Tensor) else 0
    sliced: dict = {}
    for u in n.users:
        if tensorish(u) or u.op == "output":
            continue
        if whole_shape(u):
            for w in u.users:
                dims = shape_index(w, ndim)
                if isinstance(dims, list):
                    for d in dims:
                        sliced.setdefault(d, f"'{w.name}' reads a slice of its shape that includes dim {d}")
                elif dims is None and not _view_size(w, u):
                    return (f"'{w.name}' ({op_name(w, gm)}) uses its whole shape (read by '{u.name}'): a "
                            f"shard's sizes would be the local ones"), {}
            continue
        kind = op(u, gm).kind
        if kind not in _SIZE_READS and not (kind == "attr" and u.args[1] in _SAME_ON_SHARDS):
            return f"'{u.name}' ({op_name(u, gm)}) reads a Python value from it", {}
    return None, sliced


def _view_size(w: fx.Node, shape: fx.Node) -> bool:
    """Is ``shape`` (a whole ``x.shape``) only the size argument of the view ``w`` (``y.reshape(x.shape)``)?
    The lowering spells it out dim by dim, so each size is read and written like any other."""
    return w.op == "call_method" and op(w).lower == "sizes" and tuple(w.args[1:]) == (shape,) and not w.kwargs


def priced_at(gm: fx.GraphModule, inputs: tuple) -> dict:
    """node name -> its value with the model inputs ``inputs`` (meta tensors): the shapes a plan is
    priced at, so that one choice serves every microbatch size (module docstring, "priced at")."""
    from autosplit.passes.shape_prop import MetaShapeProp
    copy = fx.GraphModule(gm, copy_module.deepcopy(gm.graph), type(gm).__name__)
    MetaShapeProp(inputs)(copy)
    return {v.name: v.meta.get("val") for v in copy.graph.nodes}


@contextmanager
def priced(gm: fx.GraphModule, vals: dict | None):
    """Nodes carry ``vals`` (by name) instead of their own values inside the block."""
    if not vals:
        yield
        return
    own = {v: v.meta.get("val") for v in gm.graph.nodes}
    try:
        for v in gm.graph.nodes:
            if v.name in vals:
                v.meta["val"] = vals[v.name]
        yield
    finally:
        for v, val in own.items():
            v.meta["val"] = val


def analyse(gm: fx.GraphModule, n: int, profile, allowed_fn=None, must_split_weights: bool = False,
            padded_fn=None, must_split_fn=None, price_vals: dict | None = None, grid: bool = False,
            memory_budget: float | None = None, microbatches: int = 1, base: Sharding | None = None,
            partial_linears: bool | None = None, defer: bool = False, stride: int = 1, split_params: bool = True,
            all_to_all: bool = False, must_options_fn=None):
    """Plan the split of every node of ``gm`` (requires meta['val']) over one axis of ``n`` ranks.

    Args:
        gm: the traced graph with global shapes.
        n: ranks on the axis.
        profile: the DeviceProfile the costs are priced with.
        allowed_fn: fn(Sharding, rules) -> set of class roots that may be split, or None for any.
        padded_fn: fn(Sharding, rules) -> classes that may be split with padding where n does not
            divide them (sequence parallelism's tokens).
        must_split_fn: fn(Sharding, rules) -> classes that every node able to split them must run
            split (on them or otherwise): sequence parallelism's tokens, split wherever an op allows.
        price_vals: node name -> value to price the candidates with (``priced_at``); default: the
            graph's own shapes.
        grid: the axis is one of a grid mode's (strategies.py ``Enumerator.grid``).
        base: an earlier axis's Sharding of the same graph: its factors and op rules are reused, so
            that classes mean the same on both axes.
        partial_linears: may a linear give a Partial sum (strategies.py); default: not under ``grid``.
        defer: return (the Sharding with its candidates, its ``Problem``) unsolved, for a program over
            several axes at once (joint.py).
        stride: the axis's ranks sit this far apart in the tp group (a grid's outer axis): its
            collectives are priced over the nodes they span.
        split_params: may a parameter be stored split over the axis (False: cp, whose parameters are
            replicated and their gradients summed with the dp buckets).
        all_to_all: may a tensor move from one split dim to another (strategies.py *transition*).
        must_options_fn: fn(Sharding, rules) -> {node: predicate(Strategy) -> bool}: each node runs one
            of the options its predicate accepts, where any does (context.py's forced attention lowering).
        microbatches: per step (a whole weight's partial gradient is summed once per step).
        memory_budget: bytes one rank may keep (parameters with their gradients and Adam moments,
            saved activations); None: no limit.  A budget no plan meets is noted and dropped.
        must_split_weights: require a split of every Linear weight that some strategy splits.
    """
    if base is not None:
        f, table = base.factors, base.table
    else:
        f, table = Factors(), {}
        rules = Rules(gm, f)
        for node in gm.graph.nodes:
            try:
                table[node] = r = rules.rule(node)
            except Exception as exc:        # noqa: BLE001  (a rule of ours failed: name the op it was reading)
                raise rule_failure("the sharding engine's op rules", node, exc) from exc
            if r.out is not None:
                rules.layouts[node] = r.out
    sh = Sharding(gm, n, f, {}, price_vals=price_vals, table=table)
    allowed = allowed_fn(sh, table) if allowed_fn is not None else None
    padded = padded_fn(sh, table) if padded_fn is not None else ()
    sh.enum = enum = Enumerator(gm, f, table, n, profile, allowed, padded, grid, microbatches, partial_linears,
                                stride, split_params, all_to_all)
    order = [v for v in gm.graph.nodes if table[v].out is not None]
    with priced(gm, price_vals):
        problem = _problem(sh, enum, table, order, must_split_weights, must_split_fn, memory_budget)
    if must_options_fn is not None:
        for v, accept in must_options_fn(sh, table).items():
            opts = [i for i, s in enumerate(sh.nodes[v].options) if accept(s)] if v in sh.nodes else []
            if opts:
                problem.must.append([(problem.index[v], i) for i in opts])
    if defer:
        return sh, problem
    return _choose(sh, problem, memory_budget)


@dataclass
class Problem:
    """The integer program of one axis (solve.py's arguments): nodes in ``order`` (then the model
    output's pseudo-nodes), their options' costs, the edges' transitions, the required groups."""
    order: list
    index: dict
    costs: list
    edges: list
    must: list
    memory: tuple | None = None
    reads: list = field(default_factory=list)   # per edge: (consumer, operand index), None for the output


def _problem(sh: Sharding, enum: Enumerator, table: dict, order: list, must_split_weights: bool,
             must_split_fn, memory_budget: float | None) -> Problem:
    gm = sh.gm
    for v in order:
        try:
            sh.nodes[v] = enum.strategies(v)
        except Exception as exc:        # noqa: BLE001
            raise rule_failure("the sharding engine's strategies", v, exc) from exc
    for v in order:                     # Python values read from a tensor: no shard where they would be local
        whole, sliced = _reads(v, gm)
        if whole is None and not sliced:
            continue
        ns = sh.nodes[v]
        split_dim = lambda s: (sh.enum.where(ns.rule.out, s.out[1]) or (None,))[0]   # noqa: E731
        keep = [i for i, s in enumerate(ns.options)
                if not isinstance(s.out, tuple) or (whole is None and split_dim(s) not in (None, *sliced))]
        if len(keep) < len(ns.options):
            _keep(ns, keep)
            ns.why_whole = whole or "; ".join(sliced.values())
    index = {v: i for i, v in enumerate(order)}
    costs = [sh.nodes[v].compute for v in order]
    edges, reads = [], []
    for v in order:
        try:
            found = _edges(sh, enum, index, v)
        except Exception as exc:        # noqa: BLE001
            raise rule_failure("the sharding engine's redistributions", v, exc) from exc
        edges += [(e[0], e[1], e[2], e[4]) for e in found]
        reads += [(v, e[3]) for e in found]
    out_node = next(v for v in gm.graph.nodes if v.op == "output")
    for p in out_node.all_input_nodes:  # the model's output is whole on every rank
        if p in index:
            costs.append([0.0])
            moves = {a: enum.transition(p, s.out, R, sh.nodes[p].rule.out, operand_bytes(p), False)
                     for a, s in enumerate(sh.nodes[p].options)}
            edges.append((index[p], len(costs) - 1, {(a, 0): t for a, t in moves.items() if t is not None}))
            reads.append(None)
    must = _weight_groups(sh, order, index) if must_split_weights else []
    if must_split_fn is not None:
        classes = must_split_fn(sh, table)
        for v in order:
            opts = sh.nodes[v].options
            if any(s.cls in classes and isinstance(s.out, tuple) for s in opts):
                must.append([(index[v], i) for i, s in enumerate(opts) if s.out != R])
    memory = None
    if memory_budget is not None:
        memory = ([sh.nodes[v].memory for v in order] + [[0.0]] * (len(costs) - len(order)), memory_budget)
    return Problem(order, index, costs, edges, must, memory, reads)


def _choose(sh: Sharding, pr: Problem, memory_budget: float | None) -> Sharding:
    try:
        picks = solve(pr.costs, pr.edges, pr.must, pr.memory)
    except Infeasible:
        if pr.memory is None:
            raise
        least = sum(min(sh.nodes[v].memory) for v in pr.order)
        sh.notes.append(f"no layout fits the memory budget of {_mib(memory_budget)} per rank (the least this "
                        f"model keeps, every node split as far as it can be, is {_mib(least)}); planned for time "
                        f"alone")
        picks = solve(pr.costs, pr.edges, pr.must)
    return take(sh, pr, picks)


def take(sh: Sharding, pr: Problem, picks: list[int]) -> Sharding:
    """``sh`` with the option ``picks[i]`` chosen for node ``pr.order[i]``."""
    sh.memory = sum(sh.nodes[v].memory[picks[pr.index[v]]] for v in pr.order)
    for v in pr.order:
        sh.chosen[v] = sh.nodes[v].options[picks[pr.index[v]]]
        sh.cost += sh.nodes[v].compute[picks[pr.index[v]]]
    return sh


def split_dims(enum: Enumerator, rule, s: Strategy) -> set:
    """(operand index or "out", tensor dim) for each tensor ``s`` splits, a class it contracts over as
    ("sum", class) (two axes summing over one class would be one split of it).  A tuple's elements are
    named by the class alone."""
    out = set()
    for k, place in [*enumerate(s.ins), ("out", s.out)]:
        lay = rule.out if k == "out" else rule.operands[k][1]
        if isinstance(place, tuple):
            w = enum.where(lay, place[1]) if not isinstance(lay, tuple) else None
            out.add((k, w[0]) if w is not None else (k, "cls", place[1]))
    if s.out == P and s.cls is not None:
        out.add(("sum", s.cls))
    return out


def _keep(ns, keep: list[int]) -> None:
    """Only the options ``keep`` (indices) of ``ns`` stay candidates."""
    ns.options = [ns.options[i] for i in keep]
    ns.compute = [ns.compute[i] for i in keep]
    ns.memory = [ns.memory[i] for i in keep]


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _edges(sh: Sharding, enum: Enumerator, index: dict, v: fx.Node) -> list:
    """(producer, consumer, {(option a, option b): seconds}, operand index, {(a, b): shared key}) for each
    tensor operand of ``v``; a pair missing from the dict is impossible.  The key names the collective
    the lowering inserts (lower.py ``transition``: one per producer, place needed and, for a whole
    operand, whether its consumer runs split), so that consumers needing the same one pay it once
    (solve.py *shared*): q, k and v projections of one input share its copy."""
    ns, edges = sh.nodes[v], []
    writes = inplace_base(v, sh.gm) is not None
    key_copy = is_key_copy(v)                  # context.py's key copy
    for k, (p, lay) in enumerate(ns.rule.operands):
        if p not in index:
            continue
        element = isinstance(p.meta.get("val"), (tuple, list))
        alias = any(u is not v for u in p.users)
        nbytes = edge_bytes(p, v)
        pairs, keys = {}, {}
        for a, sa in enumerate(sh.nodes[p].options):
            for b, sb in enumerate(ns.options):
                if element and sa.out != sb.ins[k]:
                    continue                # a tuple is redistributed element by element, after getitem
                if sa.pending_bias and not element and sb.ins[k] != R and sb.ins[k] == sa.out:
                    continue                # a sum still without its bias cannot flow on as Partial
                if writes and k == 0 and alias and (sa.out != sb.ins[0] or (sa.out == R and sb.sharded)):
                    continue                # the write must reach p's other readers: no redistributed copy
                # (with no other reader, the lowering makes the op out of place on the redistributed copy)
                # a key copy runs whole but passes its readers' parts of the gradient on (context.py):
                # the gather before it reduce-scatters them, as before a split consumer
                t = enum.transition(p, sa.out, sb.ins[k], lay, nbytes, sb.sharded or key_copy)
                if t is not None:
                    pairs[(a, b)] = t
                    keys[(a, b)] = (sb.ins[k], sb.sharded if sb.ins[k] == R else None, nbytes)
        edges.append((index[p], index[v], pairs, k, keys))
    return edges


SMALL_WEIGHT = 16     # a Linear weight this many times smaller than the largest is split only where it pays


def _weight_groups(sh: Sharding, order, index) -> list:
    """For each Linear (module or ``F.linear`` of a parameter), the options that split its weight.

    Weights under 1/SMALL_WEIGHT of the model's largest Linear weight are left to the cost alone:
    cait's talking-heads projections (heads x heads) split only by gathering the attention scores
    around them, which costs far more than their few parameters save."""
    found = []
    for v in order:
        ns = sh.nodes[v]
        if ns.rule.kind == "linear":
            opts = [(index[v], i) for i, s in enumerate(ns.options) if dict(s.params).get("weight") is not None]
            numel = sh.gm.get_submodule(v.target).weight.numel()
        elif ns.rule.kind == "op" and functional_linear(v) and len(ns.rule.operands) > 1 and \
                ns.rule.operands[1][0].op == "get_attr":
            # F.linear of a parameter: split where it is used (a weight stored split, then gathered
            # for a whole GEMM, splits nothing)
            opts = [(index[v], i) for i, s in enumerate(ns.options) if isinstance(s.ins[1], tuple)]
            numel = ns.rule.operands[1][0].meta["val"].numel()
        else:
            continue
        found.append((numel, opts))
    largest = max((numel for numel, _ in found), default=0)
    return [opts for numel, opts in found if opts and numel * SMALL_WEIGHT >= largest]
