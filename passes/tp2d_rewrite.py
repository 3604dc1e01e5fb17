"""Rewrite a traced graph for 2D tensor parallelism (SUMMA / Optimus) on a q x q grid of tp ranks.

Terms:
  axes    -- ``tp_row`` splits the batch dim, ``tp_col`` splits the channel dim: tp rank (i, j) =
             i * q + j holds activation blocks (B/q, N, C/q).  ``node.meta['spec']`` is
             {"tp_row": placement, "tp_col": placement} (torch.distributed.tensor placements).
  Spec2D  -- the pass's working form of a spec: the batch dim ``b``, the channel dim ``c`` and, when
             the channel blocks are not contiguous (attention heads inside a Megatron region, fused qkv
             rows), ``idx``: per tp_col coordinate the channel indices it holds.
  rules   -- per op, where the split dims go (passes/tp2d_dims.py); ops that combine a split tensor
             with a whole one get a redistribution first: ``local_slice`` where the whole one has the
             full dim, ``copy_to_axis`` where it broadcasts (its gradient is a partial sum).
  weights -- every parameter is split q^2 ways: the dims its use needs split over tp_col (a linear's
             output rows, a norm's channels), then one more dim over tp_row.  Uses gather it back over
             tp_row (``all_gather``, whose backward reduce-scatters: the gradient is a partial sum over
             the rows' samples).  Linears take their block as it is (``linear_2d``).
  shape reads -- a size read off a split dim is multiplied by q (the graph computes global sizes, as
             the model's code expects); reshape / view / expand sizes at split dims are divided by q.
Attention's heads come from the 1D region analysis (passes/tp_regions.py) run over tp_col: the same
factor machinery finds the heads, by elimination, not by name.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from autosplit.errors import AutosplitError
from autosplit.passes import tp2d_dims as D
from autosplit.passes.tp2d_params import ParamUses
from autosplit.passes.tp_rewrite import TensorParallelPlan, _rows
from autosplit.tp import ops as C
from autosplit.tp.layers import attention_heads

ROW, COL = "tp_row", "tp_col"
_UNARY = {"gelu", "silu", "relu", "tanh", "sigmoid", "dropout", "neg", "contiguous", "to", "float", "half",
          "bfloat16", "type_as", "clone", "detach", "identity", "exp", "sqrt", "rsqrt", "erf", "abs",
          "softplus", "hardswish", "mish", "Dropout", "Identity", "GELU", "SiLU", "ReLU", "Tanh", "Sigmoid",
          "DropPath"}
_BINARY = {"add", "mul", "sub", "truediv", "div", "iadd", "imul", "pow"}
_VIEWS = {"reshape", "view", "expand"}


@dataclass
class Spec2D:
    b: int | None = None
    c: int | None = None
    idx: list | None = None          # per tp_col coordinate: channel indices (None: contiguous blocks)

    def placements(self) -> dict:
        return {ROW: Shard(self.b) if self.b is not None else Replicate(),
                COL: Shard(self.c) if self.c is not None else Replicate()}


@dataclass
class _State:
    gm: fx.GraphModule
    q: int
    form: object                                   # fn(node, x_val, w_shape) -> "allgather" | "summa"
    plan: TensorParallelPlan
    specs: dict = field(default_factory=dict)
    uses: ParamUses = None
    region_of: dict = field(default_factory=dict)   # region node / entry / exit -> Region
    forms: list = field(default_factory=list)


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _is_tensor(n) -> bool:
    return isinstance(_val(n), torch.Tensor)


def _refuse(n: fx.Node, why: str):
    where = n.meta.get("module_path") or n.name
    raise AutosplitError(f"tp_mode='2d': node '{n.name}' (in '{where}'): {why}; 2D tensor parallelism "
                         f"cannot split it. Use tp_mode='1d' for this model, or report the op") from None


def _new(st: _State, before: fx.Node, fn, args, like: fx.Node, spec: Spec2D | None) -> fx.Node:
    with st.gm.graph.inserting_before(before):
        node = st.gm.graph.call_function(fn, args)
    node.meta["module_path"] = like.meta.get("module_path", "")
    node.meta["val"] = like.meta.get("val")
    if spec is not None:
        st.specs[node] = spec
    return node


def _set_arg(user: fx.Node, old: fx.Node, new: fx.Node) -> None:
    user.args = fx.node.map_arg(user.args, lambda a: new if a is old else a)
    user.kwargs = fx.node.map_arg(user.kwargs, lambda a: new if a is old else a)


# ---- redistribution of one operand for one user ---------------------------------------------------
def _partial(st: _State, user: fx.Node, a: fx.Node, axis: str) -> fx.Node:
    """``a`` is whole over ``axis`` but broadcasts over a dim split there: its gradient is partial."""
    if a.op == "get_attr":
        st.uses.partial(a, axis)
        return a
    new = _new(st, user, C.copy_to_axis, (a, axis), a, st.specs.get(a, Spec2D()))
    _set_arg(user, a, new)
    return new


def _slice(st: _State, user: fx.Node, a: fx.Node, dim: int, axis: str, idx=None) -> fx.Node:
    """``a`` holds the full ``dim`` where ``user`` needs this rank's block of it."""
    if a.op == "get_attr" and axis == COL:
        st.uses.slice(a, dim, idx, user)
        return a
    if _expanded_param(a) and _slice_expand(st, user, a, dim, axis, idx):
        return a
    if idx is not None:
        _refuse(user, f"'{a.name}' must be cut into the channel blocks {axis} holds, which are not contiguous")
    spec = st.specs.get(a, Spec2D())
    spec = Spec2D(dim if axis == ROW else spec.b, dim if axis == COL else spec.c, spec.idx)
    new = _new(st, user, C.local_slice, (a, dim, axis, st.q), a, spec)
    _set_arg(user, a, new)
    return new


