"""Find the Megatron regions of a graph: column-parallel linears, the ops between, a row-parallel linear.

Terms:
  region  -- a row-parallel ``exit`` linear, the column-parallel ``entries`` (linears whose outputs
             reach the exit only through region ops), and the region ops between them.  Closed: no
             region value is used outside it.  In a transformer block: qkv -> attention -> proj, and
             fc1 -> act -> fc2 (SwiGLU's two fc1s are two entries of one region).
  shard   -- the factor class (passes/tp_layout.py) split across tp ranks: a factor every entry's
             output contains once, the exit's input contains, and no region op reduces over.  For
             attention that is the heads factor, found by elimination, not by name.
  note    -- why a linear that looked like an exit stays replicated (an op without a rule, a reduction
             over every candidate factor ...); the plan lists the notes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from autosplit.errors import AutosplitError, rule_failure
from autosplit.passes import op_dims as D
from autosplit.passes.op_names import inplace_base, op_name, writes_input
from autosplit.passes.tp_layout import Factors
from autosplit.passes.tp_region_reads import Unsupported as _Unsupported
from autosplit.passes.tp_region_reads import check_reads, inplace, is_tensorish as _is_tensorish, only_feeds

MAX_REGION = 200      # ops; a Megatron region is a handful, a walk that long has left the block
_UNARY_MODULES = (nn.Dropout, nn.Identity, nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Sigmoid)
_UNARY = {"gelu", "silu", "relu", "tanh", "sigmoid", "dropout", "neg", "contiguous", "to", "float", "half",
          "bfloat16", "type_as", "clone", "detach", "identity", "exp", "sqrt", "rsqrt", "erf", "abs"}
_BINARY = {"add", "mul", "sub", "truediv", "div", "pow"}
_REDUCTIONS = {"mean", "sum", "amax", "amin", "prod"}


@dataclass
class Region:
    exit: fx.Node
    entries: list[fx.Node]
    nodes: list[fx.Node]
    factors: Factors = field(default_factory=Factors)
    layouts: dict = field(default_factory=dict)     # node -> layout (or tuple of layouts)
    forbid: list[int] = field(default_factory=list)
    outside: list[tuple[fx.Node, int]] = field(default_factory=list)  # (op, out dim) with a replicated operand
    shard: set[int] = field(default_factory=set)    # the chosen factor class (leaf ids)
    shard_size: int = 0
    slice_reads: list = field(default_factory=list)  # (reader, tensor, dims): shape slices, checked by _choose

    @property
    def name(self) -> str:
        return self.exit.meta.get("module_path", "") or self.exit.name

    def shard_dim(self, node: fx.Node) -> int | None:
        """The tensor dim of ``node`` that holds the shard factor (None if replicated)."""
        layout = self.layouts.get(node)
        if not isinstance(layout, list):
            return None
        for d, dim in enumerate(layout):
            if set(self.factors.flat(dim)) & self.shard:
                return d
        return None


def params_used(gm: fx.GraphModule, node: fx.Node) -> list[str]:
    """Names of the parameters ``node`` reads: get_attr inputs, or the called module's own."""
    names = [a.target for a in node.all_input_nodes if a.op == "get_attr"]
    if node.op == "call_module":
        names += [f"{node.target}.{p}" for p, _ in gm.get_submodule(node.target).named_parameters()]
    return names


def _is_linear(node: fx.Node, gm: fx.GraphModule) -> bool:
    return node.op == "call_module" and type(gm.get_submodule(node.target)) is nn.Linear


def _collect(exit: fx.Node, gm: fx.GraphModule):
    """Entries and region ops behind ``exit``'s input, or None if the walk leaves a block.

    The walk goes back from the exit's input through every op's inputs, and forward to the in-place ops
    that write a region tensor (``h.add_(g)``, whose result nothing may read: it still changes ``h``
    for every later reader), so that such a write runs on the same shard as its readers."""
    entries, nodes, seen, stack = [], [], set(), [exit.args[0]]
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen or not _is_tensorish(n):
            continue
        seen.add(n)
        if _is_linear(n, gm):
            entries.append(n)
        elif n.op == "get_attr":
            continue                       # a parameter used by a region op (e.g. qk-norm weight)
        elif n.op == "placeholder" or len(nodes) >= MAX_REGION:
            return None
        else:
            nodes.append(n)
            stack.extend(n.all_input_nodes)
        stack.extend(u for u in n.users if u is not exit and writes_input(u) and u.args[:1] == (n,))
    if not entries:
        return None
    members = set(nodes) | {exit}
    for n in nodes + entries:
        for u in n.users:
            if u not in members and not only_feeds(u, members, set()):
                return None                # a region value escapes: not closed
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(entries, key=order.get), sorted(nodes, key=order.get)


