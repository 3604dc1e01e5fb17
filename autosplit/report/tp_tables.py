"""What the report shows of tensor parallelism: every collective of the plan's graph, grouped by block.

Terms:
  collective -- a graph node whose target carries ``comm_kind`` = (forward kind, backward kind), the
                vocabulary of autosplit/tp/ops.py (``copy_to_axis``, ``all_reduce``, ``all_gather``...).
                Anything added later with a ``comm_kind`` (other ops, other axes such as ``tp_row`` /
                ``tp_col``) is listed the same way: nothing here names an op or an axis.
  axis       -- the mesh axis the collective runs over: the op's ``axis`` argument.
  group size -- ranks in that axis: the op's ``n`` argument when it has one, else the mesh's size of a
                field of that name (``mesh.tp`` for "tp"); unknown sizes leave the predicted time blank.
  block      -- the module path up to its first numbered part ("blocks.3" of "blocks.3.attn.proj"):
                a child of an nn.Sequential / nn.ModuleList, which PyTorch names by index (the traced
                graph keeps the paths, not the container types); else the path's top-level module.
  times      -- the cost model's alpha-beta prediction (cost_model/comm.py ``collective_time``), per
                microbatch, forward and backward, in ms; only with a known device profile.
"""
from __future__ import annotations

import inspect

import torch

from autosplit.cost_model.comm import collective_time


def _arguments(node) -> dict:
    """The node's arguments by parameter name (empty when the target's signature cannot bind them)."""
    try:
        return dict(inspect.signature(node.target).bind(*node.args, **node.kwargs).arguments)
    except (TypeError, ValueError):   # no signature (a builtin) or a call it does not accept
        return dict(node.kwargs)


def _block(path: str) -> str:
    parts = path.split(".")
    cut = next((k for k, p in enumerate(parts) if p.isdigit()), 0)
    return ".".join(parts[:cut + 1]) or "(model forward)"


def collectives(plan, profile) -> list[dict]:
    """One row per collective node of ``plan.graph`` (tp rank 0's local shapes), in graph order."""
    rows = []
    for node in plan.graph.graph.nodes:
        kinds = getattr(node.target, "comm_kind", None)
        if not kinds:
            continue
        args = _arguments(node)
        axis = args.get("axis")
        size = args.get("n") or node.meta.get("axis_size") or \
            (getattr(plan.mesh, axis, None) if isinstance(axis, str) else None)
        times = collective_time(node, size, profile) if profile is not None and isinstance(size, int) else None
        val = node.meta.get("val")
        path = node.meta.get("module_path", "")
        rows.append({
            "block": _block(path), "stage": node.meta.get("stage"), "node": node.name,
            "op": getattr(node.target, "__name__", str(node.target)), "module_path": path, "axis": axis,
            "group_size": size, "fwd_kind": kinds[0], "bwd_kind": kinds[1],
            "shape": list(val.shape) if isinstance(val, torch.Tensor) else None,
            "fwd_ms": None if times is None else times[0] * 1e3,
            "bwd_ms": None if times is None else times[1] * 1e3})
    return rows


def per_block(rows: list[dict]) -> tuple[list[str], list[dict]]:
    """Columns ``"axis: kind (fwd|bwd)"`` found in ``rows``, and per block the count of each and the
    summed predicted time: what one transformer block communicates."""
    columns: list[str] = []
    blocks: dict[str, dict] = {}
    for r in rows:
        b = blocks.setdefault(r["block"], {"block": r["block"], "stages": [], "counts": {}, "ms": 0.0,
                                           "timed": True})
        if r["stage"] not in b["stages"]:
            b["stages"].append(r["stage"])
        for phase in ("fwd", "bwd"):
            if r[f"{phase}_kind"]:
                col = f"{r['axis']}: {r[f'{phase}_kind']} ({phase})"
                if col not in columns:
                    columns.append(col)
                b["counts"][col] = b["counts"].get(col, 0) + 1
        if r["fwd_ms"] is None:
            b["timed"] = False
        else:
            b["ms"] += r["fwd_ms"] + r["bwd_ms"]
    return columns, list(blocks.values())


def stage_extra(rows: list[dict]) -> dict[tuple[int, str], float]:
    """Seconds of collectives per (stage, "F" | "B"): what the timeline adds to each compute."""
    extra: dict[tuple[int, str], float] = {}
    for r in rows:
        if r["fwd_ms"] is not None and r["stage"] is not None:
            for kind, ms in (("F", r["fwd_ms"]), ("B", r["bwd_ms"])):
                extra[(r["stage"], kind)] = extra.get((r["stage"], kind), 0.0) + ms / 1e3
    return extra
