"""Sequence parallelism: shard the token dim of everything between tensor-parallel regions.

Terms (see tp_rewrite.py for spec, region, partial grads):
  token dim   -- dim 1 of a (B, N, C) activation.  Between regions (layer norms, dropout, residual
                 adds) every op treats tokens independently, so each tp rank can hold N / tp of them
                 instead of all N: activation memory and that compute drop by tp.
  token-local -- an op that treats tokens independently: pointwise ops whose other operands broadcast
                 over tokens (a (C,) bias, a layer-scale gamma), layer norm over the last dim, dropout.
  slice point -- where the sharded domain starts: the earliest token-local op before the first
                 region, reached by walking back from its input; ``local_slice`` goes there.
Rewrite: each region's ``all_reduce`` becomes ``reduce_scatter`` along tokens, each ``copy_to_axis``
of a sharded tensor becomes ``all_gather``, and any other consumer of a sharded tensor (the head's
pooling) gets a ``gather`` first (whose backward only slices: the head's gradient is whole).
Parameters of sharded-domain ops see only their rank's tokens, so they join the partial-grad list.  Token counts that do not divide by tp are padded (autosplit/tp/ops.py).
"""
from __future__ import annotations


import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from autosplit.errors import AutosplitError, PlanError, at_node
from autosplit.passes import op_dims as D
from autosplit.passes.op_names import inplace_base, op_name, out_of_place
from autosplit.passes.tp_regions import params_used
from autosplit.tp import ops as C

AXIS, TOKENS = "tp", 1
_LOCAL_MODULES = (nn.LayerNorm, nn.Dropout, nn.Identity, nn.GELU, nn.SiLU, nn.ReLU)
_LOCAL_FUNCS = {"layer_norm", "dropout", "gelu", "silu", "relu", "contiguous", "clone", "to", "float"}
_BINARY = {"add", "mul", "sub", "truediv", "div"}      # in-place forms go by inplace_base (x += y: add)


def _is_3d(n) -> bool:
    return isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() == 3


