"""2D rules for ops that hold parameters: linears, layer norms, convolutions, nn.MultiheadAttention.

Terms: see tp2d_rewrite.py (Spec2D, axes, redistribution) and tp2d_params.py (use slice, row split).
Each rule replaces the op with functional ops on this rank's parameter blocks (``get_attr`` of the
original names, so state dicts and dumps keep them) and records how each parameter is used.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autosplit.errors import AutosplitError
from autosplit.passes import tp2d_rewrite as R
from autosplit.passes.tp_rewrite import _rows
from autosplit.tp import ops as C
from autosplit.tp.local_modules import attention_heads


def _linear(st: R._State, n: fx.Node, x_node: fx.Node, w_target: str, b_target: str | None,
            rows: list | None = None) -> fx.Node:
    """x (..., in) -> linear_2d with this rank's weight block; the bias is added as a sliced parameter."""
    x = st.specs.get(x_node, R.Spec2D())
    last = R._val(x_node).dim() - 1
    if x.b is None:
        R._refuse(n, "a linear layer on a tensor that is not split by batch (its weight gradient would be "
                   "summed over rows that saw the same samples)")
    if x.c is None:
        x_node = R._slice(st, n, x_node, last, R.COL)
        x = st.specs[x_node]
    if x.c != last:
        R._refuse(n, f"a linear layer whose input is split on dim {x.c}, not on its features (dim {last})")
    w_shape = tuple(st.gm.get_parameter(w_target).shape)
    out_f, in_f = w_shape
    if out_f % st.q or in_f % st.q:
        R._refuse(n, f"weight {list(w_shape)}: out_features({out_f}) and in_features({in_f}) must both divide "
                   f"by q({st.q})")
    region = st.region_of.get(n)
    if rows is None and region is not None and n in region.entries:
        rows = _rows(region, n, st.q)                     # output features by heads, as in 1D
    perm = torch.cat(x.idx) if x.idx is not None else torch.arange(in_f)
    st.uses.linear_weight(w_target, rows, perm)
    form = st.form(n, R._val(x_node), w_shape)
    st.forms.append((n.meta.get("module_path") or n.name, form))
    w = _get_attr(st, n, w_target)
    y = R._new(st, n, C.linear_2d, (x_node, w, R.ROW, R.COL, st.q, form), n, R.Spec2D(x.b, last, rows))
    y.meta["val"] = torch.empty(*R._val(x_node).shape[:-1], out_f, dtype=R._val(x_node).dtype, device="meta")
    if b_target is not None:
        b = _get_attr(st, n, b_target)
        st.uses.slice(b, 0, rows, y)
        st.uses.partial(b, R.ROW)
        y = R._new(st, n, operator.add, (y, b), y, R.Spec2D(x.b, last, rows))
    return y


def _layer_norm(st: R._State, n: fx.Node, x_node: fx.Node, shape, w, b, eps) -> fx.Node:
    x = st.specs.get(x_node, R.Spec2D())
    nd = R._val(x_node).dim()
    if x.c is None or x.c < nd - len(shape):
        return None                                      # channels whole: the op runs as it is
    if len(shape) != 1 or x.c != nd - 1:
        R._refuse(n, f"layer norm over {list(shape)} with the split channel dim {x.c} inside it")
    args = []
    for p in (w, b):
        if p is not None:
            st.uses.slice(p, 0, x.idx, n)
            st.uses.partial(p, R.ROW)
        args.append(p)
    return R._new(st, n, C.layer_norm_2d, (x_node, shape[0], args[0], args[1], eps, R.COL), n, x)


def whole_norm_params(st: R._State, n: fx.Node, params: list[fx.Node], x: R.Spec2D) -> None:
    """A norm over dims that are not split (qk-norm over head_dim): its weights are whole, and their
    gradient is a partial sum over every axis that splits the normalized tensor (batch rows, heads)."""
    for p in params:
        if x.b is not None:
            p = R._partial(st, n, p, R.ROW)
        if x.c is not None:
            R._partial(st, n, p, R.COL)


def _get_attr(st: R._State, n: fx.Node, target: str) -> fx.Node:
    with st.gm.graph.inserting_before(n):
        node = st.gm.graph.get_attr(target)
    node.meta["module_path"] = n.meta.get("module_path", "")
    return node


