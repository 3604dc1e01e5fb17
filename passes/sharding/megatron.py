"""1D tensor parallelism (Megatron's layouts, and the free choice of "auto") as the sharding engine
over one axis ``tp``.

Terms (engine: engine.py; lowering: lower.py; plan: tp_plan.py):
  feature class -- a class (factors.py) that a Linear's weight carries (its output or input features,
                   the heads inside a fused qkv, an nn.MultiheadAttention's among them once decomposed),
                   and that no op needs
                   whole anywhere.  Under ``tp_mode="1d"`` only these may be split: Megatron's candidate
                   set (column- and row-parallel linears, attention by heads).  The residual stream's
                   features are a Linear's too, but every layer norm needs them whole, so between
                   blocks tensors stay replicated, as in Megatron; the token and batch dims are never
                   weight classes (sequence parallelism is its own option).
  must split    -- every Linear weight that any strategy splits is split (Megatron's contract: tensor
                   parallelism exists to split parameters), and every op that can run on a part of a
                   feature class does (the attention on its rank's heads, the MLP's activation on its
                   hidden features); the cost picks how (by rows or columns, which factor, where the
                   collectives go).
  auto          -- ``tp_mode="auto"``: every weight and token class is a candidate and nothing must be
                   split; the plan of least predicted time whose kept bytes fit the memory budget
                   (a layer kept whole where its split costs more than it saves: "not profitable").
"""
from __future__ import annotations

import torch.fx as fx

from autosplit.passes.op_names import keeps_effect
from autosplit.passes.op_registry import functional_linear
from autosplit.passes.sharding.describe import layer_lines, opaque_notes
from autosplit.passes.sharding.engine import Sharding, analyse
from autosplit.passes.sharding.lower import Lowering
from autosplit.passes.sharding.tp_plan import TensorParallelPlan

AXIS = "tp"


def feature_classes(sh: Sharding, table: dict) -> set[int]:
    """The classes of Linear weights and attention heads that no op needs whole (module docstring)."""
    f = sh.factors
    return _weights(sh, table) - {f.find(leaf) for rule in table.values() for leaf in rule.forbid}


def _weights(sh: Sharding, table: dict) -> set[int]:
    """The classes of Linear weights (a fused qkv's heads among them)."""
    f, out = sh.factors, set()
    for node, rule in table.items():
        dims = []
        if rule.kind == "linear":
            dims = rule.params.get("weight") or []
        elif rule.kind == "op" and functional_linear(node) and len(rule.operands) > 1:
            dims = rule.operands[1][1]
        out |= {f.find(leaf) for d in dims for leaf in f.flat(d)}
    return out


def token_classes(sh: Sharding, table: dict) -> set[int]:
    """The classes of the dims a Linear maps one by one, other than the batch: the tokens of a
    (B, N, C) activation (sequence parallelism splits these between blocks)."""
    f, out = sh.factors, set()
    for node, rule in table.items():
        if rule.kind == "linear" or (rule.kind == "op" and functional_linear(node)):
            x = rule.operands[0][1]
            out |= {f.find(leaf) for d in x[1:-1] for leaf in f.flat(d)}
    return out


def shard_1d(gm: fx.GraphModule, tp: int, profile, sequence_parallel: bool = False,
             price_vals: dict | None = None, auto: bool = False, memory_budget: float | None = None,
             microbatches: int = 1) -> TensorParallelPlan:
    """Rewrite ``gm`` (requires meta['val'], global shapes) for ``tp`` ranks on one axis.

    Args:
        gm: the traced graph, shape-propagated; rewritten in place.
        tp: ranks on the axis.
        profile: the DeviceProfile that prices the candidates.
        sequence_parallel: the token dims may be split too (padded where tp does not divide them).
        price_vals: the values to price candidates with (engine.py ``priced_at``); default gm's own.
        auto: tp_mode="auto": any feature or token class may be split, nothing must be; the least
            predicted time whose kept bytes fit ``memory_budget`` per rank.
        memory_budget: bytes per rank for ``auto`` (None: no limit).
        microbatches: per step (prices the once-a-step sums of partial gradients).
    """
    if auto:
        anything = lambda sh, table: _weights(sh, table) | token_classes(sh, table)   # noqa: E731
        sh = analyse(gm, tp, profile, allowed_fn=anything, padded_fn=token_classes, price_vals=price_vals,
                     memory_budget=memory_budget, microbatches=microbatches)
    elif sequence_parallel:
        allowed = lambda sh, table: feature_classes(sh, table) | token_classes(sh, table)   # noqa: E731
        sh = analyse(gm, tp, profile, allowed_fn=allowed, must_split_weights=True, padded_fn=token_classes,
                     must_split_fn=allowed, price_vals=price_vals, microbatches=microbatches)
    else:
        sh = analyse(gm, tp, profile, allowed_fn=feature_classes, must_split_weights=True, price_vals=price_vals,
                     must_split_fn=feature_classes, microbatches=microbatches)
    plan = TensorParallelPlan(tp=tp, root=gm, sharding=sh, sequence_parallel=sequence_parallel)
    plan.regions = layer_lines(sh)
    plan.notes = list(sh.notes) + opaque_notes({AXIS: sh})
    Lowering({AXIS: sh}, plan).run()
    gm.graph.eliminate_dead_code(is_impure_node=keeps_effect)   # fx calls x.add_(y) pure
    gm.graph.lint()
    return plan
