"""One tensor-parallel layout's graph, priced at any microbatch size without tracing again.

Terms:
  layout   -- (tp, tp_mode, sequence_parallel): what the graph looks like on tp rank 0 (the tp rewrite).
              Traced, shape-propagated and rewritten once per layout, as ``autosplit.compile`` does, from
              the stable passes (trace, MetaShapeProp, the sharding engine: shard_1d, shard_grid), priced
              at 2 units (as compile prices its layout); 2D and 2.5D linears use the all-gather form (the
              search passes tp_2d_form="allgather").
  unit     -- the smallest microbatch the layout admits: a grid mode's row split (2D q over tp_row, 2.5D
              d * q, 3D q * q: autosplit/tp/axes.py ``batch_ways``),
              else 1.  Microbatch sizes are multiples of it.
  rescale  -- every shape and integer a node computes is affine in the microbatch size b (the batch dim
              scales, nothing else does), so two shape propagations (b = 2 unit, 3 unit) give every
              node's value at any b: ``at(b)`` rewrites ``meta['val']`` with meta tensors of the
              extrapolated shapes instead of running the graph again (~20x faster), then the cost model
              annotates it exactly as compile does.  A value that is not affine (a shape that does not
              scale linearly) makes ``at`` fall back to a real propagation at b.
              ``tests/test_search.py`` checks it against a fresh trace at other sizes.
  segment costs -- ``autosplit.segment_costs.SegmentCosts`` of the rescaled graph, per recompute mode.
  cp       -- a context-parallel layout (cp >= 2, 1D tensor parallelism over tp >= 1 inside it): the
              graph rewritten by passes/sharding/context.py ``shard_context`` as compile's TensorParallel
              pass rewrites it (at the plan's microbatch size, priced at 2 rows: one graph per distinct
              rewrite, ``ContextLayout``; rescaled to other sizes as any layout).  Its ``tp``
              is the block, cp * tp ranks (what compile prices as the tensor-parallel group: the
              collectives, core sharing, the dp group's stride), ``cp`` and ``tp_inner`` the axes;
              every node's value is tp rank 0's and cp rank 0's (its share of the tokens), so the
              activation bytes and times priced from it are a cp rank's.
  autocast -- torch.bfloat16 / torch.float16: after every shape propagation the graph gets the dtypes
              torch.autocast gives on the profile's device (passes/autocast_prop.py, as compile's
              AutocastDtypeProp after its local shape propagation), so both recorded sizes carry them and
              every rescaled value keeps them: GEMMs at the half-precision rate, activations, saved
              bytes, tp collectives and pipeline boundaries in the dtype autocast gives.  The sharding
              engine still chooses on the float32 graph, as compile's TensorParallel pass does.
"""
from __future__ import annotations

import copy

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from autosplit.cost_model.flops import node_cost
from autosplit.cost_model.profiles import get_profile
from autosplit.errors import AutosplitError
from autosplit.passes.autocast_prop import AutocastDtypeProp
from autosplit.passes.batch_norm import fewest_rows, find_batch_norms, one_row_refusal
from autosplit.passes.check_output import check_single_output
from autosplit.passes.cut_points import find_cuts
from autosplit.passes.repeats import Repeats, expand
from autosplit.passes.shape_prop import MetaShapeProp
from autosplit.passes.split_backward import weight_gemm_nodes
from autosplit.passes.decompose_attention import decompose_attention
from autosplit.passes.sharding.context import shard_context
from autosplit.passes.sharding.grid import shard_grid
from autosplit.passes.tensor_parallel import layout_vals
from autosplit.passes.sharding.megatron import shard_1d
from autosplit.strategy.floors import at_size, node_table, time_floor
from autosplit.tp.axes import GRID_MODES, batch_ways, tp_axes
from autosplit.trace import kept_module_state, trace


try:
    # The search only propagates and prices its graphs (fx.Interpreter reads the graph, never the
    # generated forward): torch's lazy GraphModule skips generating Python code for 2000-node graphs
    # until something calls forward (a tenth of a layout's rewrite).
    from torch.fx._lazy_graph_module import _LazyGraphModule as _GraphModule
except ImportError:             # a torch without it: the eager one
    _GraphModule = fx.GraphModule


def _with_batch(inputs: tuple[torch.Tensor, ...], b: int) -> tuple[torch.Tensor, ...]:
    """The example inputs with batch dim b, on the meta device."""
    return tuple(torch.empty((b, *x.shape[1:]), dtype=x.dtype, device="meta") for x in inputs)


