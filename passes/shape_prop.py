"""Propagate shapes and dtypes through a traced graph on the meta device.

Terms:
  meta tensor -- a tensor on ``torch.device("meta")``: shape, dtype and strides, no storage.  Running the
                 graph on meta tensors costs no memory, so a 22-billion-parameter model plans on a laptop.
  val         -- ``node.meta["val"]``: the node's result computed on meta tensors (a tensor, a tuple of
                 them, or a plain Python value such as an int from ``x.shape[0]``).

The model's own parameters may be real or already on meta; real ones are swapped for meta stand-ins
per call (``torch.func.functional_call``), so nothing is copied or allocated.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult
from torch.utils._pytree import tree_map

from autosplit.errors import AutosplitError
from autosplit.passes.infra import MetaPass


def to_meta(value):
    """A meta stand-in for every tensor in ``value`` (parameters keep requires_grad)."""
    def one(x):
        if isinstance(x, torch.Tensor) and x.device.type != "meta":
            return torch.empty_like(x, device="meta").requires_grad_(x.requires_grad)
        return x
    return tree_map(one, value)


def run_on_zeros(module: torch.nn.Module, args, kwargs):
    """``module``'s real output on CPU zeros of the inputs' shapes and dtypes: for a leaf that
    branches on tensor values and so cannot run on meta or fake tensors."""
    zeros = tree_map(lambda x: torch.zeros(x.shape, dtype=x.dtype) if isinstance(x, torch.Tensor) else x,
                     (tuple(args), dict(kwargs)))
    return module(*zeros[0], **zeros[1])


class _MetaInterpreter(fx.Interpreter):
    def get_attr(self, target, args, kwargs):
        return to_meta(super().get_attr(target, args, kwargs))

    def call_module(self, target, args, kwargs):
        module = self.fetch_attr(target)
        state = {name: to_meta(t) for name, t in module.state_dict(keep_vars=True).items()}
        try:
            return torch.func.functional_call(module, state, tuple(args), dict(kwargs))
        except Exception:
            if any(t.device.type == "meta" for t in module.state_dict().values()):
                raise
            return to_meta(run_on_zeros(module, args, kwargs))

    def run_node(self, n: fx.Node):
        try:
            result = super().run_node(n)
        except Exception as exc:
            raise AutosplitError(
                f"shape propagation failed at node '{n.name}' ({n.op} {n.target}) in module "
                f"'{n.meta.get('module_path', '')}': {type(exc).__name__}: {_first_part(exc)}") from exc
        n.meta["val"] = result
        return result


def _first_part(exc: Exception) -> str:
    """The error without the graph dump torch.fx appends ("While executing ...")."""
    return str(exc).split("\n\nWhile executing")[0]


class MetaShapeProp(MetaPass):
    """Requires: a traced graph.  Ensures: every node has ``meta['val']`` computed on meta tensors."""

    ensures_meta = ("val",)

    def __init__(self, example_inputs: tuple):
        self.example_inputs = to_meta(tuple(example_inputs))

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        with torch.no_grad():
            _MetaInterpreter(graph_module).run(*self.example_inputs)
        return PassResult(graph_module, False)


def tensor_bytes(value) -> int:
    """Total bytes of the tensors inside a ``val``."""
    total = 0
    def add(x):
        nonlocal total
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        return x
    tree_map(add, value)
    return total


class ExampleShapeProp(MetaShapeProp):
    """MetaShapeProp of the user's example microbatch: a failure also shows the example's shapes and
    what it must be (one microbatch, batch dim first), the usual cause of a shape error there."""

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        try:
            return super().call(graph_module)
        except AutosplitError as exc:
            shapes = ", ".join(str(tuple(x.shape)) for x in self.example_inputs)
            raise AutosplitError(f"{exc}\nexample_input has shape {shapes}; it must be one microbatch of what the "
                                 f"model's forward takes, batch dim first (e.g. (B, C, H, W))") from exc
