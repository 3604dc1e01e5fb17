"""The grid modes of tensor parallelism as the sharding engine over several axes: 2D (SUMMA /
Optimus, a q x q grid), 2.5D (Tesseract: d layers of it) and 3D (a q x q x q cube).

Terms (engine: engine.py; lowering: lower.py; plan: tp_plan.py; axes: autosplit/tp/axes.py):
  batch axis -- candidates: the batch class only (the model inputs' dim 0), required wherever an op can
               take it.  2D: tp_row (B/q rows per rank); 2.5D: tp_dep then tp_row (B/(d q) rows,
               tp_dep outermost); 3D: tp_x.  Parameters stay whole in the solve and are stored split
               over one of them (lower.py "stored split": 2D/2.5D tp_row, 3D tp_x), all-gathered at
               their use; 2.5D's weights are whole over tp_dep, their gradients summed over it.
  col axis   -- 2D and 2.5D's tp_col: candidates every Linear weight's classes (features, heads),
               required wherever an op can take them, so activations hold C/q channels between
               blocks too; layer norms over them use partial statistics (``layer_norm_2d``), and each
               column-split linear of an input split on its features runs as ``linear_2d`` (form:
               all-gather or SUMMA, by cost).
  cube axes  -- 3D's tp_y and tp_z: candidates the batch and every weight class, every Linear's weight
               split on both (one dim each), every op split on each where it can be, and never on the
               same dim (one program over both axes: joint.py): a linear then gathers its input over the axis that
               split its rows (the input axis), its weight over tp_x (the weight axis), and its Partial
               sum is reduce-scattered over the axis that split its input features (the output axis),
               onto the rows; the next linear finds the two axes' roles swapped, as Colossal-AI's 3D
               swaps its input and output groups.  Which axis takes which role at each layer is the
               engine's choice by cost.
  modules    -- Linear and LayerNorm calls become function calls on their parameters first
               (functional.py), so every weight gets a placement per axis; any other module holding
               parameters runs whole (a patch-embedding convolution: on the whole batch, then sliced).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from autosplit.errors import AutosplitError
from autosplit.passes.op_names import keeps_effect
from autosplit.passes.op_registry import functional_linear
from autosplit.passes.sharding.describe import layer_lines, opaque_notes
from autosplit.passes.sharding.engine import Sharding, analyse
from autosplit.passes.sharding.functional import functionalize
from autosplit.passes.sharding.joint import analyse_pair
from autosplit.passes.sharding.lower import Lowering
from autosplit.passes.sharding.tp_plan import TensorParallelPlan
from autosplit.tp.axes import coords

def batch_classes(sh: Sharding, table: dict) -> set[int]:
    """The classes of the model inputs' dim 0."""
    f = sh.factors
    return {f.find(leaf) for v, r in table.items() if r.kind == "input" and r.out
            for leaf in f.flat(r.out[0])}


def weight_classes(sh: Sharding, table: dict) -> set[int]:
    """The classes of every ``F.linear`` weight (after functional.py: every Linear's)."""
    f, out = sh.factors, set()
    for v, r in table.items():
        if r.kind == "op" and functional_linear(v) and len(r.operands) > 1:
            out |= {f.find(leaf) for d in r.operands[1][1] for leaf in f.flat(d)}
    return out