class _Tensor(tuple):
    """A recorded tensor leaf: (shape, stride, dtype); strides matter (a reshape of a transposed
    tensor copies, of a contiguous one it is a free view)."""


def _leaves(val) -> tuple[list, object]:
    leaves, spec = tree_flatten(val)
    return [_Tensor((tuple(x.shape), tuple(x.stride()), x.dtype)) if isinstance(x, torch.Tensor) else x
            for x in leaves], spec


class LayoutGraph:
    """The rank-0 graph of one layout, rescalable to any microbatch size (see the module docstring)."""

    def __init__(self, traced: fx.GraphModule, inputs: tuple[torch.Tensor, ...], tp: int, tp_mode: str,
                 sequence_parallel: bool, profile="h100", tp_depth: int | None = None, repeats: Repeats | None = None,
                 autocast: torch.dtype | None = None, cp: int = 1, rows: int = 2, rewritten: tuple | None = None):
        """``traced``: ``trace_model``'s graph, shared by every layout (each works on a copy); ``profile``
        prices the sharding engine's candidates (compile's ``device``); ``tp_depth``: 2.5D's d;
        ``repeats``: ``traced`` reduced to four of its identical layers (passes/repeats.py): the rewrite
        works on it and copies the rest, or rewrites ``traced`` where the layers came out different
        (``tp_plan`` is then the reduced graph's plan: the search prices graphs, it builds no modules);
        ``autocast``: the half dtype the job trains in, or None (float32; module docstring); ``cp``: the
        context-parallel ranks (see *cp*), 1D tensor parallelism over ``tp`` inside them, rewritten on the
        graph at ``rows`` rows (the plan's microbatch size: ``context_rewrite``); ``rewritten``:
        ``context_rewrite``'s result for this layout, where the caller already has it (``ContextLayout``)."""
        self.inputs, self.profile, self.autocast = inputs, get_profile(profile), autocast
        self.cp, self.tp_inner, self.rows = cp, tp, rows
        self.tp = tp * cp                   # the block: what compile prices as tp (mesh.block)
        grid = tp_mode in GRID_MODES and tp > 1
        self.axes = tp_axes(tp_mode, tp, tp_depth) if grid else ()
        self.unit = batch_ways(self.axes) if grid else 1
        # one rewrite serves every size: the rewrites write head, token and feature counts into the graph,
        # never a microbatch's rows (a grid's row gathers leave their size out: lower.py ``grid_rows``);
        # the second size is a shape propagation (sizes >= 2: a size-1 dim's stride is arbitrary).  A cp
        # rewrite is rescaled the same way, but made at the size it serves (``context_rewrite``)
        reduced = repeats is not None and self.tp > 1
        if rewritten is not None:
            gm, self.tp_plan = rewritten
        else:
            gm, self.tp_plan = self._build(repeats.graph if reduced else traced, 2 * self.unit, tp, tp_mode,
                                           sequence_parallel)
        self._cast(gm, 2 * self.unit)
        earlier = {n: n.meta.get("val") for n in gm.graph.nodes}
        self._propagate(gm, 3 * self.unit, earlier)
        self.expanded = False           # layers put back as copies of a rewritten one (passes/repeats.py)
        origin: dict = {}               # a copied node -> its source in the rewritten graph
        if reduced:
            out = expand(gm, repeats, earlier)
            if out is None:             # the rewrite treated identical layers differently: the whole graph
                gm, self.tp_plan = self._build(traced, 2 * self.unit, tp, tp_mode, sequence_parallel)
                self._cast(gm, 2 * self.unit)
                earlier = {n: n.meta.get("val") for n in gm.graph.nodes}
                self._propagate(gm, 3 * self.unit, earlier)
            else:
                graph, root, origin = out
                gm = _GraphModule(root, graph, type(traced).__name__)
                self.expanded = True
        self.gm, self.origin = gm, origin
        self.nodes = list(gm.graph.nodes)
        pairs = {}                      # a copied layer's leaves are its source's (passes/repeats.py)
        for n in self.nodes:
            source = origin.get(n, n)
            if source not in pairs:
                pairs[source] = (_leaves(earlier[source]), _leaves(source.meta.get("val")))
        self._affine = [pairs[origin.get(n, n)] for n in self.nodes]
        self.gemms = set(weight_gemm_nodes(self.gm))
        self.param_users, self.param_names, self.param_bytes = _parameter_owners(self.gm, self.nodes)
        self.b = None
        self.unknown_ops: list[str] = []
        self._sizes: dict[int, tuple] = {}  # b -> (vals, costs, cuts, unknown ops): ``at`` of a size seen before

    def _cast(self, gm: fx.GraphModule, b: int) -> None:
        """The dtypes autocast gives, on ``gm`` propagated at b rows (nothing without autocast)."""
        if self.autocast is not None:
            AutocastDtypeProp(_with_batch(self.inputs, b), self.autocast, self.profile.device_type)(gm)

    def _propagate(self, gm: fx.GraphModule, b: int, cast: dict | None = None) -> None:
        """Shapes (and autocast's dtypes) of ``gm`` at b rows; ``cast``: node -> its value at another size
        already under autocast, whose dtypes are taken (autocast's dtype of an op does not depend on the
        rows, and a second run on fake tensors costs as much as the first)."""
        MetaShapeProp(_with_batch(self.inputs, b))(gm)
        if self.autocast is None:
            return
        if cast is None:
            self._cast(gm, b)
            return
        for n in gm.graph.nodes:
            n.meta["val"] = _dtypes_of(n.meta.get("val"), cast.get(n))

    def _build(self, traced, b, tp, tp_mode, sp):
        if self.cp > 1:
            return context_rewrite(traced, self.inputs, self.cp, tp, self.profile, self.rows)
        gm = _copy_at(traced, self.inputs, b)
        if tp == 1:
            return gm, None
        decompose_attention(gm)     # as compile's TensorParallel pass does: nn.MultiheadAttention as its ops
        if self.axes:           # built at 2 units only: priced there, as compile prices a layout
            plan = shard_grid(gm, tp_mode, self.axes, self.profile, lambda node, x, w: "allgather")
        else:
            plan = shard_1d(gm, tp, self.profile, sp)
        gm = _GraphModule(plan.local_root(0, gm.graph), gm.graph, type(gm).__name__)
        MetaShapeProp(_with_batch(self.inputs, b))(gm)
        return gm, plan

    def floors(self, b: int, profile, ways: int = 1) -> tuple[float, float, float]:
        """(seconds, saved bytes, parameter bytes) of one microbatch of b through the whole graph: a lower
        bound of its compute time (floors.py: the roofline compile prices, without recomputation and
        tp collectives; ``ways`` > 1: of any layout splitting each op at most that many ways) and its
        exact saved activations; affine in b, from the graph at 2 unit and 3 unit (read once)."""
        if not hasattr(self, "_floors"):
            tables, saved = [], []
            for size in (2 * self.unit, 3 * self.unit):
                self.at(size)
                tables.append(node_table(self.nodes, profile))
                saved.append(sum(n.meta["cost"].saved_bytes for n in self.nodes))
            self._floors = tables, saved, sum(n.meta["cost"].param_bytes for n in self.nodes), {}
        (one, two), (s2, s3), params, times = self._floors
        k = b // self.unit - 2
        if (b, ways) not in times:
            times[b, ways] = time_floor(at_size(one, two, k), profile, ways)
        return times[b, ways], s2 + k * (s3 - s2), params

    def at(self, b: int) -> fx.GraphModule:
        """The graph with every node's ``val`` and ``cost`` at microbatch size b (shapes of tp rank 0)."""
        if b == self.b:
            return self.gm
        if b % self.unit:
            raise AutosplitError(f"microbatch size {b} does not divide by the {self.unit} ways the grid splits rows")
        if b in self._sizes:                      # this size again (the search's groups of several sizes take
            vals, costs, self.cuts, self.unknown_ops = self._sizes[b]       # turns): put its values back
            for n, val, cost in zip(self.nodes, vals, costs):
                n.meta["val"], n.meta["cost"] = val, cost
            self.b = b
            return self.gm
        k = b // self.unit - 2                    # b = unit * (2 + k): value = first + k * (second - first)
        origin = self.origin                      # a copied layer's node: its source's value and cost
        try:
            for n, ((one, spec), (two, _)) in zip(self.nodes, self._affine):
                source = origin.get(n)            # (sources come first: layer 1 precedes its copies)
                n.meta["val"] = (source.meta["val"] if source is not None else
                                 tree_unflatten([_extrapolate(x, y, k) for x, y in zip(one, two)], spec))
        except _NotAffine:
            self._propagate(self.gm, b)
        unknown: set[str] = set()       # AnnotateCosts' node_cost; a copy's is its source's (same op, shapes)
        for n in self.nodes:
            source = origin.get(n)
            n.meta["cost"] = source.meta["cost"] if source is not None else node_cost(n, self.gm, unknown)
        self.unknown_ops = sorted(unknown)
        self.b = b
        self.cuts = find_cuts(self.gm)
        self._sizes[b] = ([n.meta["val"] for n in self.nodes], [n.meta["cost"] for n in self.nodes], self.cuts,
                          self.unknown_ops)
        return self.gm