def _expanded_param(a: fx.Node) -> bool:
    """``param.expand(...)`` used once (a class token broadcast over the batch)."""
    return (a.op in ("call_method", "call_function") and getattr(a.target, "__name__", a.target) == "expand"
            and isinstance(a.args[0], fx.Node) and a.args[0].op == "get_attr" and len(a.users) == 1)


def _slice_expand(st: _State, user: fx.Node, a: fx.Node, dim: int, axis: str, idx) -> bool:
    """Cut the parameter, or expand to the local size, instead of cutting the expanded tensor."""
    src = a.args[0]
    e = dim - (_val(a).dim() - _val(src).dim())
    packed = len(a.args) == 2 and isinstance(a.args[1], (tuple, list))
    sizes = list(a.args[1] if packed else a.args[1:])
    if (e < 0 or _val(src).shape[e] == 1) and axis == ROW:        # broadcast rows: expand to B/q of them
        v = sizes[dim]
        if isinstance(v, int):
            if v % st.q:
                return False
            sizes[dim] = v // st.q
        else:
            with st.gm.graph.inserting_before(a):
                sizes[dim] = st.gm.graph.call_function(operator.floordiv, (v, st.q))
        st.uses.partial(src, ROW)                                  # each row sums its B/q copies
    elif e >= 0 and _val(src).shape[e] > 1 and axis == COL and sizes[dim] == -1:
        st.uses.slice(src, e, idx, a)                              # the parameter's own channel blocks
    else:
        return False
    a.args = (src, tuple(sizes)) if packed else (src, *sizes)
    spec = st.specs.setdefault(a, Spec2D())
    if axis == ROW:
        spec.b = dim
    else:
        spec.c, spec.idx = dim, idx
    return True


