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
from torch.distributed.tensor import Replicate, Shard

from autosplit.errors import PlanError
from autosplit.passes import op_dims as OD
from autosplit.passes import tp2d_dims as D
from autosplit.passes.tp2d_params import ParamUses
from autosplit.passes.sharding.tp_plan import TensorParallelPlan
from autosplit.tp import ops as C

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
    where = n.meta.get("module_path") or "<root>"     # a node of the model's own forward
    raise PlanError(f"tp_mode='2d': node '{n.name}' (in '{where}'): {why}; 2D tensor parallelism "
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


def _align(st: _State, n: fx.Node, operands: list[fx.Node]) -> Spec2D:
    """Elementwise / concatenating ops: operands aligned from the right (broadcasting)."""
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
        order = OD.permute_order(n, nd)
        return _moved(st, n, x, lambda d, k: D.permute_dim(order, d))
    if name in ("transpose", "swapaxes", "swapdims"):
        a, b = OD.transpose_dims(n, nd)
        return _moved(st, n, x, lambda d, k: D.transpose_dim(a, b, d))
    if name == "t":
        return _moved(st, n, x, lambda d, k: 1 - d)
    if name == "unsqueeze":
        k_new = OD.unsqueeze_dim(n, nd)
        return _moved(st, n, x, lambda d, k: D.unsqueeze_dim(k_new, d))
    if name == "squeeze":
        dims = OD.squeeze_dims(n, src.shape)
        return _moved(st, n, x, lambda d, k: D.squeeze_dim(dims, d))
    if name == "expand":
        return _moved(st, n, x, lambda d, k: d + out.dim() - nd)
    if name == "getitem":
        return _moved(st, n, x, lambda d, k: D.index_dim(n.args[1], nd, d))
    raise AssertionError(name)


def region_free(st: _State, n: fx.Node) -> bool:
    return n not in st.region_of


def _reduce_rule(st: _State, n: fx.Node, name: str, x: Spec2D) -> Spec2D:
    """Reductions and softmax-like ops: refused over a split dim (implicit and negative dims as torch
    reads them, passes/op_dims.py)."""
    nd = _val(n.args[0]).dim()
    if name in OD.SOFTMAX_LIKE:
        module = st.gm.get_submodule(n.target) if n.op == "call_module" else None
        dims, keep = [OD.softmax_dim(n, nd, module)], True
    else:
        dims, keep = OD.reduced_dims(n, nd), OD.keepdim(n)
    return _moved(st, n, x, lambda d, k: D.reduce_dim(dims, keep, d, name))