def shard_grid(gm: fx.GraphModule, mode: str, axes, profile, form, price_vals: dict | None = None) -> TensorParallelPlan:
    """Rewrite ``gm`` (requires meta['val'], global shapes) for a grid mode's tp sub-mesh.

    Args:
        gm: the traced graph, shape-propagated; rewritten in place.
        mode: "2d", "2.5d" or "3d".
        axes: ((axis name, size), ...) of the sub-mesh (autosplit/tp/axes.py ``tp_axes``).
        profile: the DeviceProfile that prices the candidates.
        form: fn(node, x_val, w_shape) -> "allgather" | "summa", each linear_2d's algorithm (2D, 2.5D).
        price_vals: the values to price candidates with (engine.py ``priced_at``); default gm's own.
    """
    names, size = [a for a, _ in axes], dict(axes)
    stride = {a: math.prod(size[b] for b in names[k + 1:]) for k, a in enumerate(names)}   # mixed radix
    rows = names[:-1] if mode in ("2d", "2.5d") else names[:1]
    _check_rows(gm, mode, rows, size)
    functionalize(gm)
    if price_vals:     # the function calls stand for the module calls the values were recorded for
        price_vals = {**price_vals, **{v.name: price_vals[v.meta["functional_of"]] for v in gm.graph.nodes
                                       if v.meta.get("functional_of") in price_vals}}
    shardings: dict[str, Sharding] = {}
    first = None
    for a in rows:                             # tp_row (tp_dep first), or tp_x
        shardings[a] = analyse(gm, size[a], profile, allowed_fn=batch_classes, must_split_fn=batch_classes,
                               price_vals=price_vals, grid=True, base=first, stride=stride[a])
        first = first or shardings[a]
    if mode == "3d":
        x, y, z = names
        either = lambda sh, table: batch_classes(sh, table) | weight_classes(sh, table)   # noqa: E731
        shardings[y], shardings[z] = analyse_pair(gm, (size[y], size[z]), profile, first, (stride[y], stride[z]),
                                                  allowed_fn=either,
                                                  must_split_fn=either, must_split_weights=True,
                                                  price_vals=price_vals, grid=True, partial_linears=True)
        store, grid, stats, main = x, None, (y, z), shardings[y]
    else:
        col = names[-1]
        shardings[col] = analyse(gm, size[col], profile, allowed_fn=weight_classes, must_split_fn=weight_classes,
                                 price_vals=price_vals, grid=True, base=first, stride=stride[col])
        store, grid, stats, main = "tp_row", ("tp_row", col, form), (col,), shardings[col]
    plan = TensorParallelPlan(tp=math.prod(size.values()), root=gm, sharding=main)
    plan.axes = tuple(axes)
    plan.regions = _regions(shardings, stats)
    plan.notes = opaque_notes(shardings)
    Lowering(shardings, plan, coords=lambda t: coords(axes, t), store=store, grid=grid, stats=stats).run()
    gm.graph.eliminate_dead_code(is_impure_node=keeps_effect)   # fx calls x.add_(y) pure
    gm.graph.lint()
    return plan


def shard_2d(gm: fx.GraphModule, q: int, profile, form, price_vals: dict | None = None) -> TensorParallelPlan:
    """``shard_grid`` on a q x q grid (tp_row, tp_col)."""
    return shard_grid(gm, "2d", (("tp_row", q), ("tp_col", q)), profile, form, price_vals)


def _regions(shardings: dict, stats) -> list[str]:
    """The layer lines of the axes that split weights (one axis: as 1D's; 3D's two: each named)."""
    if len(stats) == 1:
        return layer_lines(shardings[stats[0]])
    per_axis = [layer_lines(shardings[a]) for a in stats]       # the same layers, in graph order
    out = []
    for lines in zip(*per_axis):
        label = lines[0].split(": ", 1)[0]
        out.append(f"{label}: " + "; ".join(f"{a} {line.split(': ', 1)[1]}" for a, line in zip(stats, lines)))
    return out


def _check_rows(gm: fx.GraphModule, mode: str, rows, size: dict) -> None:
    """Every microbatch row count divides by the ranks that split the batch."""
    split = rows if mode != "3d" else (*rows, "tp_y")          # 3D: tp_x and one of tp_y / tp_z
    n = 1
    for a in split:
        n *= size[a]
    label, how = {"2d": (f"q({n})", "tp = q*q splits each microbatch's rows over tp_row"),
                  "2.5d": (f"d*q({size.get('tp_dep')}*{size.get('tp_row')} = {n})",
                           "tp = q*q*d splits each microbatch's rows over tp_dep and tp_row"),
                  "3d": (f"q*q({n})", "tp = q*q*q splits each microbatch's rows over tp_x and one of tp_y / tp_z")}[mode]
    for v in gm.graph.nodes:
        val = v.meta.get("val")
        if v.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() > 0 and val.shape[0] % n:
            raise AutosplitError(f"tp_mode='{mode}': the microbatch has {val.shape[0]} rows, which do not divide by "
                                 f"{label} ({how}); use a microbatch of a multiple of {n} rows")