def _align(st: _State, n: fx.Node, operands: list[fx.Node], lead: bool = True) -> Spec2D:
    """Elementwise / concatenating ops: operands aligned from the right (``lead``: broadcasting)."""
    out_nd = _val(n).dim()
    out = Spec2D()
    for a in operands:                                   # the split operands decide
        s, shift = st.specs.get(a, Spec2D()), out_nd - _val(a).dim()
        for key in ("b", "c"):
            d = getattr(s, key)
            if d is None:
                continue
            mine = getattr(out, key)
            in_region = key == "c" and n in st.region_of      # the region analysis aligned these
            if mine is not None and not in_region and (mine != d + shift or (key == "c" and not _same_idx(out.idx, s.idx))):
                _refuse(n, f"its operands split the {'batch' if key == 'b' else 'channel'} dim differently")
            setattr(out, key, d + shift)
            if key == "c":
                out.idx = s.idx
    for a in list(operands):                             # the whole ones are cut or marked
        s, shift = st.specs.get(a, Spec2D()), out_nd - _val(a).dim()
        for key, axis in (("b", ROW), ("c", COL)):
            d = getattr(out, key)
            if d is None or getattr(s, key) is not None:
                continue
            e = d - shift
            if e < 0 or _val(a).shape[e] == 1:
                a = _partial(st, n, a, axis)
            else:
                a = _slice(st, n, a, e, axis, out.idx if key == "c" else None)
    return out


def _same_idx(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return all(torch.equal(x, y) for x, y in zip(a, b))


# ---- per-op rules -----------------------------------------------------------------------------------
def _moved(st: _State, n: fx.Node, x: Spec2D, fn) -> Spec2D:
    """A view-like op: apply ``fn`` (a dim map) to both split dims."""
    try:
        b = fn(x.b, "b") if x.b is not None else None
        c = fn(x.c, "c") if x.c is not None else None
    except D.Refuse as exc:
        _refuse(n, str(exc))
    return Spec2D(b, c, x.idx)


def _view_rule(st: _State, n: fx.Node, name: str, x: Spec2D) -> Spec2D:
    src, out = _val(n.args[0]), _val(n)
    nd = src.dim()
    if name in ("reshape", "view", "flatten", "unflatten"):
        if x.idx is not None and x.c is not None and region_free(st, n):
            _refuse(n, "reshaping channels whose blocks are not contiguous")
        return _moved(st, n, x, lambda d, k: D.reshape_dim(list(src.shape), list(out.shape), d, st.q))
    if name == "permute":
        order = n.args[1:] if len(n.args) > 2 or isinstance(n.args[1], int) else n.args[1]
        return _moved(st, n, x, lambda d, k: D.permute_dim([o % nd for o in order], d))
    if name in ("transpose", "swapaxes"):
        a, b = (d % nd for d in n.args[1:3])
        return _moved(st, n, x, lambda d, k: D.transpose_dim(a, b, d))
    if name == "t":
        return _moved(st, n, x, lambda d, k: 1 - d)
    if name == "unsqueeze":
        return _moved(st, n, x, lambda d, k: D.unsqueeze_dim(n.args[1] % (nd + 1), d))
    if name == "squeeze":
        dims = D.dims_of(n.args[1], nd) if len(n.args) > 1 else [i for i, s in enumerate(src.shape) if s == 1]
        return _moved(st, n, x, lambda d, k: D.squeeze_dim(dims, d))
    if name == "expand":
        return _moved(st, n, x, lambda d, k: d + out.dim() - nd)
    if name == "getitem":
        return _moved(st, n, x, lambda d, k: D.index_dim(n.args[1], nd, d))
    raise AssertionError(name)


def region_free(st: _State, n: fx.Node) -> bool:
    return n not in st.region_of


def _reduce_rule(st: _State, n: fx.Node, name: str, x: Spec2D) -> Spec2D:
    nd = _val(n.args[0]).dim()
    arg = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    if name in ("softmax", "log_softmax"):
        dims, keep = D.dims_of(arg if arg is not None else -1, nd), True
    else:
        dims = D.dims_of(arg, nd) if arg is not None else list(range(nd))
        keep = bool(n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False))
    return _moved(st, n, x, lambda d, k: D.reduce_dim(dims, keep, d, name))