def _copy_at(traced: fx.GraphModule, inputs, b: int) -> fx.GraphModule:
    """A copy of ``traced`` with its values at b rows (the shared trace is propagated once per b)."""
    gm = _GraphModule(traced, copy.deepcopy(traced.graph), type(traced).__name__)
    if getattr(traced, "propagated_at", {}).get(b) is not None:
        for n, val in zip(gm.graph.nodes, traced.propagated_at[b]):
            n.meta["val"] = val
    else:
        MetaShapeProp(_with_batch(inputs, b))(gm)
        traced.__dict__.setdefault("propagated_at", {})[b] = [n.meta["val"] for n in gm.graph.nodes]
    return gm


def context_rewrite(traced: fx.GraphModule, inputs, cp: int, tp: int, profile, rows: int = 2,
                    propagate: bool = True):
    """(local graph, plan): ``traced`` (the trace or its reduced form) rewritten for cp x tp as
    compile's TensorParallel pass rewrites it (passes/sharding/context.py ``shard_context``): on the
    graph at ``rows`` rows, priced at 2 rows (tensor_parallel.py ``layout_vals``), each attention's cp
    lowering chosen by cost (compile's default ``cp_attention="auto"``).

    ``rows``: the plan's microbatch size.  The cp rewrite does not depend on the priced values alone:
    which dims of the graph at ``rows`` rows divide by cp, and which lead a merged dim (a size-1 batch
    leaf leads nothing), decide what can be split (samvit's window rows stay split inside one rank at
    1 row, not at 2), so the search rewrites at the size compile rewrites at.  ``propagate``: the local
    graph's values at 2 rows (what LayoutGraph starts from); False leaves them stale (a signature needs
    none)."""
    gm = _copy_at(traced, inputs, rows)
    decompose_attention(gm)
    price_vals = None
    if rows != 2:       # layout_vals: the same values (by name) at every size, so computed once per graph
        cache = traced.__dict__.setdefault("_cp_price_vals", {})
        if "vals" not in cache:
            cache["vals"] = layout_vals(gm, _with_batch(inputs, rows), 1)
        price_vals = cache["vals"]
    plan = shard_context(gm, cp, tp, profile, price_vals=price_vals, attention="auto")
    gm = _GraphModule(plan.local_root(0, gm.graph), gm.graph, type(gm).__name__)
    if propagate:
        MetaShapeProp(_with_batch(inputs, 2))(gm)
    return gm, plan