def _module(st: R._State, n: fx.Node) -> fx.Node | None:
    """Leaf modules with parameters become functional ops on sliced parameters."""
    m, t = st.gm.get_submodule(n.target), n.target
    if isinstance(m, nn.Linear):
        return _linear(st, n, n.args[0], f"{t}.weight", f"{t}.bias" if m.bias is not None else None)
    if isinstance(m, nn.LayerNorm):
        w = _get_attr(st, n, f"{t}.weight") if m.weight is not None else None
        b = _get_attr(st, n, f"{t}.bias") if m.bias is not None else None
        out = _layer_norm(st, n, n.args[0], tuple(m.normalized_shape), w, b, m.eps)
        if out is None:                                  # whole channels: plain layer norm, whole weights
            x = st.specs.get(n.args[0], R.Spec2D())
            out = R._new(st, n, F.layer_norm, (n.args[0], tuple(m.normalized_shape), w, b, m.eps), n,
                       R.Spec2D(x.b, x.c, x.idx))
            whole_norm_params(st, out, [p for p in (w, b) if p is not None], x)
        return out
    if isinstance(m, nn.Conv2d):
        return _conv(st, n, m)
    if isinstance(m, nn.MultiheadAttention):
        return _attention(st, n, m)
    if any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.parameters()):
        R._refuse(n, f"module {type(m).__name__} holds parameters and has no 2D rule")
    return None


def _conv(st: R._State, n: fx.Node, m: nn.Conv2d) -> fx.Node:
    x = st.specs.get(n.args[0], R.Spec2D())
    if x.c is not None or x.b != 0 or m.groups != 1 or m.padding_mode != "zeros":
        R._refuse(n, "a convolution needs its input's channels whole, batch split on dim 0, groups=1")
    if m.out_channels % st.q:
        R._refuse(n, f"out_channels({m.out_channels}) does not divide by q({st.q})")
    w = _get_attr(st, n, f"{n.target}.weight")
    st.uses.slice(w, 0, None, n)
    st.uses.partial(w, R.ROW)
    b = None
    if m.bias is not None:
        b = _get_attr(st, n, f"{n.target}.bias")
        st.uses.slice(b, 0, None, n)
        st.uses.partial(b, R.ROW)
    return R._new(st, n, F.conv2d, (n.args[0], w, b, m.stride, m.padding, m.dilation, 1), n, R.Spec2D(0, 1))


def _attention(st: R._State, n: fx.Node, m: nn.MultiheadAttention) -> fx.Node:
    from autosplit.passes.tp_rewrite import _mha_ok
    why = _mha_ok(n, m)
    if why:
        R._refuse(n, f"MultiheadAttention: {why}")
    E, H = m.embed_dim, m.num_heads
    if H % st.q:
        raise AutosplitError(f"layer '{n.target}': {H} attention heads do not divide by q({st.q}) "
                             f"(tp_mode='2d' splits heads over tp_col); use a tp = q*q with q dividing {H}")
    x_node = n.args[0]
    if m.batch_first is not (st.specs.get(x_node, R.Spec2D()).b == 0):
        R._refuse(n, "MultiheadAttention's batch dim is not the split batch dim")
    h = H // st.q
    rows = [torch.arange(3 * E).reshape(3, H, E // H)[:, j * h:(j + 1) * h].reshape(-1) for j in range(st.q)]
    qkv = _linear(st, n, x_node, f"{n.target}.in_proj_weight",
                  f"{n.target}.in_proj_bias" if m.in_proj_bias is not None else None, rows)
    if m.dropout > 0:
        R._refuse(n, f"MultiheadAttention with dropout={m.dropout} (2D keeps no per-rank attention masks yet)")
    heads = R._new(st, n, attention_heads, (qkv, h, m.batch_first), x_node,
                 R.Spec2D(st.specs[qkv].b, st.specs[qkv].c))      # (B/q, N, E/q): heads j, contiguous
    out = _linear(st, n, heads, f"{n.target}.out_proj.weight",
                  f"{n.target}.out_proj.bias" if m.out_proj.bias is not None else None)
    for u in list(n.users):
        if u.args[1] == 0:
            u.replace_all_uses_with(out)
    return out