class _Analysis:
    """Propagates layouts through one region's ops (rules per op) and records constraints.  Every dim
    an op reads goes through passes/op_dims.py (keyword, negative and implicit dims)."""

    def __init__(self, region: Region, gm: fx.GraphModule):
        self.r, self.gm, self.f = region, gm, region.factors
        self.node: fx.Node | None = None      # the op being analysed (named if a rule fails)

    def fresh(self, shape) -> list[list[int]]:
        return [[self.f.new(s)] for s in shape]

    def run(self) -> None:
        for e in self.r.entries:
            self.node = e
            shape = e.meta["val"].shape
            self.r.layouts[e] = self.fresh(shape[:-1]) + [[self.f.new(shape[-1])]]
            self.check_reads(e)
        for n in self.r.nodes:
            self.node = n
            if _is_tensorish(n):
                self.r.layouts[n] = self.rule(n)
                self.check_reads(n)
        self.node = None

    def check_reads(self, n: fx.Node) -> None:
        check_reads(n, self.gm, self.r.slice_reads)

    def lay(self, a):
        return self.r.layouts.get(a) if isinstance(a, fx.Node) else None

    def rule(self, n: fx.Node):
        base = inplace_base(n, self.gm)
        if base is None:
            return self.rule_as(n, op_name(n, self.gm))
        if base not in _UNARY | _BINARY:
            raise _Unsupported(f"in-place op '{op_name(n, self.gm)}' at '{n.name}' has no tensor-parallel rule")
        return inplace(self, n, base, lambda: self.rule_as(n, base))

    def rule_as(self, n: fx.Node, name: str):
        """The layout of ``n`` computed as the op ``name`` (an in-place op as its out-of-place base)."""
        x = self.lay(n.args[0]) if n.args else None
        if x is None and name not in _BINARY | {"matmul", "bmm", "scaled_dot_product_attention"}:
            raise _Unsupported(f"'{n.name}' ({name}) reads a tensor from outside the region")
        nd = len(x) if isinstance(x, list) else 0
        out_shape = n.meta["val"].shape if isinstance(n.meta["val"], torch.Tensor) else None
        if name in ("reshape", "view", "flatten", "unflatten"):
            layout = self.f.reshape(x, list(out_shape))
            if layout is None:
                raise _Unsupported(f"{name} at '{n.name}' regroups features in a way shards cannot follow")
            return layout
        if name == "permute":
            return [x[d] for d in D.permute_order(n, nd)]
        if name in ("transpose", "swapaxes", "swapdims"):
            a, b = D.transpose_dims(n, nd)
            x = list(x)
            x[a], x[b] = x[b], x[a]
            return x
        if name == "unbind":
            d = D.dim(n, 1, "dim", nd)
            return tuple(x[:d] + x[d + 1:] for _ in range(len(n.meta["val"])))
        if name == "getitem":
            if isinstance(x, tuple):
                return x[n.args[1]]
            raise _Unsupported(f"indexing a sharded tensor at '{n.name}'")
        if name in ("chunk", "split"):
            return self.chunk(n, x, name)
        if name == "unsqueeze":
            d = D.unsqueeze_dim(n, nd)
            return x[:d] + [[]] + x[d:]
        if name in _UNARY or (n.op == "call_module" and isinstance(self.gm.get_submodule(n.target), _UNARY_MODULES)):
            return x
        if name in _BINARY:
            return self.binary(n, out_shape)
        if name in ("layer_norm", "rms_norm", "LayerNorm", "RMSNorm"):
            shape = self.gm.get_submodule(n.target).normalized_shape if n.op == "call_module" else \
                D.arg(n, 1, "normalized_shape")
            k = 1 if isinstance(shape, int) else len(shape)
            self.forbid(x[nd - k:])
            return x
        if name in D.SOFTMAX_LIKE:
            module = self.gm.get_submodule(n.target) if n.op == "call_module" else None
            self.forbid([x[D.softmax_dim(n, nd, module)]])
            return x
        if name in _REDUCTIONS:
            dims = D.reduced_dims(n, nd)
            self.forbid([x[d] for d in dims])
            if D.keepdim(n):
                return [[] if d in dims else x[d] for d in range(nd)]
            return [x[d] for d in range(nd) if d not in dims]
        if name in ("matmul", "bmm"):
            return self.matmul(n)
        if name == "scaled_dot_product_attention":
            return self.sdpa(n)
        raise _Unsupported(f"op '{name}' at '{n.name}' has no tensor-parallel rule")

    def forbid(self, dims) -> None:
        for dim in dims:
            self.r.forbid.extend(self.f.flat(dim))

    def chunk(self, n, x, name):
        parts = len(n.meta["val"])
        d = D.dim(n, 2, "dim", len(x))
        sizes = {t.shape[d] for t in n.meta["val"]}
        if len(sizes) != 1:
            raise _Unsupported(f"uneven {name} at '{n.name}'")
        rest = self.f.split_leading(x[d], parts)
        if rest is None:
            raise _Unsupported(f"{name} at '{n.name}' does not split a whole factor")
        return tuple(x[:d] + [rest] + x[d + 1:] for _ in range(parts))

    def binary(self, n, out_shape):
        ndim = len(out_shape)
        out: list = [None] * ndim
        for a in (D.arg(n, 0, "input"), D.arg(n, 1, "other")):
            if not isinstance(a, fx.Node) or not isinstance(a.meta.get("val"), torch.Tensor):
                continue                      # a Python scalar
            shape, layout = a.meta["val"].shape, self.lay(a)
            for j in range(1, len(shape) + 1):
                if shape[-j] == 1:
                    continue
                if layout is None:
                    self.r.outside.append((n, ndim - j))     # a replicated operand along this dim
                elif out[-j] is None:
                    out[-j] = layout[-j]
                elif not self.f.align(out[-j], layout[-j]):
                    raise _Unsupported(f"'{n.name}' combines tensors whose feature dims do not line up")
        return [dim if dim is not None else [self.f.new(size)] for dim, size in zip(out, out_shape)]

    def matmul(self, n):
        a, b = (self.lay(t) for t in n.args[:2])
        if a is None or b is None:
            raise _Unsupported(f"matmul at '{n.name}' with an operand from outside the region")
        for da, db in zip(reversed(a[:-2]), reversed(b[:-2])):
            self.f.align(da, db)
        self.forbid([a[-1], b[-2]])
        batch = a[:-2] if len(a) >= len(b) else b[:-2]
        return batch + [a[-2], b[-1]]

    def sdpa(self, n):
        q, k, v = (self.lay(t) for t in n.args[:3])
        if q is None or k is None or v is None or D.arg(n, 3, "attn_mask") is not None:
            raise _Unsupported(f"attention at '{n.name}' with a mask or an operand from outside the region")
        for other in (k, v):
            for da, db in zip(q[:-2], other[:-2]):
                if not self.f.align(da, db):
                    raise _Unsupported(f"attention at '{n.name}': q, k, v batch dims do not line up")
        self.forbid([q[-1], k[-1], k[-2], v[-2]])
        return q[:-1] + [v[-1]]


