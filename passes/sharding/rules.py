"""The sharding engine's rules: for each op, how its output's dims come from its operands'.  Which
rule an op takes is the registry's (passes/op_registry.py, ``shard``: the method ``"_" + shard`` here);
the module classes with parameters (Linear, convolutions, norms) are taken first; an
``nn.MultiheadAttention`` reaches the engine as its ops (passes/decompose_attention.py) or stays opaque.

Terms (factors, classes, layouts: passes/sharding/factors.py):
  OpRule    -- what one node does to dims: its output layout (a tuple of layouts for chunk/unbind/
               a module's tuple), its tensor operands with the layouts they are paired by, and the
               leaves it ``contract``s (sums over: a linear's input features, a matmul's k, ``sum``; a
               shard of one gives a Partial output), ``forbid``s (needs whole: softmax's dim, a norm's
               normalized dims, attention's head_dim and key tokens) and whether it is ``linear`` in
               its operands (a Partial operand may pass through: "all" of them together as in add,
               "one" of them with the others Replicate as in mul and matmul, or only the "first").
  opaque    -- an op without a rule: its operands must be Replicate and its output is new dims, so the
               engine still plans around it (the redistribution before it is priced) and the summary
               names it.
  params    -- for a call_module node, its own parameters' layouts (the Linear's weight is [out, in]).
  stats     -- a layer norm's normalized dim: needed whole, except under 2D, whose layer_norm_2d sums
               the statistics over the split features (``sum_stats``).
  rowwise   -- the registry's (passes/op_registry.py ``rowwise``: every index of the dims the op keeps is
               computed from the same index alone): a dim padded to a multiple of the ranks (sequence
               parallelism's 17 tokens on 2 ranks) may stay split through it, the padding rows computing
               values nobody reads.  A module is read by its class (``module_entry``); an op without a
               rule (opaque) is never row-wise.
Every dim an op reads goes through passes/op_dims.py (keyword, negative and implicit dims).
The rule of an in-place op is its out-of-place base's; the strategy then keeps the written operand's
placement (passes/sharding/strategies.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from autosplit.passes import op_dims as D
from autosplit.passes.decompose_attention import kept_reason
from autosplit.passes.op_names import inplace_base, op_name
from autosplit.passes.op_registry import OPAQUE, module_entry, op
from autosplit.passes.sharding.factors import Factors

@dataclass
class OpRule:
    out: object                                   # layout, tuple of layouts, or None (not a tensor)
    operands: list = field(default_factory=list)  # (node, layout) per tensor operand, in argument order
    contract: set = field(default_factory=set)
    forbid: set = field(default_factory=set)
    linear: str = ""                              # "all" | "one" | "first" | ""
    kind: str = "op"                              # "op" | "view" | "opaque" | "input" | "param" | "linear"
    params: dict = field(default_factory=dict)    # call_module: param name -> layout
    why: str = ""                                 # opaque: why no rule applies
    rowwise: bool = False                         # each index of a kept dim is computed alone (padding-safe)
    stats: set = field(default_factory=set)       # forbidden leaves a grid may split with partial statistics


def is_tensor(n) -> bool:
    return isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)


def tensorish(n) -> bool:
    """Does ``n`` hold a tensor, or a tuple of them (chunk, unbind, a module's outputs)?"""
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    if isinstance(val, torch.Tensor):
        return True
    return isinstance(val, (tuple, list)) and not isinstance(val, torch.Size) and \
        any(isinstance(v, torch.Tensor) for v in val)


class Rules:
    """Applies the table node by node; ``layouts`` holds every tensor node's layout so far."""

    def __init__(self, gm: fx.GraphModule, f: Factors):
        self.gm, self.f = gm, f
        self.layouts: dict[fx.Node, object] = {}

    def fresh(self, shape) -> list[list[int]]:
        return [[self.f.new(s)] for s in shape]

    def lay(self, a):
        if not isinstance(a, fx.Node):
            return None
        if a not in self.layouts and is_tensor(a):
            self.layouts[a] = self.fresh(a.meta["val"].shape)      # a tensor made outside any rule
        return self.layouts.get(a)

    def opaque(self, n: fx.Node, why: str) -> OpRule:
        val = n.meta.get("val")
        out = self.fresh(val.shape) if isinstance(val, torch.Tensor) else \
            tuple(self.fresh(v.shape) if isinstance(v, torch.Tensor) else None for v in val) if tensorish(n) else None
        ops = [(a, self.lay(a)) for a in n.all_input_nodes if is_tensor(a)]
        return OpRule(out, ops, kind="opaque", why=why)

    def rule(self, n: fx.Node) -> OpRule:
        if n.op == "placeholder":
            return OpRule(self.fresh(n.meta["val"].shape), kind="input") if is_tensor(n) else OpRule(None)
        if n.op == "get_attr":
            return OpRule(self.fresh(n.meta["val"].shape), kind="param") if is_tensor(n) else OpRule(None)
        if n.op == "output" or not tensorish(n):
            return OpRule(None)
        base = inplace_base(n, self.gm)
        name = base or op_name(n, self.gm)
        module = self.gm.get_submodule(n.target) if n.op == "call_module" else None
        try:
            r = self._rule(n, name, module)
        except _NoRule as exc:
            return self.opaque(n, str(exc))
        if base is not None and (not r.operands or r.operands[0][0] is not D.nth(n, 0)):
            return self.opaque(n, f"in-place '{name}' without its written tensor first")
        entry = module_entry(module) if module is not None else op(n, self.gm)
        # a rule may know more than the registry: matmul, softmax and attention are row-wise in every dim
        # they neither sum over nor need whole (the registry's flag also means "in dim 0", which
        # passes/tp_overlap.py chunks, and a 2-D matmul's dim 0 of its second operand is summed over)
        r.rowwise = (entry.rowwise or r.rowwise) and r.kind != "opaque"
        return r

    # -- the table: the registry names each op's method (passes/op_registry.py, ``shard``) ---------------
    def _rule(self, n: fx.Node, name: str, module) -> OpRule:
        x = self.lay(D.nth(n, 0))                     # the first argument, positional or by keyword
        nd = len(x) if isinstance(x, list) else 0
        if type(module) is nn.Linear:          # a subclass may have its own forward: opaque
            return self._linear(n, x, module.out_features, module.bias is not None, kind="linear")
        if isinstance(module, nn.MultiheadAttention):
            # plain self-attention reached the engine as its ops (passes/decompose_attention.py)
            raise _NoRule(f"nn.MultiheadAttention kept whole ({kept_reason(n, module) or 'not decomposed'})")
        if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            return self._conv(n, x, nd, OPAQUE, module)
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            return self._norm(n, x, nd, OPAQUE, module)
        entry = op(n, self.gm)
        if not entry.shard:
            raise _NoRule(f"'{name}' has no sharding rule")
        if entry.lower and set(n.kwargs) & _SIZE_KEYWORDS:
            # the lowering makes sizes local where they are given positionally (lower.py local_view,
            # local_unflatten, split's size): by keyword they would stay global on split ranks
            raise _NoRule(f"'{name}' with its sizes by keyword ({', '.join(sorted(set(n.kwargs) & _SIZE_KEYWORDS))})")
        return getattr(self, "_" + entry.shard)(n, x, nd, entry, module)

    def _linear_fn(self, n, x, nd, entry, module) -> OpRule:
        w, b = D.named(n, 1, "weight"), D.named(n, 2, "bias")
        r = self._linear(n, x, n.meta["val"].shape[-1], b is not None, w=self.lay(w), kind="op")
        r.operands.append((w, self.lay(w)))
        if b is not None:
            self._align(self.lay(b)[0], r.out[-1])
            r.operands.append((b, self.lay(b)))
        return r

    def _unary(self, n, x, nd, entry, module) -> OpRule:
        return OpRule(x, [(D.nth(n, 0), x)], linear=entry.linear_in)

    def _view(self, n, x, nd, entry, module) -> OpRule:
        if any(isinstance(a, torch.dtype) for a in (*n.args, *n.kwargs.values())):
            raise _NoRule(f"{op_name(n, self.gm)} to a dtype reinterprets the bytes, no sizes to make local")
        val = n.meta["val"]
        out = self.f.reshape(x, list(val.shape))
        if out is None:
            raise _NoRule(f"{op_name(n, self.gm)} to {tuple(val.shape)} regroups dims no factor survives")
        return OpRule(out, [(D.nth(n, 0), x)], linear="first", kind="view")

    def _expand(self, n, x, nd, entry, module) -> OpRule:
        shape, src = list(n.meta["val"].shape), D.nth(n, 0).meta["val"].shape
        k = len(shape) - len(src)
        out = [[self.f.new(s)] for s in shape[:k]] + \
              [x[i] if src[i] == shape[k + i] else [self.f.new(shape[k + i])] for i in range(len(src))]
        return OpRule(out, [(D.nth(n, 0), x)], linear="first", kind="view")

    def _permute(self, n, x, nd, entry, module) -> OpRule:
        return OpRule([x[d] for d in D.permute_order(n, nd)], [(D.nth(n, 0), x)], linear="first")

    def _transpose(self, n, x, nd, entry, module) -> OpRule:
        # x.t() takes no dims: it swaps the first and the last
        a, b = D.transpose_dims(n, nd) if len(n.args) > 1 or n.kwargs else (0, nd - 1)
        out = list(x)
        out[a], out[b] = out[b], out[a]
        return OpRule(out, [(D.nth(n, 0), x)], linear="first")

    def _unsqueeze(self, n, x, nd, entry, module) -> OpRule:
        d = D.unsqueeze_dim(n, nd)
        return OpRule(x[:d] + [[self.f.new(1)]] + x[d:], [(D.nth(n, 0), x)], linear="first")

    def _squeeze(self, n, x, nd, entry, module) -> OpRule:
        gone = D.squeeze_dims(n, D.nth(n, 0).meta["val"].shape)
        return OpRule([x[d] for d in range(nd) if d not in gone], [(D.nth(n, 0), x)], linear="first")

    def _unbind(self, n, x, nd, entry, module) -> OpRule:
        d = D.dim(n, 1, "dim", nd)
        return OpRule(tuple(x[:d] + x[d + 1:] for _ in n.meta["val"]), [(D.nth(n, 0), x)], linear="first")

    def _scan(self, n, x, nd, entry, module) -> OpRule:     # a running sum / product along one dim
        return OpRule(x, [(D.nth(n, 0), x)], forbid=self._leaves([x[D.dim(n, 1, "dim", nd)]]), linear=entry.linear_in)

    def _softmax(self, n, x, nd, entry, module) -> OpRule:
        return OpRule(x, [(D.nth(n, 0), x)], forbid=self._leaves([x[D.softmax_dim(n, nd, module)]]), rowwise=True)

    def _whole_keys(self, n, x, nd, entry, module) -> OpRule:
        # the marked dim gets a class of its own, needed whole here: passes/sharding/context.py
        d = D.dim(n, 1, "dim", nd)
        out = list(x)
        out[d] = [self.f.new(n.meta["val"].shape[d])]
        return OpRule(out, [(D.nth(n, 0), x)], forbid=self._leaves([x[d]]), linear="first")

    def _reduce(self, n, x, nd, entry, module) -> OpRule:
        dims = D.reduced_dims(n, nd)
        out = [[self.f.new(1)] if d in dims else x[d] for d in range(nd)] if D.keepdim(n) else \
            [x[d] for d in range(nd) if d not in dims]
        leaves = self._leaves([x[d] for d in dims])
        val = n.meta["val"]
        if isinstance(val, tuple):                 # x.max(dim): (values, indices), both of the reduced layout
            if entry.reduce == "partial" or len(val) != 2:
                raise _NoRule(f"{op_name(n, self.gm)} returning {len(val)} values")
            return OpRule((out, list(out)), [(D.nth(n, 0), x)], forbid=leaves)
        if entry.reduce == "partial":
            return OpRule(out, [(D.nth(n, 0), x)], contract=leaves, linear="first")
        return OpRule(out, [(D.nth(n, 0), x)], forbid=leaves)

    def _embedding(self, n, x, nd, entry, module) -> OpRule:
        """F.embedding(input, weight) and torch.embedding(weight, indices): rows of the weight gathered."""
        table = D.named(n, 1, "weight")
        index = D.named(n, 0, "input") if D.named(n, 0, "input") is not table else None
        index = D.named(n, 1, "indices") if index is None else index
        w, x = self.lay(table), self.lay(index)
        if w is None or x is None:
            raise _NoRule("an embedding of a non-tensor")
        return OpRule(x + [w[1]], [(index, x), (table, w)], forbid=self._leaves([w[0]]))

    def _leaves(self, dims) -> set[int]:
        return {leaf for d in dims for leaf in self.f.flat(d)}

    def _align(self, a, b) -> None:
        if not self.f.align(a, b):
            raise _NoRule("operand dims do not pair")

    def _linear(self, n, x, out_features: int, bias: bool, w=None, kind="linear") -> OpRule:
        if x is None:
            raise _NoRule("a linear of a non-tensor")
        if w is None:
            w = [[self.f.new(out_features)], [self.f.new(D.nth(n, 0).meta["val"].shape[-1])]]
        self._align(x[-1], w[1])
        out = x[:-1] + [w[0]]
        params = {"weight": w, "bias": [w[0]]} if bias else {"weight": w}
        return OpRule(out, [(D.nth(n, 0), x)], contract=self._leaves([x[-1]]), linear="one" if not bias else "",
                      kind=kind, params=params if kind == "linear" else {})

    def _conv(self, n, x, nd, entry, module) -> OpRule:
        """(B, Cin, *spatial) -> (B, Cout, *spatial'): the batch passes, Cin is summed over (one group),
        the output channels are the weight's; spatial dims are new (a window mixes them)."""
        groups = module.groups if module is not None else D.named(n, 6, "groups", 1)
        if x is None or groups != 1:
            raise _NoRule("a grouped convolution")
        w = self.fresh(module.weight.shape) if module is not None else self.lay(D.named(n, 1, "weight"))
        self._align(x[1], w[1])
        val = n.meta["val"]
        out = [x[0], w[0]] + [[self.f.new(s)] for s in val.shape[2:]]
        ops = [(D.nth(n, 0), x)]
        params = {}
        if module is None:
            ops.append((D.named(n, 1, "weight"), w))
            b = D.named(n, 2, "bias")
            if is_tensor(b):
                self._align(self.lay(b)[0], w[0])
                ops.append((b, self.lay(b)))
        else:
            params = {"weight": w, **({"bias": [w[0]]} if module.bias is not None else {})}
        if module is not None:          # a module's weight is no graph value: the layout only (2D functionalizes)
            return OpRule(out, ops, forbid=self._leaves(x[1:]), params=params, kind="opaque",
                          why="a convolution module runs whole (its batch and output channels still pair with "
                              "the model's dims)")
        return OpRule(out, ops, contract=self._leaves([x[1]]), forbid=self._leaves(x[2:]))

    def _norm(self, n, x, nd, entry, module) -> OpRule:
        shape = module.normalized_shape if module is not None and hasattr(module, "normalized_shape") else \
            D.named(n, 1, "normalized_shape")
        k = 1 if isinstance(shape, int) else len(shape)
        ops = [(D.nth(n, 0), x)]
        params = {}
        for i, key in ((2, "weight"), (3, "bias")) if module is None else ():
            p = D.named(n, i, key)
            if is_tensor(p):
                self._align_trailing(self.lay(p), x)
                ops.append((p, self.lay(p)))
        if module is not None:
            for key in ("weight", "bias"):
                if getattr(module, key, None) is not None:
                    params[key] = x[nd - k:]
        stats = self._leaves(x[nd - 1:]) if entry.lower == "stats" and k == 1 else set()
        return OpRule(x, ops, forbid=self._leaves(x[nd - k:]), params=params, stats=stats)

    def _align_trailing(self, a, out) -> None:
        for j in range(1, len(a) + 1):
            if self.f.flat(a[-j]):
                self._align(a[-j], out[-j])

    def _elementwise(self, n, x, nd, entry, module) -> OpRule:
        """Every tensor operand, positional or keyword, broadcast against the others (where, addcmul)."""
        return self._broadcast(n, [a for a in (*n.args, *n.kwargs.values()) if is_tensor(a)], entry.linear_in)

    def _binary(self, n, x, nd, entry, module) -> OpRule:
        a, b = D.nth(n, 0), D.nth(n, 1)        # input and other / exponent, positional or by keyword
        linear = entry.linear_in
        if linear == "first" and is_tensor(b) and not is_tensor(a):
            linear = ""                        # 1 / P: not linear in its Partial operand
        if linear == "all" and any(not is_tensor(v) and v != 0 for v in (a, b)):
            linear = ""                        # P + 1: every rank would add the 1
        return self._broadcast(n, [v for v in (a, b) if is_tensor(v)], linear)

    def _broadcast(self, n, tensors, linear) -> OpRule:
        """Operands broadcast against each other: dims of size 1 take none of the output's."""
        shape = list(n.meta["val"].shape)
        out: list = [None] * len(shape)
        for a in tensors:
            la, sa = self.lay(a), a.meta["val"].shape
            for j in range(1, len(sa) + 1):
                if sa[-j] == 1:
                    continue
                if out[-j] is None:
                    out[-j] = la[-j]
                else:
                    self._align(la[-j], out[-j])
        out = [d if d is not None else [self.f.new(s)] for d, s in zip(out, shape)]
        return OpRule(out, [(a, self.lay(a)) for a in tensors], linear=linear)

    def _chunk(self, n, x, nd, entry, module) -> OpRule:
        name = op_name(n, self.gm)
        val = n.meta["val"]
        d = D.dim(n, 2, "dim", nd)
        if len({t.shape[d] for t in val}) != 1 or not isinstance(D.nth(n, 1), int):
            raise _NoRule(f"uneven {name}")
        rest = self.f.split_leading(x[d], len(val))
        if rest is None:
            raise _NoRule(f"{name} into {len(val)} does not split the dim's outermost factor")
        return OpRule(tuple(x[:d] + [rest] + x[d + 1:] for _ in val), [(D.nth(n, 0), x)], linear="first")

    def _getitem(self, n, x, nd, entry, module) -> OpRule:
        src, idx = n.args[0], n.args[1]
        if isinstance(self.layouts.get(src), tuple):          # an element of chunk / unbind / MHA
            return OpRule(self.layouts[src][idx], [(src, self.layouts[src][idx])], linear="first")
        if x is None:
            raise _NoRule("indexing a non-tensor")
        items = list(idx) if isinstance(idx, tuple) else [idx]
        if sum(1 for i in items if isinstance(i, fx.Node)) == 1 and len(items) == 1:
            index = items[0]                                   # table[idx]: gathers rows of dim 0
            li = self.lay(index)
            return OpRule(li + x[1:], [(src, x), (index, li)], forbid=self._leaves([x[0]]))
        if any(i is Ellipsis for i in items):
            k = items.index(Ellipsis)
            fill = nd - (len(items) - 1 - sum(1 for i in items if i is None))
            items = items[:k] + [slice(None)] * fill + items[k + 1:]
        out, forbid, d = [], [], 0
        size = D.nth(n, 0).meta["val"].shape
        for i in items:
            if i is None:
                out.append([self.f.new(1)])
            elif isinstance(i, slice) and _whole(i, size[d] if d < len(size) else None):
                out.append(x[d])
                d += 1
            elif isinstance(i, slice) or (isinstance(i, int) and not isinstance(i, bool)):
                forbid.append(x[d])
                if isinstance(i, slice):
                    out.append([self.f.new(n.meta["val"].shape[len(out)])])
                d += 1
            else:
                raise _NoRule("indexing with tensors or lists")
        out += x[d:]
        return OpRule(out, [(src, x)], forbid=self._leaves(forbid), linear="first")

    def _field(self, n, x, nd, entry, module) -> OpRule:
        """A named field of a tuple value (``x.max(1).indices``): that element's layout, as ``getitem``."""
        src, name = n.args[0], n.args[1]
        fields = getattr(type(src.meta.get("val")), "__match_args__", ()) if isinstance(src, fx.Node) else ()
        if not isinstance(self.layouts.get(src), tuple) or name not in fields:
            raise _NoRule(f"'{op_name(n, self.gm)}' has no sharding rule")
        lay = self.layouts[src][fields.index(name)]
        return OpRule(lay, [(src, lay)], linear="first")

    def _parts(self, n) -> tuple[list, list]:
        tensors = [a for a in (D.arg(n, 0, "tensors") or []) if is_tensor(a)]
        if not tensors:
            raise _NoRule(f"{op_name(n, self.gm)} of no tensors")
        return tensors, [self.lay(a) for a in tensors]

    def _stack(self, n, x, nd, entry, module) -> OpRule:
        tensors, lays = self._parts(n)
        d = D.dim(n, 1, "dim", len(lays[0]) + 1)
        for la in lays[1:]:
            for a, b in zip(la, lays[0]):
                self._align(a, b)
        out = lays[0][:d] + [[self.f.new(len(tensors))]] + lays[0][d:]
        return OpRule(out, [(a, la) for a, la in zip(tensors, lays)], linear="all")

    def _cat(self, n, x, nd, entry, module) -> OpRule:
        tensors, lays = self._parts(n)
        nd = len(lays[0])
        d = D.dim(n, 1, "dim", nd)
        for la in lays[1:]:
            for k in range(nd):
                if k != d:
                    self._align(la[k], lays[0][k])
        sizes = {a.meta["val"].shape[d] for a in tensors}
        forbid = set()
        if len(sizes) == 1:                              # equal parts: (parts, part) with parts aligned
            for la in lays[1:]:
                self._align(la[d], lays[0][d])
            cat_dim = [self.f.new(len(tensors))] + lays[0][d]
        else:
            cat_dim = [self.f.new(n.meta["val"].shape[d])]
            forbid = self._leaves([la[d] for la in lays])
        out = lays[0][:d] + [cat_dim] + lays[0][d + 1:]
        return OpRule(out, [(a, la) for a, la in zip(tensors, lays)], forbid=forbid, linear="all")

    def _matmul(self, n, x, nd, entry, module) -> OpRule:
        a, b = D.nth(n, 0), D.nth(n, 1)        # input and other / mat2, positional or by keyword
        la, lb = self.lay(a), self.lay(b)
        if la is None or lb is None or len(la) < 2 or len(lb) < 2:
            raise _NoRule("matmul with a vector or non-tensor operand")
        self._align(la[-1], lb[-2])
        for da, db in zip(reversed(la[:-2]), reversed(lb[:-2])):
            if self.f.flat(da) and self.f.flat(db):
                self._align(da, db)
        batch = la[:-2] if len(la) >= len(lb) else lb[:-2]
        return OpRule(batch + [la[-2], lb[-1]], [(a, la), (b, lb)], contract=self._leaves([la[-1]]), linear="one",
                      rowwise=True)

    def _sdpa(self, n, x, nd, entry, module) -> OpRule:
        q, k, v = D.nth(n, 0), D.nth(n, 1), D.nth(n, 2)
        lq, lk, lv = self.lay(q), self.lay(k), self.lay(v)
        if lq is None or lk is None or lv is None:
            raise _NoRule("attention with a non-tensor operand")
        for other in (lk, lv):
            for da, db in zip(lq[:-2], other[:-2]):
                self._align(da, db)
        self._align(lq[-1], lk[-1])
        self._align(lk[-2], lv[-2])
        ops = [(q, lq), (k, lk), (v, lv)]
        mask = D.named(n, 3, "attn_mask")
        if is_tensor(mask):
            scores = lq[:-1] + [lk[-2]]
            self._align_trailing(self.lay(mask), scores)
            ops.append((mask, self.lay(mask)))
        return OpRule(lq[:-1] + [lv[-1]], ops, forbid=self._leaves([lq[-1], lk[-2]]), rowwise=True)

    def _pad(self, n, x, nd, entry, module) -> OpRule:
        """F.pad(x, pad, mode, value): a dim padded by 0 on both sides keeps its class; a padded dim is new
        and its input needed whole (a rank's rows would take another rank's padding).  Linear in x except
        for a constant pad of a value other than 0 (every rank of a Partial sum would add it)."""
        amounts = [_planned(a) for a in (D.named(n, 1, "pad") or ())]
        if x is None or len(amounts) % 2 or not all(isinstance(a, int) for a in amounts):
            raise _NoRule("pad amounts not known as ints when planning")
        padded = {nd - 1 - k // 2 for k, a in enumerate(amounts) if a != 0}     # pairs from the last dim
        out = [[self.f.new(n.meta["val"].shape[d])] if d in padded else x[d] for d in range(nd)]
        mode, value = D.named(n, 2, "mode", "constant"), D.named(n, 3, "value", None)
        linear = "first" if mode != "constant" or value in (None, 0, 0.0) else ""
        return OpRule(out, [(D.nth(n, 0), x)], forbid=self._leaves([x[d] for d in padded]), linear=linear,
                      rowwise=True)

    def _einsum(self, n, x, nd, entry, module) -> OpRule:
        """torch.einsum(equation, *operands): one class per subscript letter (a letter's dims paired across
        operands, a size-1 dim broadcast), the letters the output drops summed over (``contract``), as a
        matmul generalised.  A letter twice in one operand (a diagonal) has no rule."""
        ops, letters, rhs = einsum_terms(n)
        lays = [self.lay(a) for a in ops]
        where: dict[str, tuple] = {}
        for t, la, a in zip(letters, lays, ops):
            for c, dim, size in zip(t, la, a.meta["val"].shape):
                if c not in where or where[c][1] == 1:
                    where[c] = (dim, size)
                elif size != 1:
                    self._align(dim, where[c][0])
        out = [where[c][0] for c in rhs]
        summed = self._leaves([where[c][0] for c in where if c not in rhs])
        return OpRule(out, [(a, la) for a, la in zip(ops, lays)], contract=summed,
                      linear="one" if len(ops) > 1 else "first", rowwise=True)


def einsum_terms(n: fx.Node) -> tuple[list, list[str], str]:
    """(operands, each operand's subscripts, the output's) of a ``torch.einsum`` node, every "..."
    spelled out as the broadcast dims "0", "1", ... it covers (aligned from the right) and an implicit
    output made explicit (the letters seen once, in alphabetical order, after the broadcast dims)."""
    eq, ops = n.args[0] if n.args else None, list(n.args[1:])
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    if not isinstance(eq, str) or not ops or not all(is_tensor(a) for a in ops):
        raise _NoRule("einsum with its equation or operands not given positionally")
    lhs, arrow, rhs = eq.replace(" ", "").partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ops):
        raise _NoRule(f"einsum '{eq}' names {len(terms)} operands, has {len(ops)}")
    ndims = [a.meta["val"].dim() for a in ops]
    span = max((nd - len(t.replace("...", "")) for t, nd in zip(terms, ndims) if "..." in t), default=0)
    letters = [_spell(t, nd, span) for t, nd in zip(terms, ndims)]
    if any(len(set(t)) != len(t) for t in letters):
        raise _NoRule(f"einsum '{eq}' takes a diagonal")
    if arrow:
        rhs = _spell(rhs, None, span)
    else:
        seen = [c for t in letters for c in t]
        rhs = "".join(str(k) for k in range(span)) + "".join(sorted(c for c in set(seen)
                                                                    if seen.count(c) == 1 and c.isalpha()))
    return ops, letters, rhs


def _spell(term: str, ndim: int | None, span: int) -> str:
    """``term`` with "..." replaced by the broadcast dims it covers (the last of ``span`` of them)."""
    if "..." not in term:
        if ndim is not None and len(term) != ndim:
            raise _NoRule(f"einsum term '{term}' for a {ndim}-D operand")
        return term
    pre, _, post = term.partition("...")
    k = span if ndim is None else ndim - len(pre) - len(post)
    return pre + "".join(str(j) for j in range(span - k, span)) + post


def _planned(a):
    """An argument's value when planning: a node's (shape arithmetic: meta['val']), or the argument itself."""
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def _whole(i: slice, size: int | None) -> bool:
    """Does slice ``i`` keep every index of a dim of ``size`` (``x[:, :H]`` where the dim has H, read from
    the bounds' planned values)?  Then it keeps the dim's class: on a rank holding part of the dim it still
    keeps every local index, since a stop >= the whole size is >= the part's."""
    start, stop, step = _planned(i.start), _planned(i.stop), _planned(i.step)
    return start in (None, 0) and step in (None, 1) and (stop is None or (isinstance(stop, int) and size is not None
                                                                           and stop >= size))


_SIZE_KEYWORDS = {"size", "shape", "sizes", "split_size", "split_size_or_sections"}


class _NoRule(Exception):
    """Why an op is opaque (the summary lists it)."""
