"""What a graph node runs, by one name: the rule tables of the passes and the cost model's listings.

Terms:
  short name     -- the called module's class name, the Tensor method, or the function's name without
                    underscores (``Linear``, ``view``, ``add`` for ``operator.__add__``): what rule tables
                    are keyed by.
  qualified name -- the same with where it comes from (``torch.nn.modules.linear.Linear``,
                    ``Tensor.view``, ``_operator.add``): what listings such as "ops without a cost rule"
                    show, so two ops of the same short name stay apart.
"""
from __future__ import annotations

import torch.fx as fx


def op_name(node: fx.Node, gm: fx.GraphModule, qualified: bool = False) -> str:
    """The short (or ``qualified``) name of what ``node`` runs."""
    if node.op == "call_module":
        cls = type(gm.get_submodule(node.target))
        return f"{cls.__module__}.{cls.__qualname__}" if qualified else cls.__name__
    if node.op == "call_method":
        return f"Tensor.{node.target}" if qualified else str(node.target)
    t = node.target
    name = getattr(t, "__name__", repr(t) if qualified else str(t))
    if qualified:
        return f"{getattr(t, '__module__', None) or ''}.{name}".lstrip(".")
    return name.strip("_")
