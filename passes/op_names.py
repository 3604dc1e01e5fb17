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


_INPLACE_OPERATORS = {"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor",
                      "ilshift", "irshift", "imatmul"}


def inplace_base(node: fx.Node, gm: fx.GraphModule) -> str | None:
    """For an op that writes its first operand in place (``x.add_(y)``, ``x += y``, ``F.relu(x,
    inplace=True)``), the short name of the op it computes (``add``, ``relu``); None for any other op.

    Terms: ``writes`` -- the op's first operand is the tensor it writes and returns; every other
    reader of that tensor afterwards sees the new values (the rules must keep that one tensor)."""
    if node.op == "call_method":
        name = str(node.target)
        return name[:-1] if name.endswith("_") and not name.endswith("__") else None
    if node.op != "call_function":
        return None
    name = op_name(node, gm)
    if getattr(node.target, "__module__", None) in ("_operator", "operator") and name in _INPLACE_OPERATORS:
        return name[1:]
    if node.kwargs.get("inplace") is True:
        return name
    return None


def writes_input(node: fx.Node) -> bool:
    """Does ``node`` write a tensor in place (or through ``out=``)?  Such a node has an effect even when
    nothing reads its result: dead-code elimination must keep it."""
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    if node.op != "call_function":
        return False
    name = getattr(node.target, "__name__", "")
    return (getattr(node.target, "__module__", None) in ("_operator", "operator") and name in _INPLACE_OPERATORS) \
        or node.kwargs.get("inplace") is True or node.kwargs.get("out") is not None or name == "setitem"


def keeps_effect(node: fx.Node) -> bool:
    """``is_impure_node`` for ``Graph.eliminate_dead_code``: torch.fx's own notion, plus in-place writes
    (fx treats every method call as pure, so an unused ``h.add_(g)`` would be dropped)."""
    return node.is_impure() or writes_input(node)
