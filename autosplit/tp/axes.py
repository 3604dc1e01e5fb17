"""The tensor-parallel sub-mesh of each tp_mode: its axes, their sizes, a tp rank's coordinates.

Terms:
  tp axes -- the axes the tp ranks of one group are arranged on, outermost first, with their sizes:
               "1d", "auto": ("tp",)                          tp
               "2d":         ("tp_row", "tp_col")             q x q        (SUMMA / Optimus)
               "2.5d":       ("tp_dep", "tp_row", "tp_col")   d x q x q    (Tesseract: d layers of 2D)
               "3d":         ("tp_x", "tp_y", "tp_z")         q x q x q
             tp rank t is read in mixed radix over them (2D: row = t // q, col = t % q), so the ranks of
             the innermost axis are consecutive (they share a node first).
  grid mode -- a tp_mode over several axes ("2d", "2.5d", "3d").
  block axes -- with a cp axis (autosplit/mesh.py *block*), ("cp", cp) outermost, then the tp axes
             (1D's named "tp_1d" there): ``block_axes``.

Pure data: no process group.  The runtime builds one DeviceMesh (pp, dp, *sizes) with these names;
the passes lower each axis's placements to collectives over the axis's name.
"""
from __future__ import annotations

import math

from autosplit.errors import AutosplitError

GRID_MODES = ("2d", "2.5d", "3d")


def tp_axes(tp_mode: str, tp: int, depth: int | None = None) -> tuple[tuple[str, int], ...]:
    """((axis name, size), ...) of ``tp`` ranks under ``tp_mode``; an AutosplitError showing the
    arithmetic where ``tp`` does not factor as the mode needs.

    Args:
        tp_mode: "1d", "auto", "2d", "2.5d" or "3d".
        tp: the tensor-parallel ranks per group.
        depth: "2.5d" only: d in tp = q * q * d.
    """
    if tp_mode not in GRID_MODES or tp == 1:
        return (("tp", tp),)
    if tp_mode == "2d":
        q = math.isqrt(tp)
        if q * q != tp:
            raise AutosplitError(
                f"tp_mode='2d' arranges tp ranks in a q x q grid, so tp must be a perfect square; tp={tp} "
                f"is not (nearest squares: {q * q} = {q}x{q} and {(q + 1) ** 2} = {q + 1}x{q + 1})")
        return (("tp_row", q), ("tp_col", q))
    if tp_mode == "3d":
        q = round(tp ** (1 / 3))
        if q ** 3 != tp or q < 2:
            lo = max(2, int(tp ** (1 / 3)))
            raise AutosplitError(
                f"tp_mode='3d' arranges tp ranks in a q x q x q cube, so tp must be a cube of q >= 2; tp={tp} "
                f"is not (nearest cubes: {lo ** 3} = {lo}^3 and {(lo + 1) ** 3} = {lo + 1}^3)")
        return (("tp_x", q), ("tp_y", q), ("tp_z", q))
    valid = depths_25d(tp)
    if depth is None or isinstance(depth, bool) or not isinstance(depth, int):
        raise AutosplitError(f"tp_mode='2.5d' needs tp_depth=d with tp = q * q * d (q >= 2, d >= 1), got "
                             f"tp_depth={depth!r}; tp={tp} allows {_depth_list(tp, valid)}")
    q = math.isqrt(tp // depth) if depth >= 1 and tp % depth == 0 else 0
    if depth < 1 or tp % depth or q * q * depth != tp or q < 2:
        quotient = f"tp / d = {tp / depth:g}" if depth >= 1 else "d must be >= 1"
        raise AutosplitError(f"tp_mode='2.5d' with tp_depth={depth}: tp={tp} must be q * q * {depth} with q >= 2 "
                             f"({quotient}, not a square of q >= 2); tp={tp} allows {_depth_list(tp, valid)}")
    return (("tp_dep", depth), ("tp_row", q), ("tp_col", q))


def block_axes(tp_mode: str, mesh, depth: int | None = None) -> tuple[tuple[str, int], ...]:
    """The axes of ``mesh``'s block (autosplit/mesh.py *block*: cp x tp ranks): ("cp", cp) outermost where
    cp > 1 (passes/sharding/context.py), then ``tp_axes``' (left out where tp = 1 beside cp).  Beside cp,
    1D's axis is named "tp_1d": "tp" names the whole block's group (the runtime sums over it)."""
    inner = tp_axes(tp_mode, mesh.tp, depth)
    if mesh.cp == 1:
        return inner
    if mesh.tp == 1:
        return (("cp", mesh.cp),)
    return (("cp", mesh.cp),) + tuple(("tp_1d" if a == "tp" else a, n) for a, n in inner)


def grid_layouts(tp: int) -> list[tuple[str, int | None]]:
    """(tp_mode, tp_depth) of every grid layout ``tp`` ranks factor into, q >= 2: "2d" (q x q), "2.5d" at
    each depth d >= 2 (q x q x d; d = 1 is 2D), "3d" (q^3).  The search's and ``tp_mode="auto"``'s."""
    out = [("2d", None)] if tp > 1 and math.isqrt(tp) ** 2 == tp else []
    out += [("2.5d", d) for d in depths_25d(tp) if d >= 2]
    q = round(tp ** (1 / 3))
    return out + ([("3d", None)] if q >= 2 and q ** 3 == tp else [])


def depths_25d(tp: int) -> list[int]:
    """The depths d >= 1 for which tp = q * q * d with q >= 2."""
    out = []
    for d in range(1, tp + 1):
        if tp % d == 0:
            q = math.isqrt(tp // d)
            if q >= 2 and q * q * d == tp:
                out.append(d)
    return out


def _depth_list(tp: int, valid: list[int]) -> str:
    if not valid:
        return "no depth (no square of q >= 2 divides it)"
    return "tp_depth in " + ", ".join(f"{d} (q={math.isqrt(tp // d)})" for d in valid)


def coords(axes, t: int) -> dict[str, int]:
    """tp rank ``t``'s coordinate on each axis of ``axes`` (mixed radix, the first axis outermost)."""
    out = {}
    for name, size in reversed(tuple(axes)):
        out[name] = t % size
        t //= size
    return dict(reversed(list(out.items())))


def batch_ways(axes) -> int:
    """How many ways a grid mode splits each microbatch's rows (1 for one axis): 2D q (tp_row), 2.5D
    d * q (tp_dep, tp_row), 3D q * q (tp_x and one of tp_y / tp_z)."""
    size = dict(axes)
    if "tp_x" in size:
        return size["tp_x"] * size["tp_y"]
    return size.get("tp_dep", 1) * size.get("tp_row", 1)