def rewrite_signature(gm: fx.GraphModule) -> tuple:
    """What tells two rewrites of one layout apart: the local graph's code and its parameters' and
    buffers' shapes (``ContextLayout`` keeps one graph per distinct signature)."""
    return (gm.code, tuple((name, tuple(t.shape)) for name, t in gm.named_parameters()),
            tuple((name, tuple(t.shape)) for name, t in gm.named_buffers()))


def _parameter_owners(gm: fx.GraphModule, nodes: list[fx.Node]):
    """What compile's stage assignment and SplitStages need, as node indices: (index, user indices) of
    the parameter reads and what is computed from parameters alone, last first (each goes to its first
    user's stage); (index, parameter names) of every node that uses parameters; bytes per name."""
    index = {n: k for k, n in enumerate(nodes)}
    from_params, users = set(), []
    for n in nodes:
        if n.op == "get_attr" or (n.op == "call_function" and n.all_input_nodes
                                  and all(a in from_params for a in n.all_input_nodes)):
            from_params.add(n)
    for n in reversed(nodes):
        if n in from_params and n.users:
            users.append((index[n], [index[u] for u in n.users]))
    params = dict(gm.named_parameters())
    names = []
    for k, n in enumerate(nodes):
        if n.op == "call_module":
            used = [f"{n.target}.{name}" for name, _ in gm.get_submodule(n.target).named_parameters()]
        elif n.op == "get_attr" and n.target in params:
            used = [n.target]
        else:
            continue
        names.append((k, used))
    return users, names, {name: p.numel() * p.element_size() for name, p in params.items()}