def _choose(region: Region, tp: int) -> str | None:
    """Pick the shard factor class; returns None on success, else why no class works."""
    f = region.factors
    exit_in = region.layouts.get(region.exit.args[0])
    if not isinstance(exit_in, list):
        return "the row-parallel candidate's input is not a region tensor"
    forbidden = {leaf for x in region.forbid for leaf in f.leaves(x)}
    why = "no factor of its input features is split-able"
    for cand in f.flat(exit_in[-1]):
        if f.size[cand] == 1:
            continue
        cls = {g for g in range(len(f.size)) if f.find(g) == f.find(cand) and g not in f.children}
        if cls & forbidden:
            why = "every candidate factor is reduced over inside the region"
            continue
        roots = [f.flat(region.layouts[e][-1]) for e in region.entries]
        if any(len(set(r) & cls) != 1 for r in roots):
            why = "the entries' features do not all carry the same split factor"
            continue
        if any(set(f.flat(region.layouts[n][d])) & cls for n, d in region.outside):
            why = "a replicated operand broadcasts over the split factor"
            continue
        sliced = next(((u, n, d) for u, n, dims in region.slice_reads for d in dims
                       if set(f.flat(region.layouts[n][d])) & cls), None)
        if sliced is not None:
            u, n, d = sliced
            why = (f"'{u.name}' reads a slice of the shape of '{n.name}' that includes dim {d}, the split one: "
                   f"those sizes would be local (1/tp); index the sizes one by one (x.shape[i])")
            continue
        region.shard, region.shard_size = cls, f.size[cand]
        return None
    return why


def find_regions(gm: fx.GraphModule, tp: int, ranks: str | None = None) -> tuple[list[Region], list[str]]:
    """Regions to shard across ``tp`` ranks, and notes on candidates left replicated.  ``ranks`` names
    those ranks in errors (default ``tp(N)``; 2D splits heads over its grid's ``tp_col`` axis only)."""
    regions, notes, claimed = [], [], set()
    for node in gm.graph.nodes:
        if not _is_linear(node, gm) or node in claimed:
            continue
        found = _collect(node, gm)
        if found is None:
            continue
        entries, nodes = found
        if set(entries) & claimed:
            continue
        region = Region(exit=node, entries=entries, nodes=nodes)
        analysis = _Analysis(region, gm)
        try:
            analysis.run()
            why = _choose(region, tp)
        except _Unsupported as exc:
            why = str(exc)
        except AutosplitError:
            raise
        except Exception as exc:        # noqa: BLE001  (a rule of ours failed: name the op it was reading)
            raise rule_failure("the tensor-parallel region analysis", analysis.node or node, exc) from exc
        if why:
            notes.append(f"'{region.name}' and its inputs {[e.meta.get('module_path') for e in entries]} stay "
                         f"replicated: {why}")
            continue
        if region.shard_size % tp:
            raise AutosplitError(
                f"layer '{region.name}': the dim split across tensor-parallel ranks has size "
                f"{region.shard_size} (e.g. attention heads), which does not divide by {ranks or f'tp({tp})'}; "
                f"use a {'grid' if ranks else 'tp'} that divides {region.shard_size}")
        regions.append(region)
        claimed.update(entries + [node])
    return regions, notes
