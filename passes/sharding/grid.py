"""2D tensor parallelism (SUMMA / Optimus) as the sharding engine over two axes of a q x q grid.

Terms (engine: engine.py; lowering: lower.py; plan: tp_plan.py):
  axes      -- ``tp_row`` and ``tp_col``, q ranks each; tp rank t is row t // q, column t % q (the
               runtime's grid, autosplit/runtime/world.py).
  row axis  -- candidates: the batch class only (the model inputs' dim 0), required wherever an op can
               take it: every activation holds B/q rows.  Parameters stay whole in the solve and are
               stored split over the rows (lower.py "stored split").
  col axis  -- candidates: every Linear weight's classes (features, heads), required wherever an op
               can take them, so activations hold C/q channels between blocks too; layer norms over
               them use partial statistics (``layer_norm_2d``), and each column-split linear of an
               input split on its features runs as ``linear_2d`` (form: all-gather or SUMMA, by cost).
  modules   -- Linear and LayerNorm calls become function calls on their parameters first
               (functional.py), so every weight gets a placement per axis; any other module holding
               parameters runs whole (a patch-embedding convolution: on the whole batch, then sliced).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autosplit.errors import AutosplitError
from autosplit.passes.op_names import keeps_effect, op_name
from autosplit.passes.sharding.describe import layer_lines, opaque_notes
from autosplit.passes.sharding.engine import Sharding, analyse
from autosplit.passes.sharding.functional import functionalize
from autosplit.passes.sharding.lower import Lowering
from autosplit.passes.sharding.tp_plan import TensorParallelPlan

ROW, COL = "tp_row", "tp_col"


def batch_classes(sh: Sharding, table: dict) -> set[int]:
    """The classes of the model inputs' dim 0."""
    f = sh.factors
    return {f.find(leaf) for v, r in table.items() if r.kind == "input" and r.out
            for leaf in f.flat(r.out[0])}


def weight_classes(sh: Sharding, table: dict) -> set[int]:
    """The classes of every ``F.linear`` weight (after functional.py: every Linear's)."""
    f, out = sh.factors, set()
    for v, r in table.items():
        if r.kind == "op" and op_name(v, sh.gm) == "linear" and len(r.operands) > 1:
            out |= {f.find(leaf) for d in r.operands[1][1] for leaf in f.flat(d)}
    return out


def shard_2d(gm: fx.GraphModule, q: int, profile, form, price_vals: dict | None = None) -> TensorParallelPlan:
    """Rewrite ``gm`` (requires meta['val'], global shapes) for a q x q grid of tp ranks.

    Args:
        gm: the traced graph, shape-propagated; rewritten in place.
        q: ranks per axis (tp = q * q).
        profile: the DeviceProfile that prices the candidates.
        form: fn(node, x_val, w_shape) -> "allgather" | "summa", each linear_2d's algorithm.
        price_vals: the values to price candidates with (engine.py ``priced_at``); default gm's own.
    """
    _check_rows(gm, q)
    functionalize(gm)
    row = analyse(gm, q, profile, allowed_fn=batch_classes, must_split_fn=batch_classes, price_vals=price_vals,
                  grid=True)
    col = analyse(gm, q, profile, allowed_fn=weight_classes, must_split_fn=weight_classes, price_vals=price_vals,
                  grid=True)
    plan = TensorParallelPlan(tp=q * q, root=gm, sharding=col)
    plan.regions = layer_lines(col)
    plan.notes = opaque_notes({ROW: row, COL: col})
    Lowering({ROW: row, COL: col}, plan, coords=lambda t: {ROW: t // q, COL: t % q}, store=ROW,
             grid=(ROW, COL, form)).run()
    gm.graph.eliminate_dead_code(is_impure_node=keeps_effect)   # fx calls x.add_(y) pure
    gm.graph.lint()
    return plan


def _check_rows(gm: fx.GraphModule, q: int) -> None:
    for v in gm.graph.nodes:
        val = v.meta.get("val")
        if v.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() > 0 and val.shape[0] % q:
            raise AutosplitError(f"tp_mode='2d': the microbatch has {val.shape[0]} rows, which do not divide by "
                                 f"q({q}) (tp = q*q splits each microbatch's rows over tp_row); use a "
                                 f"microbatch of a multiple of {q} rows")