# Rows trace_model propagates: a batch-statistics layer that sees one value per channel per row (a
# BatchNorm1d on (B, C) features) still sees 2, where torch refuses 1 (passes/batch_norm.py).
TRACE_ROWS = 2


def trace_model(model, inputs: tuple[torch.Tensor, ...], leaf_modules=(), concrete_args=None) -> fx.GraphModule:
    """The model traced once (train and eval mode, as compile does), refused as compile refuses it, its
    shapes propagated at TRACE_ROWS rows (only the inputs' per-sample shapes and dtypes are used)."""
    gm = trace(model, len(inputs), leaf_modules=leaf_modules, concrete_args=concrete_args, example_inputs=inputs)
    with kept_module_state(model):      # a leaf's forward may keep a meta tensor on itself (trace.ModuleState)
        MetaShapeProp(_with_batch(inputs, TRACE_ROWS))(gm)
    check_single_output(gm)
    return gm


def fewest_microbatch_rows(traced: fx.GraphModule) -> tuple[int, str | None]:
    """The fewest rows a microbatch of the model may have, from ``trace_model``'s graph: 2 where a
    batch-statistics layer would see one value per channel in one row, else 1 (passes/batch_norm.py
    ``fewest_rows``); and why not 1, naming the layer with its arithmetic (None where 1 will do)."""
    rows, layer = fewest_rows(find_batch_norms(traced), TRACE_ROWS)
    return rows, (one_row_refusal(layer, TRACE_ROWS) if layer is not None else None)


def _dtypes_of(val, other):
    """``val`` with each tensor leaf in the dtype of ``other``'s leaf at the same place (same structure)."""
    leaves, spec = tree_flatten(val)
    theirs, _ = tree_flatten(other)
    if len(theirs) != len(leaves):
        return val
    return tree_unflatten([torch.empty_strided(x.shape, x.stride(), dtype=y.dtype, device="meta")
                           if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype != y.dtype else x
                           for x, y in zip(leaves, theirs)], spec)


class _NotAffine(Exception):
    pass


def _extrapolate(one, two, k: int):
    if isinstance(one, _Tensor):
        shape, stride = ([_scale(x, y, k) for x, y in zip(one[i], two[i])] for i in (0, 1))
        return torch.empty_strided(shape, stride, dtype=one[2], device="meta")
    if isinstance(one, int) and not isinstance(one, bool):
        return _scale(one, two, k)
    if isinstance(one, torch.Size):
        return torch.Size(_scale(x, y, k) for x, y in zip(one, two))
    if one is not two and one != two:
        raise _NotAffine
    return one


def _scale(x, y, k: int):
    if not (isinstance(x, int) and isinstance(y, int)):
        raise _NotAffine
    value = x + k * (y - x)
    if value < 0:
        raise _NotAffine
    return value


class _Unbuilt:
    """Bounds of a layout not rewritten yet, from the single-device graph ``base``: floors.py's split
    floor of its compute and saved activations over the ``tp`` ranks of a block, of its parameters over
    ``param_ways`` (the ranks that split them), and ``base``'s cut positions."""

    base: LayoutGraph
    tp: int
    param_ways: int

    @property
    def cuts(self):
        return self.base.cuts

    def floors(self, b: int, profile) -> tuple[float, float, float]:
        t, saved, params = self.base.floors(b, profile, ways=self.tp)
        return t, saved / self.tp, params / self.param_ways


class DeferredLayout(_Unbuilt):
    """A grid layout's LayoutGraph, built when a configuration of it is first priced (search.py, step 4).

    Rewriting a graph for 2.5D or 3D costs seconds (three engine programs, one over pairs), and most of
    the grid layouts of a search are pruned by the time bound before any is priced; until then this
    stands in with bounds that hold for any layout of ``tp`` ranks, from the single-device graph
    ``base``: floors.py's split floor of its compute, saved activations and parameters over tp (a rank
    does at least its share of the work and holds at least its share of the state; replicated ops and
    gathered copies only add), and ``base``'s cut positions (the exact count is checked once built)."""

    def __init__(self, build, tp: int, unit: int, base: LayoutGraph):
        self._build, self.tp, self.unit, self.base = build, tp, unit, base
        self.param_ways = tp
        self.graph: LayoutGraph | None = None
        self.error: str | None = None

    def refusal(self, rows: int) -> str | None:
        return self.error

    def resolve(self, rows: int | None = None) -> LayoutGraph | None:
        """The built graph (once: one rewrite serves every microbatch size; ``rows`` is
        ``ContextLayout``'s), or None with ``refusal(rows)`` the rewrite's refusal."""
        if self.graph is None and self.error is None:
            try:
                self.graph = self._build()
                self.graph.at(2 * self.graph.unit)
            except AutosplitError as exc:
                self.error = str(exc).splitlines()[0]
        return self.graph


