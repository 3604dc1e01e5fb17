"""Make a traced graph follow train / eval mode, as the eager model does.

Terms:
  mode constant -- a Python value that tracing froze from ``self.training`` (timm passes
                   ``dropout_p = p if self.training else 0.`` to SDPA; ``F.dropout(x, p, self.training)``).
                   Tracing in one mode would bake that mode in: ``pm.eval()`` would still drop.
  ModeSwitch    -- a tiny argument-less module that returns the train-mode value or the eval-mode value
                   depending on its own ``training`` flag; a mode constant becomes a ``call_module`` node
                   of one, placed right before its user, so ``.train()`` / ``.eval()`` of any module
                   holding it (a stage, a checkpointed layer) switch it like a Dropout module.
  mode branch   -- a module whose forward runs *different operations* in the two modes (``if
                   self.training: ...``, timm's DropPath).  No single graph can hold both; that module
                   instance is traced as a leaf instead (one ``call_module`` node running its own
                   eager forward, which follows its mode).  A branch in the root module's own forward
                   cannot be a leaf and is refused with the node and source module named.

We trace twice (train, then eval; the model's flags restored after) and compare the graphs node by
node: same ops on the same inputs everywhere, differing only in constants, or not.  Where not, every
innermost module whose ops differ (``differing_modules``: timm's DropPath in each block of a
stochastic-depth model) becomes a leaf at once, and the two traces are compared again.
"""
from __future__ import annotations

from collections import defaultdict

import torch.fx as fx
from torch import nn

from autosplit.errors import TraceError


class ModeSwitch(nn.Module):
    """Returns ``train_value`` in training mode, ``eval_value`` in eval mode."""

    def __init__(self, train_value, eval_value):
        super().__init__()
        self.train_value, self.eval_value = train_value, eval_value

    def forward(self):
        return self.train_value if self.training else self.eval_value

    def extra_repr(self) -> str:
        return f"train={self.train_value!r}, eval={self.eval_value!r}"


class ModeBranch(Exception):
    """The two traces differ in structure at ``index`` (see ``first_difference``)."""

    def __init__(self, train_node: fx.Node | None, eval_node: fx.Node | None):
        self.train_node, self.eval_node = train_node, eval_node
        super().__init__(f"train-mode node {_describe(train_node)} vs eval-mode node {_describe(eval_node)}")


def _describe(node: fx.Node | None) -> str:
    if node is None:
        return "(none: the graph ended)"
    target = getattr(node.target, "__name__", node.target)
    return f"'{node.name}' ({node.op} {target})"


def _same_constant(a, b) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:           # e.g. tensors: compare by identity
        return a is b


_SLICE_FIELDS = ("start", "stop", "step")


def _holds_node(value) -> bool:
    """Does ``value`` (an fx argument: a node, a constant, or tuples / lists / dicts / slices of them)
    contain a node anywhere?"""
    found = []
    fx.node.map_arg(value, lambda n: found.append(n) or n)
    return bool(found)


def _pairs(a, b, index: dict, out: list, path: tuple) -> bool:
    """Walk two argument structures together; False on a structural difference; collects
    (path, train value, eval value) of differing constants in ``out``.

    Structures are every container fx keeps in a node's arguments: tuples (named ones too), lists,
    dicts and slices.  A slice is compared field by field: ``x[:, :H]`` with a traced ``H`` holds a
    node in ``slice(None, H)``, the same node in both modes, not a differing constant."""
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return isinstance(a, fx.Node) and isinstance(b, fx.Node) and index.get(a) == index.get(b)
    if isinstance(a, slice) and isinstance(b, slice):
        return all(_pairs(getattr(a, f), getattr(b, f), index, out, path + (f,)) for f in _SLICE_FIELDS)
    if isinstance(a, (tuple, list)) and type(a) is type(b):
        return len(a) == len(b) and all(_pairs(x, y, index, out, path + (i,)) for i, (x, y) in enumerate(zip(a, b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_pairs(a[k], b[k], index, out, path + (k,)) for k in a)
    if not _same_constant(a, b):
        if isinstance(a, (tuple, list, dict)) or isinstance(b, (tuple, list, dict)) or _holds_node(a) or _holds_node(b):
            return False        # a different structure, or graph values a mode constant cannot hold
        out.append((path, a, b))
    return True


def _replace_at(value, path: tuple, new):
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _replace_at(value[head], rest, new)}
    if isinstance(value, slice):
        fields = {f: getattr(value, f) for f in _SLICE_FIELDS}
        fields[head] = _replace_at(fields[head], rest, new)
        return slice(*(fields[f] for f in _SLICE_FIELDS))
    items = list(value)
    items[head] = _replace_at(items[head], rest, new)
    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)   # a namedtuple's fields


