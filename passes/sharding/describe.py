"""What the engine chose, in words: per layer how it is split, what stayed whole and why, and the
candidates of one op with their costs (``plan.explain``).

Terms (place, strategy: strategies.py; Sharding: engine.py):
  layer    -- a node that holds a weight or mixes heads: a Linear (module or ``F.linear``), or an
              attention (``scaled_dot_product_attention``, or a ``matmul`` of two activations:
              ``q @ k^T``, ``attn @ v``).
  column / row -- a Linear split by output features / by input features (its sum reduced after).
  by <dims> -- a Linear whose input is split on other dims (tokens, batch): its weight stays whole.
  block    -- report/tp_tables.py's: the module path up to its first numbered part; identical lines of
              consecutive blocks are printed once ("blocks.0-11").
"""
from __future__ import annotations

import re

import torch.fx as fx

from autosplit.errors import AutosplitError
from autosplit.passes.op_names import op_name
from autosplit.passes.op_registry import functional_linear, op
from autosplit.passes.sharding.engine import priced
from autosplit.passes.sharding.strategies import P, R, edge_bytes


def _is_layer(sh, v: fx.Node) -> bool:
    rule = sh.nodes[v].rule
    kind = op(v, sh.gm).kind
    if rule.kind == "linear" or kind in ("linear", "attention"):
        return True
    return kind == "gemm" and all(a.op != "get_attr" for a, _ in rule.operands)   # two activations


def _dims(sh, v: fx.Node, cls: int) -> str:
    """'dim d (size s)' of class ``cls`` in ``v``'s output or first operand."""
    for lay in (sh.nodes[v].rule.out, sh.nodes[v].rule.operands[0][1] if sh.nodes[v].rule.operands else None):
        if isinstance(lay, list):
            w = sh.enum.where(lay, cls)
            if w is not None:
                return f"dim {w[0]} ({sh.factors.size[w[1]]} -> {sh.factors.size[w[1]] // sh.n} per rank)"
    return f"{sh.factors.size[sh.factors.members(cls)[0]]} features"


def _features(sh, weight_dim, cls) -> str:
    """'96 features by 4 heads' when the split class is a factor of the dim, else '64 features'."""
    total = 1
    for leaf in sh.factors.flat(weight_dim):
        total *= sh.factors.size[leaf]
    k = sh.factors.size[sh.factors.members(cls)[0]]
    per = f"{total // sh.n} per rank"
    return f"{total} features ({per})" if k == total else f"{total} features by a factor of {k} ({per})"


def how(sh, v: fx.Node) -> str:
    """How layer ``v`` runs: 'column', 'row', 'by heads', ..., or 'whole: <why>'."""
    s, rule = sh.chosen[v], sh.nodes[v].rule
    size = lambda: sh.factors.size[sh.factors.members(s.cls)[0]]   # noqa: E731
    if rule.kind == "linear" or functional_linear(v):
        split = dict(s.params).get("weight")
        w = rule.params.get("weight")
        if rule.kind == "op":
            w = rule.operands[1][1]
            split = sh.enum.where(w, s.cls)[0] if s.cls is not None and len(s.ins) > 1 and s.ins[1] != R else None
        if split == 0:
            return f"column, output {_features(sh, w[0], s.cls)}"
        if split == 1:
            return f"row, input {_features(sh, w[1], s.cls)}, summed after"
        if s.out == P:
            return "partial input, weight whole"
        if s.sharded:
            return f"by {_dims(sh, v, s.cls)}, weight whole"
    elif s.sharded:
        return f"split on {_dims(sh, v, s.cls)}" if s.cls is not None else "partial"
    return "whole: " + why_whole(sh, v)


def why_whole(sh, v: fx.Node) -> str:
    ns = sh.nodes[v]
    if len(ns.options) > 1:
        return "not profitable (the cost model prices every split above keeping it whole)"
    rule = ns.rule
    dims = rule.params.get("weight") or \
        (rule.operands[1][1] if functional_linear(v) else None)
    if not dims:
        return ns.why_whole or "no strategy splits it"
    f, reasons = sh.factors, []
    needed = _needed_whole(sh)
    for leaf in [x for d in dims for x in f.flat(d)]:
        size, c = f.size[leaf], f.find(leaf)
        if size % sh.n and c not in sh.enum.padded:
            reasons.append(f"{size} does not divide by {sh.n}")
        elif c in needed:
            block = _block_of(v)
            u = next((w for w in needed[c] if _block_of(w) == block), needed[c][0])
            reasons.append(f"{size} is needed whole by '{u.name}' ({op_name(u, sh.gm)}, in "
                           f"'{u.meta.get('module_path') or '<root>'}')")
        elif not sh.enum._ok(c):
            reasons.append(f"{size} is not a dim this tp_mode splits")
    sizes = " x ".join(str(f.size[x]) for d in dims for x in f.flat(d))
    return f"its weight's dims ({sizes}) split no way: {'; '.join(dict.fromkeys(reasons))}"


def _needed_whole(sh) -> dict:
    """class -> the nodes that need it whole (a softmax's dim, a norm's, attention's head_dim)."""
    out: dict = {}
    for v, ns in sh.nodes.items():
        for c in dict.fromkeys(sh.factors.find(leaf) for leaf in ns.rule.forbid):
            out.setdefault(c, []).append(v)
    return out