class ContextLayout(_Unbuilt):
    """A cp layout's LayoutGraphs (cp x tp, 1D inside; see the module docstring's *cp*), built when a
    configuration of it is first priced (search.py, step 4), one per microbatch size b it is priced at.

    compile rewrites for cp on the graph at the plan's b rows (which can change the rewrite:
    ``context_rewrite``), and without the microbatch count (passes/sharding/context.py), so the graph of
    b is that rewrite.  Rewrites that come out the same (``rewrite_signature`` of the rewritten reduced
    graph; the usual case) share one LayoutGraph, so the shape propagations, the layer copies and the
    group costs are paid once; a further b costs one rewrite of the reduced graph.

    Until built, bounds that hold for any layout of its cp * tp ranks, as ``DeferredLayout``'s: the
    split floor of the single-device graph ``base`` (each op's FLOPs and bytes split at most cp * tp
    ways: cp splits the tokens, padding and gathered keys only add), its saved activations over
    cp * tp, its parameters over tp (whole on every cp rank).

    ``failures``: (cp, tp, message) of the rewrites refused so far, shared by a search's cp layouts: a
    layout whose cp and tp are multiples of a refused one's is refused as it was (as the search inherits
    a tp refusal by multiples of tp), at every b."""

    unit = 1

    def __init__(self, traced: fx.GraphModule, inputs, cp: int, tp: int, profile, repeats: Repeats | None,
                 autocast, base: LayoutGraph, failures: list | None = None):
        self.traced, self.inputs, self.profile, self.repeats, self.autocast = traced, inputs, profile, repeats, autocast
        self.cp, self.tp_inner, self.tp, self.base = cp, tp, cp * tp, base
        self.param_ways = tp                # parameters whole on every cp rank
        self.failures = failures if failures is not None else []
        self.graphs: dict[int, LayoutGraph | None] = {}     # b -> its graph (None: refused)
        self.errors: dict[int, str] = {}
        self._by_signature: dict[tuple, LayoutGraph] = {}

    @property
    def error(self) -> str | None:
        return next(iter(self.errors.values()), None)

    def refusal(self, rows: int) -> str | None:
        return self.errors.get(rows)

    def resolve(self, rows: int = 2) -> LayoutGraph | None:
        """The graph of plans of ``rows`` rows a microbatch (built once per distinct rewrite), or None with
        ``refusal(rows)`` the rewrite's refusal."""
        if rows in self.graphs:
            return self.graphs[rows]
        known = next(((c, t, msg) for c, t, msg in self.failures if self.cp % c == 0 and self.tp_inner % t == 0), None)
        if known is not None:
            c, t, msg = known
            self.errors[rows] = msg if (c, t) == (self.cp, self.tp_inner) else f"as for cp={c}, tp={t} (divisors): {msg}"
            self.graphs[rows] = None
            return None
        source = self.repeats.graph if self.repeats is not None else self.traced
        try:
            rewritten = context_rewrite(source, self.inputs, self.cp, self.tp_inner, self.profile, rows,
                                        propagate=False)
            key = rewrite_signature(rewritten[0])
            graph = self._by_signature.get(key)
            if graph is None:
                MetaShapeProp(_with_batch(self.inputs, 2))(rewritten[0])
                graph = LayoutGraph(self.traced, self.inputs, self.tp_inner, "1d", False, self.profile,
                                    repeats=self.repeats, autocast=self.autocast, cp=self.cp, rows=rows,
                                    rewritten=rewritten)
                graph.at(2)
                self._by_signature[key] = graph
        except AutosplitError as exc:
            self.errors[rows] = str(exc).splitlines()[0]
            self.failures.append((self.cp, self.tp_inner, self.errors[rows]))
            graph = None
        self.graphs[rows] = graph
        return graph
