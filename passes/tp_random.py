"""Put the random ops of sharded tensor-parallel regions on a per-tp-rank RNG fork.

Terms (see autosplit/tp/random.py for the fork, passes/sharding/lower.py for spec):
  random op  -- a dropout module (``nn.Dropout`` and the other ``_DropoutNd``), a dropout function
                (``F.dropout``, ``dropout1d`` ...), ``bernoulli`` / ``rand_like`` style ops, and
                ``scaled_dot_product_attention`` with a ``dropout_p`` that is not 0 (a number or a
                train/eval ModeSwitch node).
  sharded    -- the node's ``meta['spec']['tp']`` is ``Shard(dim)`` (a region's heads or hidden
                features, or tokens under sequence parallelism), or the tensor-parallel rewrite
                marked it ``meta['tp_random']`` (a local MultiheadAttention with attention dropout).
The pass works on one stage GraphModule (the runtime applies it to the stage it runs); it needs no
process group: the fork names the axis, the runtime binds the axis to its group.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import Shard

from autosplit.passes.op_registry import arguments, op
from autosplit.tp.random import TpRandom



def is_random(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op == "call_module":
        return isinstance(gm.get_submodule(node.target), nn.modules.dropout._DropoutNd)
    if node.op not in ("call_function", "call_method"):
        return False
    where = op(node, gm).random          # torch.dropout_ / x.bernoulli_: random as their bases
    if not where:
        return where == ""
    p = (arguments(node) or node.kwargs).get(where, 0.0)     # SDPA: random when its dropout_p is not 0
    return isinstance(p, fx.Node) or bool(p)


def sharded_random_nodes(gm: fx.GraphModule, axis: str = "tp") -> list[fx.Node]:
    """The random ops of ``gm`` whose tensors are split across the ranks of ``axis``."""
    out = []
    for node in gm.graph.nodes:
        spec = node.meta.get("spec", {})
        # a grid's blocks are split over the tp sub-mesh's axes (tp_row, tp_col, ...: autosplit/tp/
        # axes.py), cp's tokens over "cp" beside "tp_1d": the fork of the rank's place in the whole
        # block ("tp") covers them all, so each (cp, tp) coordinate draws its own mask
        split = isinstance(spec.get(axis), Shard) or (axis == "tp" and any(
            isinstance(place, Shard) for a, place in spec.items() if a.startswith("tp_") or a == "cp"))
        if node.meta.get("tp_random") or (split and is_random(node, gm)):
            out.append(node)
    return out


def fork_sharded_random(gm: fx.GraphModule, axis: str = "tp") -> fx.GraphModule:
    """A copy of ``gm`` (same submodules and parameters; the graph copied, since tp ranks share it)
    whose sharded random ops run under the tp rank's fork; ``gm`` itself when there are none."""
    if not sharded_random_nodes(gm, axis):
        return gm
    graph = fx.Graph()
    env: dict = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    new = fx.GraphModule(gm, graph, type(gm).__name__)
    new.training = gm.training          # the flag only: .train() would reach the model's own modules
    for k, node in enumerate(sharded_random_nodes(new, axis)):
        # a module, a Tensor method name (call_method) or a function (call_function)
        op = new.get_submodule(node.target) if node.op == "call_module" else node.target
        name = f"autosplit_tp_random_{k}"
        wrapper = TpRandom(op, axis)
        wrapper.training = gm.training
        new.add_submodule(name, wrapper)
        node.op, node.target = "call_module", name
    new.recompile()
    return new
