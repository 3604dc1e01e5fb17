"""What a graph node runs, by one name: the rule tables of the passes and the cost model's listings.

Terms:
  short name     -- the called module's class name, the Tensor method, or the function's name without
                    a dunder's underscores (``Linear``, ``view``, ``add`` for ``operator.__add__``): what
                    rule tables are keyed by.  An in-place op keeps its trailing underscore in both
                    forms (``x.relu_()`` and ``torch.relu_(x)`` are both ``relu_``), so a rule keyed by
                    ``relu`` never takes a write for a read; ``inplace_base`` names the op it computes.
  qualified name -- the same with where it comes from (``torch.nn.modules.linear.Linear``,
                    ``Tensor.view``, ``_operator.add``): what listings such as "ops without a cost rule"
                    show, so two ops of the same short name stay apart.
  in-place op    -- one that writes its first operand and returns it: a Tensor method or a function
                    whose name ends in one ``_`` (``x.add_(y)``, ``torch.relu_(x)``, ``F.relu_(x)``), an
                    augmented operator (``x += y``: ``operator.iadd``), or ``inplace=True``.  The
                    operator module's ``and_`` / ``or_`` / ``not_`` ... are plain ops spelled around
                    keywords, not in-place ones.
"""
from __future__ import annotations

import torch.fx as fx

_OPERATOR_MODULES = ("_operator", "operator")
_INPLACE_OPERATORS = {"iadd": "+", "isub": "-", "imul": "*", "itruediv": "/", "ifloordiv": "//", "imod": "%",
                      "ipow": "**", "iand": "&", "ior": "|", "ixor": "^", "ilshift": "<<", "irshift": ">>",
                      "imatmul": "@"}     # x += y is operator.iadd: the symbol, for messages


def _function_name(target) -> str:
    return getattr(target, "__name__", "") or ""


def _underscore_inplace(name: str) -> bool:
    """``relu_``, ``add_``: one trailing underscore (``__add__`` is a dunder, not a write)."""
    return name.endswith("_") and not name.endswith("__")


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
    if name.startswith("__") and name.endswith("__"):
        return name[2:-2]                             # operator.__add__ -> add
    if _underscore_inplace(name) and getattr(t, "__module__", None) not in _OPERATOR_MODULES:
        return name.lstrip("_")                       # torch.relu_ -> relu_, as x.relu_() is
    return name.strip("_")


def inplace_base(node: fx.Node, gm: fx.GraphModule | None = None) -> str | None:
    """For an op that writes its first operand in place (``x.add_(y)``, ``torch.relu_(x)``, ``x += y``,
    ``F.relu(x, inplace=True)``), the short name of the op it computes (``add``, ``relu``); None for
    any other op (``gm`` is not needed: modules are never in-place here).

    Terms: ``writes`` -- the op's first operand is the tensor it writes and returns; every other
    reader of that tensor afterwards sees the new values (the rules must keep that one tensor)."""
    if node.op == "call_method":
        name = str(node.target)
        return name[:-1] if _underscore_inplace(name) else None
    if node.op != "call_function":
        return None
    name = _function_name(node.target).strip("_")     # operator.__iadd__ -> iadd
    if getattr(node.target, "__module__", None) in _OPERATOR_MODULES:
        return name[1:] if name in _INPLACE_OPERATORS else None
    if _underscore_inplace(_function_name(node.target)):
        return name                                    # torch.relu_ -> relu
    if node.kwargs.get("inplace") is True:
        return name
    return None


def writes_input(node: fx.Node) -> bool:
    """Does ``node`` write a tensor in place: an in-place op (``inplace_base``), an ``out=`` argument, or
    item assignment (``x[i] = v``, which computes no op of its own)?  Such a node has an effect even
    when nothing reads its result: dead-code elimination must keep it."""
    if inplace_base(node) is not None:
        return True
    return node.op == "call_function" and (node.kwargs.get("out") is not None or
                                           _function_name(node.target) in ("setitem", "__setitem__"))


def out_of_place(node: fx.Node) -> str:
    """How to write the in-place op ``node`` out of place, for messages: ``x = x + y`` for ``x += y``,
    ``x = x.relu()`` for ``x.relu_()`` / ``torch.relu_(x)``."""
    name = _function_name(node.target).strip("_") if node.op == "call_function" else ""
    if name in _INPLACE_OPERATORS:
        return f"x = x {_INPLACE_OPERATORS[name]} y, not x {_INPLACE_OPERATORS[name]}= y"
    return f"x = x.{inplace_base(node)}(...)"


def keeps_effect(node: fx.Node) -> bool:
    """``is_impure_node`` for ``Graph.eliminate_dead_code``: torch.fx's own notion, plus in-place writes
    (fx treats every method call as pure, so an unused ``h.add_(g)`` would be dropped)."""
    return node.is_impure() or writes_input(node)