def mode_constants(train_gm: fx.GraphModule, eval_gm: fx.GraphModule) -> list[tuple[fx.Node, tuple, object, object]]:
    """(train-graph node, path in (args, kwargs), train value, eval value) for every constant that
    differs; raises ModeBranch at the first structural difference."""
    t_nodes, e_nodes = list(train_gm.graph.nodes), list(eval_gm.graph.nodes)
    t_index = {n: i for i, n in enumerate(t_nodes)}
    e_index = {n: i for i, n in enumerate(e_nodes)}
    found = []
    for i in range(max(len(t_nodes), len(e_nodes))):
        t = t_nodes[i] if i < len(t_nodes) else None
        e = e_nodes[i] if i < len(e_nodes) else None
        if t is None or e is None or t.op != e.op or not _same_target(t, e):
            raise ModeBranch(t, e)
        diffs: list = []
        index = {**t_index, **e_index}          # both map to positions; nodes of the two graphs are distinct
        if not _pairs((t.args, t.kwargs), (e.args, e.kwargs), index, diffs, ()):
            raise ModeBranch(t, e)
        found.extend((t, path, a, b) for path, a, b in diffs)
    return found


def _same_target(t: fx.Node, e: fx.Node) -> bool:
    return t.target == e.target if isinstance(t.target, str) else t.target is e.target


def follow_mode(gm: fx.GraphModule, constants: list, training: bool) -> None:
    """Replace each mode constant of ``gm`` by a ModeSwitch node (flag starts as ``training``)."""
    for k, (node, path, train_value, eval_value) in enumerate(constants):
        name = f"autosplit_mode_{k}"
        gm.add_submodule(name, ModeSwitch(train_value, eval_value).train(training))
        with gm.graph.inserting_before(node):
            switch = gm.graph.call_module(name, ())
        switch.meta["module_path"] = node.meta.get("module_path", "")   # keeps it in its layer's run
        args, kwargs = _replace_at((node.args, node.kwargs), path, switch)
        node.args, node.kwargs = tuple(args), dict(kwargs)
    gm.recompile()


def branch_module(model: nn.Module, err: ModeBranch) -> tuple[str, nn.Module]:
    """The innermost module (path, instance) whose forward holds the first structural difference;
    raises TraceError when that is the root (its own forward cannot become a leaf)."""
    for node in (err.train_node, err.eval_node):
        stack = node.meta.get("nn_module_stack") if node is not None else None
        if stack:
            path = list(stack.values())[-1][0]
            if path:
                return path, model.get_submodule(path)
    raise TraceError(
        f"the model's forward runs different operations in train and eval mode ({err}); autosplit traces "
        f"one graph that must follow pm.train() / pm.eval(), so it cannot hold both.  How to fix: move the "
        f"`if self.training` branch into a submodule (it is then run whole, as a leaf, in the current "
        f"mode), or express it with a value (e.g. p if self.training else 0.) instead of different ops.")


def differing_modules(train_gm: fx.GraphModule, eval_gm: fx.GraphModule) -> list[str]:
    """Paths of the innermost modules whose sequence of ops (op kind and target, arguments aside) differs
    between the two graphs: the modules a mode branch lies in, all found in one comparison (a model
    with stochastic depth has one per block: one trace per branch would cost a trace per block).
    Candidates only: ``mode_constants`` on the traces made with them as leaves is the check."""
    def ops_under(gm: fx.GraphModule) -> dict[str, list]:
        found: dict[str, list] = defaultdict(list)
        for node in gm.graph.nodes:
            for path, _ in (node.meta.get("nn_module_stack") or {}).values():
                if path:
                    found[path].append((node.op, node.target))
        return found
    train, eval_ = ops_under(train_gm), ops_under(eval_gm)
    differ = {p for p in train.keys() | eval_.keys() if not _same_ops(train.get(p, []), eval_.get(p, []))}
    return sorted(p for p in differ if not any(q.startswith(p + ".") for q in differ))


def _same_ops(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x[0] == y[0] and (x[1] == y[1] if isinstance(x[1], str) else x[1] is y[1])
                                    for x, y in zip(a, b))