def _token_local(n: fx.Node, gm: fx.GraphModule, sharded: set) -> bool:
    """Does ``n`` treat tokens independently, given which of its inputs are token-sharded?"""
    if not _is_3d(n):
        return False
    if n.op == "call_module":
        m = gm.get_submodule(n.target)
        return isinstance(m, _LOCAL_MODULES) and (not isinstance(m, nn.LayerNorm) or len(m.normalized_shape) == 1)
    name = inplace_base(n, gm) or op_name(n, gm)       # x.add_(y) treats tokens as x + y does
    if name == "layer_norm":
        shape = D.arg(n, 1, "normalized_shape")
        return isinstance(shape, int) or len(shape) == 1
    if name in _LOCAL_FUNCS:
        return True
    if name in _BINARY:
        tensors = [a for a in n.args[:2] if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
        return all(a in sharded or _broadcasts_over_tokens(a) for a in tensors)
    return False


def _broadcasts_over_tokens(a: fx.Node) -> bool:
    shape = a.meta["val"].shape
    return len(shape) < 2 or shape[-2] == 1


def _slice_point(gm: fx.GraphModule, start: fx.Node) -> fx.Node:
    """Walk back from ``start`` through single-input token-local ops; the earliest is sharded first."""
    node = start
    while True:
        ins = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        acts = [a for a in ins if a.op != "get_attr"]
        if len(acts) != 1 or not _token_local(node, gm, set(acts)) or not _is_3d(acts[0]):
            return node
        node = acts[0]


def apply_sequence_parallel(gm: fx.GraphModule, plan) -> None:
    """Rewrite a graph already sharded by tp_rewrite (requires meta['val']) for sequence parallelism."""
    graph, tp = gm.graph, plan.tp
    copies = [n for n in graph.nodes if n.target is C.copy_to_axis]
    if not copies:
        plan.notes.append("sequence_parallel: no tensor-parallel region, nothing to shard")
        return
    with at_node("the sequence-parallel rule", copies[0].args[0]):
        first = _slice_point(gm, copies[0].args[0])
    if not _is_3d(first):
        raise AutosplitError(f"sequence_parallel needs (B, N, C) activations before the first region; "
                             f"'{first.name}' has shape {tuple(first.meta['val'].shape)}")
    sharded = {first}
    full = first.meta["val"].shape[TOKENS]
    with graph.inserting_after(first):
        sliced = graph.call_function(C.local_slice, (first, TOKENS, AXIS, tp))
    first.replace_all_uses_with(sliced, delete_user_cb=lambda u: u is not sliced)
    _meta(sliced, first, Shard(TOKENS))
    sharded, done = {sliced}, set()
    for n in list(graph.nodes):
        with at_node("the sequence-parallel rule", n):
            _sequence_rule(gm, n, plan, sharded, done, full)


def _sequence_rule(gm: fx.GraphModule, n: fx.Node, plan, sharded: set, done: set, full: int) -> None:
    """Where ``n`` runs: on token shards (``sharded``), or whole after gathering its sharded inputs."""
    graph, tp = gm.graph, plan.tp
    if n.target is C.all_reduce:
        n.target, n.args = C.reduce_scatter, (n.args[0], TOKENS, AXIS, tp)
        n.meta["spec"] = {AXIS: Shard(TOKENS)}
        sharded.add(n)
    elif n in sharded or n in done or _reads_rank(n) or not any(a in sharded for a in n.all_input_nodes):
        return
    elif n.target is C.copy_to_axis:
        _to_all_gather(n, tp, full)
    elif _is_shape_read(n) and _gathered_copy(n.args[0], tp, full, done) is not None:
        n.replace_input_with(n.args[0], _gathered_copy(n.args[0], tp, full, done))
    elif _token_local(n, gm, sharded):
        sharded.add(n)
        n.meta["spec"] = {AXIS: Shard(TOKENS)}
        plan.partial_grads.update(params_used(gm, n))
    else:
        base = inplace_base(n, gm)
        if base is not None and n.args[0] in sharded:
            # the gathered copy would take the write; later readers of the shard would not see it
            raise PlanError(f"sequence_parallel: node '{n.name}' ({op_name(n, gm)}, in "
                            f"'{n.meta.get('module_path') or '<root>'}') writes the token-sharded tensor "
                            f"'{n.args[0].name}' in place but needs every token; write it out of place "
                            f"({out_of_place(n)}) or turn sequence_parallel off")
        _gather_inputs(graph, n, sharded, tp, full)


def _reads_rank(n: fx.Node) -> bool:
    """x.dim(), x.ndim, x.dtype, x.device: the same for a token shard as for the whole tensor."""
    return (n.op == "call_method" and n.target in ("dim", "ndimension")) or \
        (n.op == "call_function" and n.target is getattr and n.args[1] in ("ndim", "dtype", "device"))


def _is_shape_read(n: fx.Node) -> bool:
    return (n.op == "call_function" and n.target is getattr and n.args[1] == "shape") or \
        (n.op == "call_method" and n.target == "size")


def _to_all_gather(copy: fx.Node, tp: int, full: int) -> None:
    copy.target, copy.args = C.all_gather, (copy.args[0], TOKENS, AXIS, tp, full)


def _gathered_copy(a: fx.Node, tp: int, full: int, done: set) -> fx.Node | None:
    """The region entry's gather of ``a``, moved up to right after ``a`` so shape reads can use it
    (timm reads ``B, N, C = x.shape`` before its qkv projection)."""
    copy = next((u for u in a.users if u.target in (C.copy_to_axis, C.all_gather) and u.args[0] is a), None)
    if copy is None:
        return None
    if copy.target is C.copy_to_axis:
        _to_all_gather(copy, tp, full)
        a.append(copy)
        done.add(copy)
    return copy


def _gather_inputs(graph: fx.Graph, n: fx.Node, sharded: set, tp: int, full: int) -> None:
    for a in [a for a in n.all_input_nodes if a in sharded]:
        with graph.inserting_before(n):
            gathered = graph.call_function(C.gather, (a, TOKENS, AXIS, tp, full))
        _meta(gathered, a, Replicate())
        n.replace_input_with(a, gathered)


def _meta(new: fx.Node, like: fx.Node, spec) -> None:
    new.meta["module_path"] = like.meta.get("module_path", "")
    new.meta["val"] = like.meta.get("val")
    new.meta["spec"] = {AXIS: spec}


