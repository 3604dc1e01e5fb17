"""``shard_2d``: the 2D tensor-parallel pass over a whole graph (rules in tp2d_rewrite.py).

Requires ``node.meta['val']`` (global shapes).  Ensures: every node has ``meta['spec']`` over
``tp_row`` / ``tp_col``; model inputs are cut to this rank's batch rows (``local_slice``); the output is
gathered whole on every tp rank (``gather``: its backward keeps this rank's block of the gradient,
which is whole, so the loss and its gradient equal single-device training); every size read off a
split dim is global, every size written at a split dim is local.  Returns the TensorParallelPlan
that builds each rank's parameter blocks.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate

from autosplit.errors import AutosplitError, at_node
from autosplit.passes import tp2d_ops as O
from autosplit.passes import tp2d_rewrite as R
from autosplit.passes.tp2d_params import ParamUses, apply_param_uses
from autosplit.passes import op_dims as OD
from autosplit.passes.op_names import inplace_base, keeps_effect, op_name
from autosplit.passes.tp_regions import find_regions
from autosplit.passes.sharding.tp_plan import TensorParallelPlan
from autosplit.passes.tp_layout import index_set
from autosplit.tp import ops as C

Spec2D, ROW, COL = R.Spec2D, R.ROW, R.COL


def shard_2d(gm: fx.GraphModule, q: int, form) -> TensorParallelPlan:
    """Rewrite ``gm`` for a q x q grid; ``form(node, x_val, w_shape)`` picks each linear's algorithm."""
    regions, notes = find_regions(gm, q, f"q({q}), the tp_col side of the {q}x{q} grid (tp={q * q})")
    plan = TensorParallelPlan(tp=q * q, root=gm, notes=notes)
    st = R._State(gm, q, form, plan, uses=ParamUses(gm, q))
    exit_inputs = {}
    for r in regions:
        for n in r.nodes + r.entries + [r.exit]:
            st.region_of[n] = r
        exit_inputs[r.exit.args[0]] = _cols(r, q)
        plan.regions.append(f"{r.name} <- {', '.join(e.meta.get('module_path', e.name) for e in r.entries)}")
    _slice_inputs(st, [n for n in gm.graph.nodes if n.op == "placeholder"])
    for n in list(gm.graph.nodes):
        if n in st.specs or (not n.users and n.op != "output" and not keeps_effect(n)):
            continue                                   # a model input's cut, or dead after a rewrite
        if n.op in ("placeholder", "get_attr"):      # whole until a rule cuts them
            st.specs[n] = Spec2D()
            continue
        with at_node("the 2D tensor-parallel rule", n):
            if n.op == "output":
                _output(st, n)
            else:
                _rule(st, n)
            if n in exit_inputs and isinstance(st.specs.get(n), Spec2D):
                st.specs[n].idx = exit_inputs[n]          # the exit gathers the heads in this order
    apply_param_uses(st.uses, gm, plan)
    for n in gm.graph.nodes:
        spec = st.specs.get(n)
        n.meta["spec"] = spec.placements() if isinstance(spec, Spec2D) else {ROW: Replicate(), COL: Replicate()}
    plan.forms = st.forms
    gm.graph.eliminate_dead_code(is_impure_node=keeps_effect)
    gm.graph.lint()
    return plan


def _cols(region, q: int) -> list[torch.Tensor]:
    """Per rank, the exit's input features it holds (the heads in the order the exit reads them)."""
    f = region.factors
    leaves = f.flat(region.layouts[region.exit.args[0]][-1])
    shard = next(x for x in leaves if x in region.shard)
    return [index_set(f, leaves, shard, q, r) for r in range(q)]


def _slice_inputs(st: R._State, placeholders: list[fx.Node]) -> None:
    last = placeholders[-1] if placeholders else None
    for ph in placeholders:
        val = ph.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() == 0:
            continue
        if val.shape[0] % st.q:
            raise AutosplitError(f"tp_mode='2d': the microbatch has {val.shape[0]} rows, which do not divide by "
                                 f"q({st.q}) (tp = q*q splits each microbatch's rows over tp_row); use a "
                                 f"microbatch of a multiple of {st.q} rows")
        with st.gm.graph.inserting_after(last):
            cut = st.gm.graph.call_function(C.local_slice, (ph, 0, ROW, st.q))
        cut.meta.update(val=val, module_path="")
        ph.replace_all_uses_with(cut, delete_user_cb=lambda u: u is not cut)
        st.specs[cut] = Spec2D(b=0)
        st.specs[ph] = Spec2D()
        last = cut


def _output(st: R._State, n: fx.Node) -> None:
    x = n.args[0]
    if not isinstance(x, fx.Node) or not R._is_tensor(x):
        return
    s = st.specs.get(x, Spec2D())
    cur = x
    if s.c is not None:
        if s.idx is not None and not all(torch.equal(i, b) for i, b in
                                         zip(s.idx, torch.arange(len(torch.cat(s.idx))).chunk(st.q))):
            R._refuse(x, "the model's output has channels in non-contiguous blocks")
        cur = R._new(st, n, C.gather, (cur, s.c, COL, st.q, R._val(x).shape[s.c]), x, Spec2D(s.b))
    if s.b is not None:
        cur = R._new(st, n, C.gather, (cur, s.b, ROW, st.q, R._val(x).shape[s.b]), x, Spec2D())
    n.args = (cur,)


