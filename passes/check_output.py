"""Refuse, at plan time, a model whose forward does not return one tensor.

Terms:
  model output -- the argument of the traced graph's ``output`` node: what ``model(x)`` returns.
                  autosplit trains on it as the logits: the last stage hands it to ``loss_fn`` and
                  ``predict`` returns it, so it must be a single tensor.  A tuple, list or dict
                  (e.g. ``(logits, features)``, ``{"logits": ...}``) is refused with an error that
                  names what was returned and how to wrap the model, instead of failing later inside
                  the loss on one rank.

Pure: reads the graph (and ``node.meta["val"]`` from shape propagation when present); no process group.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

from autosplit.errors import AutosplitError
from autosplit.passes.infra import MetaPass

_WRAP = ("wrap the model so that forward returns one tensor, e.g. class Logits(nn.Module): "
         "def forward(self, x): return model(x)[0]  (or [\"logits\"])")


def _describe(value) -> str:
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} values"
    return f"a {type(value).__name__}"


def check_single_output(gm: fx.GraphModule) -> None:
    """Raise AutosplitError unless ``gm``'s output is one tensor-valued node.

    Args:
      gm: the traced model (before or after shape propagation).
    """
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    result = output.args[0]
    if not isinstance(result, fx.Node):
        raise AutosplitError(f"the model's forward returns {_describe(result)} ({result!r}); autosplit trains on "
                             f"a single output tensor (the logits given to loss_fn): {_WRAP}")
    val = result.meta.get("val")
    if val is not None and not isinstance(val, torch.Tensor):
        raise AutosplitError(f"the model's forward returns {_describe(val)} (node '{result.name}'); autosplit "
                             f"trains on a single output tensor (the logits given to loss_fn): {_WRAP}")


class CheckSingleOutput(MetaPass):
    """``check_single_output`` as a pipeline step, after shape propagation (its message shows shapes)."""

    requires_meta = ("val",)

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        check_single_output(graph_module)
        return PassResult(graph_module, False)
