"""Split the backward of a stage's weight GEMMs: input gradient in I, weight gradient deferred to W.

Terms:
  weight GEMM -- a node that multiplies by a trainable parameter, found from the graph:
                 ``call_module`` of an ``nn.Linear`` or ``nn.Conv{1,2,3}d`` whose ``forward`` is the
                 library's own (a subclass that overrides it is left alone, except autosplit's
                 row-parallel linear, which is ``F.linear`` without the bias), or ``call_function``
                 of ``F.linear`` / ``F.conv{1,2,3}d`` whose weight argument is a ``get_attr`` of an
                 ``nn.Parameter`` that requires grad.  Convs need zeros padding and numeric ``padding``
                 (``aten.convolution_backward`` takes numbers).
  split       -- the node is rewired to ``autosplit.weight_grad``'s split op: a ``call_module`` node
                 keeps its target, whose module becomes a ``SplitLinear`` / ``SplitConv`` holding the
                 *same* Parameter objects under the same names; a ``call_function`` node's target
                 becomes ``split_linear`` / ``split_conv``.  Everything else (norms, attention inside a
                 leaf ``nn.MultiheadAttention``, a weight reached through a view) keeps its fused
                 backward: correct, only not deferred.

The pass works on a copy of the stage graph (tensor-parallel ranks share one graph, and the plan's
modules stay as planned); the copy shares every submodule and parameter with the original, and the
replaced modules live only in the copy's own module tree, so the user's model is untouched.
"""
from __future__ import annotations

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autosplit.tp.local_modules import RowParallelLinear
from autosplit.weight_grad import SplitConv, SplitLinear, split_conv, split_linear

_CONVS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}
_CONV_MODULES = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}


def _own_forward(module: nn.Module, base: type) -> bool:
    return type(module).forward is base.forward


def _module_split(module: nn.Module) -> nn.Module | None:
    """The stand-in for a call_module node's module, or None to leave it fused."""
    if isinstance(module, RowParallelLinear):                  # F.linear(x, weight): bias added later
        return SplitLinear(module, add_bias=False)
    if isinstance(module, nn.Linear) and _own_forward(module, nn.Linear):
        return SplitLinear(module) if module.weight.requires_grad else None
    for cls in _CONV_MODULES:
        if isinstance(module, cls) and _own_forward(module, cls):
            ok = module.padding_mode == "zeros" and not isinstance(module.padding, str)
            return SplitConv(module) if ok and module.weight.requires_grad else None
    return None


def _trainable_param(gm: fx.GraphModule, node) -> bool:
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return False
    try:
        value = gm.get_parameter(node.target)
    except AttributeError:
        return False
    return isinstance(value, nn.Parameter) and value.requires_grad


def _function_args(node: fx.Node, names: tuple[str, ...]) -> list | None:
    """The call's arguments in ``names`` order (defaults as None), or None if a name is unknown."""
    args = list(node.args) + [None] * (len(names) - len(node.args))
    for key, value in node.kwargs.items():
        if key not in names:
            return None
        args[names.index(key)] = value
    return args


def _function_split(gm: fx.GraphModule, node: fx.Node) -> tuple | None:
    """(new target, args) for a call_function weight GEMM, or None to leave it fused."""
    if node.target is F.linear:
        args = _function_args(node, ("input", "weight", "bias"))
        return (split_linear, args) if args and _trainable_param(gm, args[1]) else None
    if node.target in _CONVS:
        args = _function_args(node, ("input", "weight", "bias", "stride", "padding", "dilation", "groups"))
        if not args or not _trainable_param(gm, args[1]) or isinstance(args[4], str):
            return None
        defaults = [None, None, None, 1, 0, 1, 1]
        return split_conv, [d if a is None else a for a, d in zip(args, defaults)]
    return None


def weight_gemm_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of ``gm`` that ``split_weight_gemms`` splits (for the cost model's I / W prices)."""
    return [n for n in gm.graph.nodes
            if n.op == "call_module" and _module_split(gm.get_submodule(n.target)) is not None
            or n.op == "call_function" and _function_split(gm, n) is not None]


def split_weight_gemms(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[str]]:
    """A copy of ``gm`` whose weight GEMMs defer their weight gradient (see the module docstring).

    Args:
        gm: a stage GraphModule (this rank's, with its local tensor-parallel shards).

    Returns:
        (the copy, the names of the split nodes in graph order).
    """
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    new = fx.GraphModule(gm, graph, type(gm).__name__)
    new.training = gm.training          # the flag only: .train() would reach the model's own modules
    split = []
    for node in new.graph.nodes:
        if node.op == "call_module":
            stand_in = _module_split(new.get_submodule(node.target))
            if stand_in is not None:
                new.set_submodule(node.target, stand_in)
                split.append(node.name)
        elif node.op == "call_function":
            found = _function_split(new, node)
            if found is not None:
                node.target, node.args, node.kwargs = found[0], tuple(found[1]), {}
                split.append(node.name)
    new.recompile()
    return new, split