def _shape_read(st: R._State, n: fx.Node, x: fx.Node) -> None:
    """``x.shape`` / ``x.size()``: int reads of split dims become global (times q)."""
    s = st.specs.get(x, Spec2D())
    split = {d for d in (s.b, s.c) if d is not None}
    ndim = R._val(x).dim()
    for u in list(n.users):
        if _slice_misses(u, ndim, split):
            continue            # e.g. ``x.shape[1:3]`` of a tensor split at dim 3: global sizes already
        if not (u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)):
            if split:
                R._refuse(u, f"it uses the whole shape of '{x.name}', whose dims {sorted(split)} are split")
            continue
        if u.args[1] % R._val(x).dim() in split:
            _times_q(st, u)


def _slice_misses(u: fx.Node, ndim: int, split: set) -> bool:
    """Is ``u`` a constant slice of a shape (``shape[a:b]``) that reads no split dim?"""
    if not (u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], slice)):
        return False
    fields = (u.args[1].start, u.args[1].stop, u.args[1].step)
    if not all(f is None or isinstance(f, int) for f in fields):
        return False
    return not split.intersection(range(ndim)[u.args[1]])


def _times_q(st: R._State, n: fx.Node) -> None:
    with st.gm.graph.inserting_after(n):
        g = st.gm.graph.call_function(operator.mul, (n, st.q))
    n.replace_all_uses_with(g, delete_user_cb=lambda u: u is not g)


def _sizes(st: R._State, n: fx.Node, s: Spec2D) -> None:
    """reshape / view / expand: sizes written at split dims are local."""
    packed = len(n.args) == 2 and isinstance(n.args[1], (tuple, list))
    sizes = list(n.args[1] if packed else n.args[1:])
    for d in {d for d in (s.b, s.c) if d is not None}:
        v = sizes[d]
        if isinstance(v, int) and v != -1:
            if v % st.q:
                R._refuse(n, f"size {v} at split dim {d} does not divide by q({st.q})")
            sizes[d] = v // st.q
        elif isinstance(v, fx.Node):
            with st.gm.graph.inserting_before(n):
                sizes[d] = st.gm.graph.call_function(operator.floordiv, (v, st.q))
    n.args = (n.args[0], tuple(sizes)) if packed else (n.args[0], *sizes)


def _tensors(args) -> list[fx.Node]:
    return [a for a in args if isinstance(a, fx.Node) and R._is_tensor(a)]


