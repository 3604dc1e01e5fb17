"""Linear, LayerNorm and convolution modules as function calls on their parameters, for layouts over
several axes.

Terms:
  functional form -- ``F.linear(x, w, b)`` / ``F.layer_norm(x, shape, w, b, eps)`` / ``F.conv2d(x, w, b,
                     stride, padding, dilation, groups)`` with ``w`` and ``b``
                     read by ``get_attr`` nodes: the parameters become graph values, so each gets its
                     own placement per axis, and the lowering can gather or copy it on one axis only
                     (2D stores a weight split over both axes and gathers it over ``tp_row`` at its use).
  module params   -- parameters a ``call_module`` node reads inside the module: one placement for all
                     of them, the module's; under 2D a module holding parameters runs whole
                     (strategies.py ``Enumerator.grid``).

The module path stays on every node (``meta['module_path']``), so stages, dumps and the per-block
summary still name ``blocks.0.attn.qkv``.  Requires meta['val']; the new get_attr nodes get theirs.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn


_CONVS = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}


def functionalize(gm: fx.GraphModule) -> int:
    """Rewrite every ``nn.Linear``, ``nn.LayerNorm`` and (zero-padded) convolution call of ``gm`` in
    place; returns how many."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        m = gm.get_submodule(node.target)
        if type(m) is nn.Linear:
            params = [_param(gm, node, "weight"), _param(gm, node, "bias") if m.bias is not None else None]
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(F.linear, (node.args[0], *params))
        elif type(m) in _CONVS and m.padding_mode == "zeros" and isinstance(m.padding, tuple):
            params = [_param(gm, node, "weight"), _param(gm, node, "bias") if m.bias is not None else None]
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(_CONVS[type(m)], (node.args[0], *params, m.stride, m.padding,
                                                               m.dilation, m.groups))
        elif type(m) is nn.LayerNorm:
            params = [_param(gm, node, k) if getattr(m, k) is not None else None for k in ("weight", "bias")]
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(F.layer_norm, (node.args[0], tuple(m.normalized_shape), *params, m.eps))
        else:
            continue
        new.meta.update(node.meta)
        new.meta["functional_of"] = node.name      # the values a layout is priced at are by name
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    gm.graph.lint()
    return count


def _param(gm: fx.GraphModule, node: fx.Node, name: str) -> fx.Node:
    target = f"{node.target}.{name}"
    with gm.graph.inserting_before(node):
        p = gm.graph.get_attr(target)
    tensor = gm.get_parameter(target)
    p.meta.update(module_path=node.meta.get("module_path", ""),
                  val=torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"))
    return p
