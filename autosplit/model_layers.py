"""Name what a stage holds, and find the model's repeated layers (for the equal-layer baseline).

Terms:
  module path -- ``node.meta['module_path']``, e.g. "blocks.3.attn.qkv" ("" for ops of the root forward).
  layer       -- a child of the model's largest container (nn.Sequential / nn.ModuleList) whose
                 children all share one type: the transformer blocks.  Found from the module tree's
                 structure, not from names.
  label       -- module paths cut to two parts and runs of numbered siblings merged:
                 "patch_embed, blocks.0-3, blocks.4.norm1..ls1".
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import torch.fx as fx
from torch import nn

_SKIP = ("placeholder", "output")


def layer_paths(model: nn.Module) -> list[str]:
    """Paths of the model's layers: children of its largest container of same-typed modules."""
    best: list[str] = []
    for path, module in model.named_modules():
        if not isinstance(module, (nn.Sequential, nn.ModuleList)):
            continue
        children = list(module.named_children())
        if len(children) > len(best) and len({type(c) for _, c in children}) == 1:
            best = [f"{path}.{name}" if path else name for name, _ in children]
    return best


def find_layer_ends(layers: Sequence[str], segments: Sequence[Sequence[fx.Node]]) -> list[int]:
    """For each layer (from layer_paths), the index of the segment holding its last node (sorted, distinct)."""
    ends = []
    for layer in layers:
        found = [k for k, seg in enumerate(segments)
                 if any(_within(n.meta.get("module_path", ""), layer) for n in seg)]
        if found:
            ends.append(max(found))
    return sorted(set(ends))


def first_layer_segment(layers: Sequence[str], segments: Sequence[Sequence[fx.Node]]) -> int:
    """Index of the first segment holding a node of any layer (len(segments) if none does)."""
    return next((k for k, seg in enumerate(segments)
                 if any(_within(n.meta.get("module_path", ""), layer) for n in seg for layer in layers)),
                len(segments))


def _within(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def layer_of(node: fx.Node, layers: Sequence[str]) -> str | None:
    """The layer (one of ``layers``) that ``node``'s module path lies in, or None."""
    return path_layer(node.meta.get("module_path", ""), layers)


_LAYER_SETS: dict[tuple[str, ...], frozenset[str]] = {}


def path_layer(path: str, layers: Sequence[str]) -> str | None:
    """The layer (one of ``layers``) that module ``path`` lies in, or None: the path's prefixes looked
    up in a set (layers are siblings, never nested; the search asks this of 10^5 nodes)."""
    key = tuple(layers)
    found = _LAYER_SETS.get(key)
    if found is None:
        if len(_LAYER_SETS) > 64:
            _LAYER_SETS.clear()
        found = _LAYER_SETS[key] = frozenset(key)
    end = 0
    while path and end >= 0:
        end = path.find(".", end + 1)
        prefix = path if end < 0 else path[:end]
        if prefix in found:
            return prefix
    return None


def _key(path: str, layers: Sequence[str]) -> tuple[str, str]:
    """(group, part): the layer a path lies in (else its top-level module), and the child within it."""
    for layer in layers:
        if _within(path, layer):
            rest = path[len(layer) + 1:]
            return layer, layer + "." + rest.split(".")[0] if rest else layer
    top = path.split(".")[0]
    rest = path[len(top) + 1:]
    return top, top + "." + rest.split(".")[0] if rest else top


def layers_label(layers: Sequence[str], stage_nodes: Sequence[fx.Node], all_nodes: Sequence[fx.Node]) -> str:
    """A short readable description of the modules a stage covers (``layers`` from layer_paths)."""
    count_all: dict[str, int] = {}
    for n in all_nodes:
        if n.op not in _SKIP:
            group = _key(n.meta.get("module_path", ""), layers)[0]
            count_all[group] = count_all.get(group, 0) + 1
    order: dict[str, list[str]] = {}
    for n in stage_nodes:
        if n.op not in _SKIP:
            group, part = _key(n.meta.get("module_path", ""), layers)
            order.setdefault(group, []).append(part)
    parts = []
    for group, subpaths in order.items():
        if not group:
            continue
        kids = [p.rpartition(".")[2] for p in dict.fromkeys(subpaths) if p != group]
        if len(subpaths) == count_all.get(group) or not kids:
            parts.append(group)
        else:
            parts.append(f"{group}.{kids[0]}..{kids[-1]}" if len(kids) > 1 else f"{group}.{kids[0]}")
    return ", ".join(_merge_runs(parts)) or "(ops of the model's forward)"


def _merge_runs(parts: list[str]) -> list[str]:
    """["blocks.0", "blocks.1", "blocks.2", "norm"] -> ["blocks.0-2", "norm"]."""
    out: list[str] = []
    run: tuple[str, int, int] | None = None
    for p in parts + [""]:
        m = re.fullmatch(r"(.*\.)(\d+)", p)
        if m and run and run[0] == m.group(1) and int(m.group(2)) == run[2] + 1:
            run = (run[0], run[1], int(m.group(2)))
            continue
        if run:
            out.append(f"{run[0]}{run[1]}" + (f"-{run[2]}" if run[2] != run[1] else ""))
            run = None
        if m:
            run = (m.group(1), int(m.group(2)), int(m.group(2)))
        elif p:
            out.append(p)
    return out