def _block_of(v: fx.Node) -> str:
    m = re.match(r"^((?:[^.]+\.)*?\d+)(\.|$)", v.meta.get("module_path") or "")
    return m.group(1) if m else ""


def layer_lines(sh) -> list[str]:
    """One line per layer: ``module.path: how``."""
    lines = []
    for v in sh.gm.graph.nodes:
        if v in sh.nodes and v in sh.chosen and _is_layer(sh, v):
            path = v.meta.get("module_path") or v.name
            weighted = sh.nodes[v].rule.kind == "linear" or functional_linear(v)
            label = path if weighted else f"{path} [{v.name}]"
            lines.append(f"{label}: {how(sh, v)}")
    return lines


def block_lines(lines: list[str]) -> list[str]:
    """``layer_lines`` grouped by block, identical consecutive blocks printed once."""
    blocks: list[tuple[str, list[str]]] = []
    for line in lines:
        m = re.match(r"^((?:[^.:\s]+\.)*?\d+)\.(.*)$", line)
        block, rest = (m.group(1), m.group(2)) if m else ("", line)
        if not blocks or blocks[-1][0] != block:
            blocks.append((block, []))
        blocks[-1][1].append(re.sub(r"_\d+\b", "", rest.replace(f"'{block}.", "'<block>.")) if block else rest)
    out, k = [], 0
    while k < len(blocks):
        j = k
        while j + 1 < len(blocks) and blocks[j + 1][1] == blocks[k][1] and _next(blocks[j][0], blocks[j + 1][0]):
            j += 1
        name = blocks[k][0] if j == k else f"{blocks[k][0]}-{blocks[j][0].rsplit('.', 1)[-1]}"
        out.append(f"{name or '(outside blocks)'}:")
        out += [f"  {line}" for line in blocks[k][1]]
        k = j + 1
    return out


def _next(a: str, b: str) -> bool:
    pa, pb = a.rsplit(".", 1), b.rsplit(".", 1)
    return len(pa) == len(pb) == 2 and pa[0] == pb[0] and pa[1].isdigit() and pb[1].isdigit() and \
        int(pb[1]) == int(pa[1]) + 1


def opaque_notes(shardings: dict) -> list[str]:
    """Ops without a rule that a split tensor had to be gathered for (``shardings``: axis -> Sharding)."""
    gathered: dict = {}
    for axis, sh in shardings.items():
        for v, ns in sh.nodes.items():
            if ns.rule.kind != "opaque" or v not in sh.chosen:
                continue
            for a, _ in ns.rule.operands:
                if a in sh.chosen and sh.chosen[a].out != R:
                    gathered.setdefault(v, (sh, {}))[1].setdefault(a.name, []).append(axis)
    notes = []
    for v, (sh, names) in gathered.items():
        what = ", ".join(f"{name} (over {' and '.join(axes)})" if len(shardings) > 1 else name
                         for name, axes in names.items())
        notes.append(f"'{v.name}' ({op_name(v, sh.gm)}, in '{v.meta.get('module_path') or '<root>'}'): "
                     f"{sh.nodes[v].rule.why}; {what} gathered whole before it")
    return notes


def explain(sh, target: str) -> str:
    """The candidates of the node named ``target`` (or the nodes of the module path ``target``): each
    option's places, compute and the transitions from its producers' chosen places, in ms at the
    shapes the layout was priced at (engine.py "priced at"; the redistribution after it, to its
    consumers, is priced on their lines)."""
    nodes = [v for v in sh.nodes if v.name == target] or \
        [v for v in sh.nodes if v.meta.get("module_path") == target]
    if not nodes:
        raise AutosplitError(f"explain('{target}'): no node or module path '{target}' in the planned graph "
                             f"(names as plan.dump() and plan.tp_plan.regions show them)")
    with priced(sh.gm, sh.price_vals):
        return "\n".join(_candidates(sh, v) for v in nodes)


def _candidates(sh, v: fx.Node) -> str:
    ns = sh.nodes[v]
    out = [f"{v.name} ({op_name(v, sh.gm)}, in '{v.meta.get('module_path') or '<root>'}'):"]
    for i, s in enumerate(ns.options):
        moves = 0.0
        for k, (p, lay) in enumerate(ns.rule.operands):
            if p in sh.chosen:
                t = sh.enum.transition(p, sh.chosen[p].out, s.ins[k], lay, edge_bytes(p, v), s.sharded)
                moves += float("inf") if t is None else t
        mark = "  <- chosen" if s == sh.chosen.get(v) else ""
        own = "".join(f", {k} split on dim {d}" for k, d in s.params if d is not None)
        out.append(f"  {_place(sh, v, s.out)} from ({', '.join(_place(sh, v, x) for x in s.ins)}){own}: "
                   f"compute {ns.compute[i] * 1e3:.4f} ms + redistribution {moves * 1e3:.4f} ms{mark}")
    if len(ns.options) == 1:
        out.append(f"  (one option: {ns.why_whole})")
    return "\n".join(out)


def _place(sh, v, place) -> str:
    if place in (R, P):
        return {"R": "Replicate", "P": "Partial"}[place]
    return f"Shard[{sh.factors.size[sh.factors.members(place[1])[0]]}]"
