"""Rewrite a traced graph for 1D (Megatron) tensor parallelism: local shards, local shapes, collectives.

Terms:
  spec        -- ``node.meta['spec']``: {"tp": placement} with torch.distributed.tensor's placement types:
                 Replicate(), Shard(dim) (the tensor holds this rank's part along dim), Partial() (each
                 rank holds a summand of the full value).
  redistribution -- a collective node inserted where a consumer needs another placement than its
                 producer gives: Partial -> Replicate is ``all_reduce``; a Replicate activation entering
                 column-parallel layers goes through ``copy_to_axis`` (identity forward, all-reduce of
                 its gradient backward).
  ShardedParam -- a parameter split across tp ranks (autosplit/tp/shards.py): per rank, the indices it
                 keeps along the split dim (fused qkv rows by heads, not contiguous thirds).
  partial grads -- replicated parameters used inside a sharded region (a qk-norm weight): each rank's
                 gradient covers only its heads, so the runtime all-reduces them over tp once per step.
  local root  -- for tp rank t, the modules and parameters the rewritten graph calls, with rank t's
                 shards; ``TensorParallelPlan.local_root(t)`` builds it.

Shape constants are rewritten so that the graph computes with global sizes, as the model's code
expects: ``x.size(d)`` and ``x.shape[d]`` of the split dim and ``x.numel()`` of a split tensor are
multiplied by tp where they are read, and a reshape size for the split dim becomes size // tp (an int is divided in place, a
size node gets a floordiv node).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from autosplit.errors import at_node
from autosplit.passes import op_dims as D
from autosplit.passes.tp_layout import index_set
from autosplit.passes.tp_region_reads import shape_index, whole_shape
from autosplit.passes.tp_regions import Region, find_regions, params_used
from autosplit.tp import ops as C
from autosplit.tp.shards import ShardedParam
from autosplit.tp.local_modules import LocalMultiheadAttention, column_linear, row_linear

AXIS = "tp"
_VIEW_SIZE_ARGS = {"reshape", "view", "expand"}


@dataclass
class TensorParallelPlan:
    tp: int
    root: nn.Module
    sharded: dict[str, ShardedParam] = field(default_factory=dict)
    makers: dict[str, object] = field(default_factory=dict)     # module target -> fn(rank) -> module
    notes: list[str] = field(default_factory=list)
    regions: list[str] = field(default_factory=list)
    partial_grads: set[str] = field(default_factory=set)   # replicated params used inside a region
    forms: list = field(default_factory=list)    # 2D: (layer, "allgather" | "summa") per linear
    _cache: dict = field(default_factory=dict)

    def local_root(self, rank: int, graph: fx.Graph) -> dict:
        """Targets of ``graph`` -> the objects tp rank ``rank`` runs them with."""
        out = {}
        for n in graph.nodes:
            if n.op not in ("call_module", "get_attr"):
                continue
            owner = next((t for t in self.makers if n.target == t or str(n.target).startswith(t + ".")), None)
            if owner is not None:
                key = (owner, rank)
                if key not in self._cache:
                    self._cache[key] = self.makers[owner](rank)
                module = self._cache[key]
                out[n.target] = module if n.target == owner else _fetch(module, n.target[len(owner) + 1:])
            else:
                out[n.target] = _fetch(self.root, n.target)
        return out


def _fetch(root, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _rows(region: Region, entry: fx.Node, tp: int) -> list[torch.Tensor]:
    f = region.factors
    leaves = f.flat(region.layouts[entry][-1])
    shard = next(x for x in leaves if x in region.shard)
    return [index_set(f, leaves, shard, tp, r) for r in range(tp)]


def _cols(region: Region, tp: int) -> list[torch.Tensor]:
    f = region.factors
    leaves = f.flat(region.layouts[region.exit.args[0]][-1])
    shard = next(x for x in leaves if x in region.shard)
    return [index_set(f, leaves, shard, tp, r) for r in range(tp)]


def _insert_copy(graph: fx.Graph, user: fx.Node, arg_index: int, copies: dict) -> None:
    src = user.args[arg_index]
    if src not in copies:
        with graph.inserting_before(user):
            copies[src] = graph.call_function(C.copy_to_axis, (src, AXIS))
        copies[src].meta.update(src.meta)
    args = list(user.args)
    args[arg_index] = copies[src]
    user.args = tuple(args)


def _reduce_after(graph: fx.Graph, node: fx.Node, bias_target: str | None) -> None:
    """node (Partial) -> all_reduce -> + bias; every former user reads the result."""
    with graph.inserting_after(node):
        reduced = graph.call_function(C.all_reduce, (node, AXIS))
    result = reduced
    if bias_target is not None:
        with graph.inserting_after(reduced):
            bias = graph.get_attr(bias_target)
        with graph.inserting_after(bias):
            result = graph.call_function(operator.add, (reduced, bias))
    node.replace_all_uses_with(result, delete_user_cb=lambda u: u is not reduced)
    for n, spec in ((node, Partial()), (reduced, Replicate()), (result, Replicate())):
        n.meta["spec"] = {AXIS: spec}
        n.meta.setdefault("val", node.meta.get("val"))      # global shapes, until shape propagation reruns
    reduced.meta["module_path"] = result.meta["module_path"] = node.meta.get("module_path", "")


def _globalize_reads(graph: fx.Graph, region: Region, tp: int) -> None:
    """``x.size(d)`` and ``x.shape[d]`` (``x.size()[d]``) of the split dim and ``x.numel()`` of a split
    tensor are local at run time: multiply them by tp, so the model's arithmetic sees the sizes it was
    written for (``h / h.size(-1)``); view sizes at the split dim are then divided back
    (``_rewrite_view``).  The region analysis admits no other non-tensor read of a split tensor but
    slices of its shape that miss the split dim, whose sizes are global already
    (passes/tp_region_reads.py)."""
    for n in region.entries + region.nodes:
        d = region.shard_dim(n)
        if d is None:
            continue
        ndim = n.meta["val"].dim()
        for u in list(n.users):
            name = u.target if u.op == "call_method" else getattr(u.target, "__name__", "")
            if whole_shape(u):
                for w in list(u.users):
                    if shape_index(w, ndim) == d:
                        _times(graph, w, tp)
                continue
            size_at = D.arg(u, 1, "dim") if name == "size" else None
            if name == "numel" or (size_at is not None and D.norm(size_at, ndim) == d):
                _times(graph, u, tp)


def _times(graph: fx.Graph, n: fx.Node, k: int) -> None:
    """Every reader of the int ``n`` reads ``n * k`` instead."""
    with graph.inserting_after(n):
        g = graph.call_function(operator.mul, (n, k))
    g.meta.update(module_path=n.meta.get("module_path", ""), spec={AXIS: Replicate()})
    n.replace_all_uses_with(g, delete_user_cb=lambda u: u is not g)


def _rewrite_sizes(graph: fx.Graph, region: Region, tp: int) -> None:
    """Divide by tp every size argument that addresses the split dim (reshape/view/expand/split).
    Sizes in the graph are global (``_globalize_reads``), so a size node is divided like an int."""
    for n in region.nodes:
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
        if name == "split" and isinstance(D.arg(n, 1, "split_size"), int) and \
                region.shard_dim(n.args[0]) == D.dim(n, 2, "dim", n.args[0].meta["val"].dim()):
            n.args = (n.args[0], D.arg(n, 1, "split_size") // tp, *n.args[2:])
            n.kwargs = {k: v for k, v in n.kwargs.items() if k != "split_size"}
        elif name in _VIEW_SIZE_ARGS and region.shard_dim(n) is not None:
            _rewrite_view(graph, n, region.shard_dim(n), tp)


def _rewrite_view(graph: fx.Graph, n: fx.Node, d: int, tp: int) -> None:
    packed = len(n.args) == 2 and isinstance(n.args[1], (tuple, list))
    sizes = list(n.args[1] if packed else n.args[1:])
    s = sizes[d]
    if isinstance(s, int) and s != -1:
        sizes[d] = s // tp
    elif isinstance(s, fx.Node):
        with graph.inserting_before(n):
            sizes[d] = graph.call_function(operator.floordiv, (s, tp))
    n.args = (n.args[0], tuple(sizes)) if packed else (n.args[0], *sizes)


def _shard_region(gm: fx.GraphModule, region: Region, plan: TensorParallelPlan) -> None:
    graph, tp = gm.graph, plan.tp
    copies: dict = {}
    for e in region.entries:
        _insert_copy(graph, e, 0, copies)
        rows = _rows(region, e, tp)
        linear = gm.get_submodule(e.target)
        plan.makers[e.target] = lambda r, lin=linear, rows=rows: column_linear(lin, rows[r])
        plan.sharded[f"{e.target}.weight"] = ShardedParam.along(f"{e.target}.weight", 0, tuple(linear.weight.shape), rows)
        if linear.bias is not None:
            plan.sharded[f"{e.target}.bias"] = ShardedParam.along(f"{e.target}.bias", 0, tuple(linear.bias.shape), rows)
        e.meta["spec"] = {AXIS: Shard(e.meta["val"].dim() - 1)}
    cols = _cols(region, tp)
    linear = gm.get_submodule(region.exit.target)
    plan.makers[region.exit.target] = lambda r, lin=linear: row_linear(lin, cols[r])
    name = f"{region.exit.target}.weight"
    plan.sharded[name] = ShardedParam.along(name, 1, tuple(linear.weight.shape), cols)
    for n in region.nodes:
        d = region.shard_dim(n)
        n.meta["spec"] = {AXIS: Shard(d) if d is not None else Replicate()}
        plan.partial_grads.update(params_used(gm, n))   # whole params seen through a shard: partial
    _globalize_reads(graph, region, tp)
    _rewrite_sizes(graph, region, tp)
    _reduce_after(graph, region.exit, f"{region.exit.target}.bias" if linear.bias is not None else None)
    plan.regions.append(f"{region.name} <- {', '.join(e.meta.get('module_path', e.name) for e in region.entries)}")


def _mha_ok(node: fx.Node, mha: nn.MultiheadAttention) -> str | None:
    if not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.add_zero_attn:
        return "separate k/v widths, bias_k/bias_v or add_zero_attn"
    q, k, v = (node.args + (None, None, None))[:3]
    if not (q is k is v) or any(node.kwargs.get(a) is not None for a in ("attn_mask", "key_padding_mask")):
        return "not plain self-attention (different q/k/v inputs or a mask)"
    if any(u.args[1] != 0 and u.users for u in node.users):
        return "its attention weights are used"
    return None


def _shard_mha(gm: fx.GraphModule, node: fx.Node, plan: TensorParallelPlan) -> None:
    from autosplit.errors import AutosplitError
    mha, tp = gm.get_submodule(node.target), plan.tp
    why = _mha_ok(node, mha)
    if why:
        plan.notes.append(f"'{node.target}' (MultiheadAttention) stays replicated: {why}")
        return
    if mha.num_heads % tp:
        raise AutosplitError(f"layer '{node.target}': {mha.num_heads} attention heads do not divide by tp({tp}); "
                             f"use a tp that divides {mha.num_heads}")
    E, H = mha.embed_dim, mha.num_heads
    D, h = E // H, H // tp
    rows = [torch.arange(3 * E).reshape(3, H, D)[:, r * h:(r + 1) * h].reshape(-1) for r in range(tp)]
    cols = [torch.arange(E).reshape(H, D)[r * h:(r + 1) * h].reshape(-1) for r in range(tp)]
    plan.makers[node.target] = lambda r: LocalMultiheadAttention(mha, rows[r], cols[r], h)
    plan.sharded[f"{node.target}.in_proj_weight"] = ShardedParam.along(f"{node.target}.in_proj_weight", 0, (3 * E, E), rows)
    if mha.in_proj_bias is not None:
        plan.sharded[f"{node.target}.in_proj_bias"] = ShardedParam.along(f"{node.target}.in_proj_bias", 0, (3 * E,), rows)
    plan.sharded[f"{node.target}.out_proj.weight"] = ShardedParam.along(f"{node.target}.out_proj.weight", 1, (E, E), cols)
    copies: dict = {}
    _insert_copy(gm.graph, node, 0, copies)
    node.args = (node.args[0], node.args[0], node.args[0], *node.args[3:])
    node.meta["tp_random"] = mha.dropout > 0          # its attention dropout sees this rank's heads only
    out = next(u for u in node.users if u.args[1] == 0)
    bias = f"{node.target}.out_proj.bias" if mha.out_proj.bias is not None else None
    _reduce_after(gm.graph, out, bias)
    plan.regions.append(f"{node.target} (MultiheadAttention, {H} heads)")


def shard_tensor_parallel(gm: fx.GraphModule, tp: int) -> TensorParallelPlan:
    """Rewrite ``gm`` (requires meta['val']) for tp ranks; returns how to build each rank's modules."""
    regions, notes = find_regions(gm, tp)
    plan = TensorParallelPlan(tp=tp, root=gm, notes=notes)
    for n in gm.graph.nodes:
        n.meta.setdefault("spec", {AXIS: Replicate()})
    for region in regions:
        with at_node("the tensor-parallel rewrite of a region", region.exit):
            _shard_region(gm, region, plan)
    for n in list(gm.graph.nodes):
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.MultiheadAttention):
            with at_node("the tensor-parallel rewrite of nn.MultiheadAttention", n):
                _shard_mha(gm, n, plan)
    gm.graph.lint()
    return plan