def _linear(st: _State, n: fx.Node, x_node: fx.Node, w_target: str, b_target: str | None,
            rows: list | None = None) -> fx.Node:
    """x (..., in) -> linear_2d with this rank's weight block; the bias is added as a sliced parameter."""
    x = st.specs.get(x_node, Spec2D())
    last = _val(x_node).dim() - 1
    if x.b is None:
        _refuse(n, "a linear layer on a tensor that is not split by batch (its weight gradient would be "
                   "summed over rows that saw the same samples)")
    if x.c is None:
        x_node = _slice(st, n, x_node, last, COL)
        x = st.specs[x_node]
    if x.c != last:
        _refuse(n, f"a linear layer whose input is split on dim {x.c}, not on its features (dim {last})")
    w_shape = tuple(st.gm.get_parameter(w_target).shape)
    out_f, in_f = w_shape
    if out_f % st.q or in_f % st.q:
        _refuse(n, f"weight {list(w_shape)}: out_features({out_f}) and in_features({in_f}) must both divide "
                   f"by q({st.q})")
    region = st.region_of.get(n)
    if rows is None and region is not None and n in region.entries:
        rows = _rows(region, n, st.q)                     # output features by heads, as in 1D
    perm = torch.cat(x.idx) if x.idx is not None else torch.arange(in_f)
    st.uses.linear_weight(w_target, rows, perm)
    form = st.form(n, _val(x_node), w_shape)
    st.forms.append((n.meta.get("module_path") or n.name, form))
    w = _get_attr(st, n, w_target)
    y = _new(st, n, C.linear_2d, (x_node, w, ROW, COL, st.q, form), n, Spec2D(x.b, last, rows))
    y.meta["val"] = torch.empty(*_val(x_node).shape[:-1], out_f, dtype=_val(x_node).dtype, device="meta")
    if b_target is not None:
        b = _get_attr(st, n, b_target)
        st.uses.slice(b, 0, rows, y)
        st.uses.partial(b, ROW)
        y = _new(st, n, operator.add, (y, b), y, Spec2D(x.b, last, rows))
    return y


def _layer_norm(st: _State, n: fx.Node, x_node: fx.Node, shape, w, b, eps) -> fx.Node:
    x = st.specs.get(x_node, Spec2D())
    nd = _val(x_node).dim()
    if x.c is None or x.c < nd - len(shape):
        return None                                      # channels whole: the op runs as it is
    if len(shape) != 1 or x.c != nd - 1:
        _refuse(n, f"layer norm over {list(shape)} with the split channel dim {x.c} inside it")
    args = []
    for p in (w, b):
        if p is not None:
            st.uses.slice(p, 0, x.idx, n)
            st.uses.partial(p, ROW)
        args.append(p)
    return _new(st, n, C.layer_norm_2d, (x_node, shape[0], args[0], args[1], eps, COL), n, x)


def whole_norm_params(st: _State, n: fx.Node, params: list[fx.Node], x: Spec2D) -> None:
    """A norm over dims that are not split (qk-norm over head_dim): its weights are whole, and their
    gradient is a partial sum over every axis that splits the normalized tensor (batch rows, heads)."""
    for p in params:
        if x.b is not None:
            p = _partial(st, n, p, ROW)
        if x.c is not None:
            _partial(st, n, p, COL)


def _get_attr(st: _State, n: fx.Node, target: str) -> fx.Node:
    with st.gm.graph.inserting_before(n):
        node = st.gm.graph.get_attr(target)
    node.meta["module_path"] = n.meta.get("module_path", "")
    return node


