"""What tracing left for the plan's summary: the modules kept whole and why, and the shape guards.

Terms (see autosplit/trace.py and autosplit/trace_concrete.py):
  leaf        -- a ``call_module`` node with ``node.meta["leaf"]`` (why it runs whole) whose module the op
                 registry does not declare (a declared one, DropPath, is an op the passes understand):
                 it runs on every tensor-parallel rank whole, its Linear layers replicated.
  shape guard -- a ``shape_guard`` node: a decision the model's code took from the example's shapes.
"""
from __future__ import annotations

from collections import defaultdict

import torch.fx as fx
from torch import nn

from autosplit.passes.op_registry import OPAQUE, module_entry
from autosplit.trace_concrete import is_guard

_SHOWN = 3          # paths (guards: places) named per line before "..."


def _names(items: list[str]) -> str:
    return ", ".join(items[:_SHOWN]) + (f", ... ({len(items)} in all)" if len(items) > _SHOWN else "")


def leaf_lines(gm: fx.GraphModule) -> list[str]:
    """One line per (class, reason) of the leaves of ``gm``: their paths, Linears inside, the reason."""
    groups: dict[tuple[str, str], list[tuple[str, int]]] = defaultdict(list)
    for node in gm.graph.nodes:
        why = node.meta.get("leaf") if node.op == "call_module" else None
        if not why:
            continue
        module = gm.get_submodule(node.target)
        if module_entry(module) is not OPAQUE:
            continue
        linears = sum(isinstance(m, nn.Linear) for m in module.modules())
        groups[(type(module).__qualname__, why)].append((str(node.target), linears))
    lines = []
    for (cls, why), found in groups.items():
        linears = sum(k for _, k in found)
        lines.append(f"kept whole (a leaf, replicated under tp): {cls} at {_names([p for p, _ in found])}"
                     f"{f' ({linears} Linear layers inside)' if linears else ''}: {why}")
    return lines


def guard_lines(gm: fx.GraphModule) -> list[str]:
    """One line naming the places where the traced code decided on a shape (empty: none)."""
    places: dict[str, int] = defaultdict(int)
    for node in gm.graph.nodes:
        if is_guard(node):
            places[node.args[3]] += 1
    if not places:
        return []
    n = sum(places.values())
    where = _names([f"{w}" + (f" (x{k})" if k > 1 else "") for w, k in places.items()])
    return [f"shape guards: {n} decision{'s' if n > 1 else ''} on shapes taken from the example input when "
            f"tracing, checked on every call (other shapes are refused: plan again for them): {where}"]


def trace_notes(gm: fx.GraphModule) -> list[str]:
    return leaf_lines(gm) + guard_lines(gm)