def _rule(st: R._State, n: fx.Node) -> None:
    name = op_name(n, st.gm)
    if n.op == "call_function" and n.target is getattr and n.args[1] == "shape":
        return _shape_read(st, n, n.args[0])
    if name == "size":
        if OD.arg(n, 1, "dim") is not None:
            s, d = st.specs.get(n.args[0], Spec2D()), OD.dim(n, 1, "dim", R._val(n.args[0]).dim())
            if d in {s.b, s.c}:
                _times_q(st, n)
            return
        return _shape_read(st, n, n.args[0])
    if name == "numel" and isinstance(n.args[0], fx.Node):
        s = st.specs.get(n.args[0], Spec2D())     # q blocks per split dim: the global count is q^k times
        for _ in [d for d in (s.b, s.c) if d is not None]:
            _times_q(st, n)
        return
    val = n.meta.get("val")
    if name == "getitem" and isinstance(st.specs.get(n.args[0]), tuple):
        one = st.specs[n.args[0]][n.args[1]]
        st.specs[n] = Spec2D(one.b, one.c, one.idx)
        if n in st.region_of:
            st.specs[n].c, st.specs[n].idx = st.region_of[n].shard_dim(n), None
        return
    if n.op == "call_module":
        out = O._module(st, n)                    # modules with parameters; None: elementwise ones
        if out is not None:
            n.replace_all_uses_with(out)
            return
    tensor_out = isinstance(val, torch.Tensor) or (isinstance(val, (tuple, list)) and val and
                                                   all(isinstance(v, torch.Tensor) for v in val))
    if not tensor_out:
        if any(isinstance(st.specs.get(a), Spec2D) and (st.specs[a].b is not None or st.specs[a].c is not None)
               for a in _tensors(n.all_input_nodes)) and name not in ("dim", "_assert", "numel"):
            R._refuse(n, f"op '{name}' returns a non-tensor computed from split tensors")
        return
    written = None                  # an in-place op's first operand (the tensor it writes)
    if name == "linear":
        w, b = n.args[1], (n.args[2] if len(n.args) > 2 else n.kwargs.get("bias"))
        out = O._linear(st, n, n.args[0], w.target, b.target if b is not None else None)
        n.replace_all_uses_with(out)
        return
    elif name == "layer_norm":
        arg = lambda i, k, default: n.args[i] if len(n.args) > i else n.kwargs.get(k, default)   # noqa: E731
        out = O._layer_norm(st, n, n.args[0], tuple(arg(1, "normalized_shape", ())), arg(2, "weight", None),
                            arg(3, "bias", None), arg(4, "eps", 1e-5))
        if out is not None:
            n.replace_all_uses_with(out)
            return
        x = st.specs.get(n.args[0], Spec2D())
        st.specs[n] = Spec2D(x.b, x.c if n not in st.region_of else None, x.idx)
        O.whole_norm_params(st, n, [a for a in list(n.args[2:4]) + [n.kwargs.get("weight"), n.kwargs.get("bias")]
                                    if isinstance(a, fx.Node)], st.specs[n.args[0]])
    else:
        base = inplace_base(n, st.gm)
        written = n.args[0] if base is not None else None
        st.specs[n] = _spec(st, n, base or name)
    region = st.region_of.get(n)
    if region is not None and isinstance(st.specs[n], Spec2D):
        st.specs[n].c, st.specs[n].idx = region.shard_dim(n), None
    if written is not None:
        _check_inplace(st, n, written)
    if name in R._VIEWS and isinstance(st.specs[n], Spec2D):
        _sizes(st, n, st.specs[n])
    size = OD.arg(n, 1, "split_size")
    if name == "split" and region is not None and isinstance(size, int):
        dim = OD.dim(n, 2, "dim", R._val(n.args[0]).dim())
        if region.shard_dim(n.args[0]) == dim:          # split sizes along the heads are local
            n.args = (n.args[0], size // st.q, *n.args[2:])
            n.kwargs = {k: v for k, v in n.kwargs.items() if k != "split_size"}


def _check_inplace(st: R._State, n: fx.Node, written: fx.Node) -> None:
    """An in-place op writes its first operand where it lives: every later reader of ``written`` reads
    that very tensor.  Its own rule: the output keeps the written operand's blocks, and only the other
    operands may be re-distributed; where the rule would cut or copy ``written`` itself, the write would
    land in the copy, so it is refused."""
    if not R._is_tensor(written):
        R._refuse(n, "an in-place op on a non-tensor")
    mine, out = st.specs.get(written, Spec2D()), st.specs[n]
    if written.op == "get_attr" or (mine.b, mine.c) != (out.b, out.c):
        R._refuse(n, f"it writes '{written.name}' in place, but its operands need '{written.name}' split "
                     f"differently (batch dim {mine.b} -> {out.b}, channel dim {mine.c} -> {out.c}); the write "
                     f"would land in a copy that later readers of '{written.name}' do not see")


def _spec(st: R._State, n: fx.Node, name: str):
    args = _tensors(n.args)
    in_region = n in st.region_of
    x = st.specs.get(n.args[0], Spec2D()) if n.args and isinstance(n.args[0], fx.Node) else Spec2D()
    if in_region:                                  # the region analysis owns the channel dim
        x = Spec2D(x.b, None, None)
    if name in R._UNARY:
        return Spec2D(x.b, x.c, x.idx)
    if name in R._BINARY:
        return R._align(st, n, args)
    if name in ("cat", "concat"):
        parts = list(n.args[0])
        out = R._align(st, n, parts)
        d = OD.dim(n, 1, "dim", R._val(n).dim())
        if d in (out.b, out.c) and not in_region:
            R._refuse(n, f"concatenating along the split dim {d}")
        return out
    if name in ("reshape", "view", "flatten", "unflatten", "permute", "transpose", "swapaxes", "swapdims", "t",
                "unsqueeze", "squeeze", "expand", "getitem"):
        return R._view_rule(st, n, name, x)
    if name in ("mean", "sum", "amax", "amin", "prod") + OD.SOFTMAX_LIKE:
        return R._reduce_rule(st, n, name, x)
    if name in ("chunk", "split", "unbind"):
        nd = R._val(n.args[0]).dim()
        d = OD.dim(n, 1, "dim", nd) if name == "unbind" else OD.dim(n, 2, "dim", nd)
        if d == x.b or (d == x.c and not in_region):
            R._refuse(n, f"{name} along the split dim {d}")
        one = R._moved(st, n, x, (lambda e, k: e - (e > d)) if name == "unbind" else (lambda e, k: e))
        return tuple(Spec2D(one.b, one.c, one.idx) for _ in R._val(n))
    if name in ("matmul", "bmm", "scaled_dot_product_attention"):
        nd = R._val(n).dim()
        if not in_region and any(st.specs.get(a, Spec2D()).c is not None for a in args):
            R._refuse(n, f"{name} on channel-split operands outside an attention region")
        bs = {st.specs.get(a, Spec2D()).b for a in args[:2]}
        if len(bs) != 1 or (None not in bs and next(iter(bs)) >= nd - 2):
            R._refuse(n, f"{name} whose operands are not split on the same batch dim")
        return Spec2D(next(iter(bs)))
    if name in ("dropout", "drop_path") or name.endswith("dropout"):
        return Spec2D(x.b, x.c, x.idx)
    if any(st.specs.get(a, Spec2D()).b is not None or st.specs.get(a, Spec2D()).c is not None for a in args):
        R._refuse(n, f"op '{name}' has no 2D rule")
    return Spec2D()