def _module(st: _State, n: fx.Node) -> fx.Node | None:
    """Leaf modules with parameters become functional ops on sliced parameters."""
    m, t = st.gm.get_submodule(n.target), n.target
    if isinstance(m, nn.Linear):
        return _linear(st, n, n.args[0], f"{t}.weight", f"{t}.bias" if m.bias is not None else None)
    if isinstance(m, nn.LayerNorm):
        w = _get_attr(st, n, f"{t}.weight") if m.weight is not None else None
        b = _get_attr(st, n, f"{t}.bias") if m.bias is not None else None
        out = _layer_norm(st, n, n.args[0], tuple(m.normalized_shape), w, b, m.eps)
        if out is None:                                  # whole channels: plain layer norm, whole weights
            x = st.specs.get(n.args[0], Spec2D())
            out = _new(st, n, F.layer_norm, (n.args[0], tuple(m.normalized_shape), w, b, m.eps), n,
                       Spec2D(x.b, x.c, x.idx))
            whole_norm_params(st, out, [p for p in (w, b) if p is not None], x)
        return out
    if isinstance(m, nn.Conv2d):
        return _conv(st, n, m)
    if isinstance(m, nn.MultiheadAttention):
        return _attention(st, n, m)
    if any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.parameters()):
        _refuse(n, f"module {type(m).__name__} holds parameters and has no 2D rule")
    return None


def _conv(st: _State, n: fx.Node, m: nn.Conv2d) -> fx.Node:
    x = st.specs.get(n.args[0], Spec2D())
    if x.c is not None or x.b != 0 or m.groups != 1 or m.padding_mode != "zeros":
        _refuse(n, "a convolution needs its input's channels whole, batch split on dim 0, groups=1")
    if m.out_channels % st.q:
        _refuse(n, f"out_channels({m.out_channels}) does not divide by q({st.q})")
    w = _get_attr(st, n, f"{n.target}.weight")
    st.uses.slice(w, 0, None, n)
    st.uses.partial(w, ROW)
    b = None
    if m.bias is not None:
        b = _get_attr(st, n, f"{n.target}.bias")
        st.uses.slice(b, 0, None, n)
        st.uses.partial(b, ROW)
    return _new(st, n, F.conv2d, (n.args[0], w, b, m.stride, m.padding, m.dilation, 1), n, Spec2D(0, 1))


def _attention(st: _State, n: fx.Node, m: nn.MultiheadAttention) -> fx.Node:
    from autosplit.passes.tp_rewrite import _mha_ok
    why = _mha_ok(n, m)
    if why:
        _refuse(n, f"MultiheadAttention: {why}")
    E, H = m.embed_dim, m.num_heads
    if H % st.q:
        raise AutosplitError(f"layer '{n.target}': {H} attention heads do not divide by q({st.q}) "
                             f"(tp_mode='2d' splits heads over tp_col); use a tp = q*q with q dividing {H}")
    x_node = n.args[0]
    if m.batch_first is not (st.specs.get(x_node, Spec2D()).b == 0):
        _refuse(n, "MultiheadAttention's batch dim is not the split batch dim")
    h = H // st.q
    rows = [torch.arange(3 * E).reshape(3, H, E // H)[:, j * h:(j + 1) * h].reshape(-1) for j in range(st.q)]
    qkv = _linear(st, n, x_node, f"{n.target}.in_proj_weight",
                  f"{n.target}.in_proj_bias" if m.in_proj_bias is not None else None, rows)
    if m.dropout > 0:
        _refuse(n, f"MultiheadAttention with dropout={m.dropout} (2D keeps no per-rank attention masks yet)")
    heads = _new(st, n, attention_heads, (qkv, h, m.batch_first), x_node,
                 Spec2D(st.specs[qkv].b, st.specs[qkv].c))      # (B/q, N, E/q): heads j, contiguous
    out = _linear(st, n, heads, f"{n.target}.out_proj.weight",
                  f"{n.target}.out_proj.bias" if m.out_proj.bias is not None else None)
    for u in list(n.users):
        if u.args[1] == 0:
            u.replace_all_uses_with(out)
    return out
