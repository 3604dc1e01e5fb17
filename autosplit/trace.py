"""Trace a model into a torch.fx graph, with errors a user can act on.

Terms:
  leaf module   -- a module the tracer records as one ``call_module`` node instead of tracing into it
                   (torch.nn built-ins such as Linear, Conv2d, MultiheadAttention; timm's registered
                   no-trace modules; anything the user lists in ``leaf_modules``).
  concrete args -- forward parameters fixed to a Python value while tracing (here: every parameter with a
                   default that the example input does not supply, e.g. timm's ``attn_mask=None``).
  mode          -- train / eval: the graph follows it (see trace_modes.py), like the eager model.
  module path   -- the dotted name of the module a node came from (``blocks.3.attn.qkv``), kept in
                   ``node.meta["module_path"]`` so stages and dumps can show the original names.
  concrete shapes -- with ``example_inputs``, proxies carry meta values and a branch on a shape is decided
                   at trace time, kept as a shape guard (trace_concrete.py); timm's registered no-trace
                   modules are then traced into, and become leaves only where that fails.
  leaf reason   -- why a module that is not torch's own op runs whole: ``node.meta["leaf"]`` on its
                   ``call_module`` node (the plan's summary lists them, trace_notes.py).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import traceback
from collections.abc import Iterator, Sequence

import torch
import torch.fx as fx
from torch import nn

from autosplit.errors import TraceError
from autosplit.passes.op_names import keeps_effect
from autosplit.trace_concrete import ConcreteTracer
from autosplit.trace_modes import ModeBranch, branch_module, differing_modules, follow_mode, mode_constants

_TORCH_DIR = os.path.dirname(torch.__file__)


def _timm_notrace():
    """timm registers modules and functions that torch.fx cannot trace through; honour them."""
    try:
        from timm.layers import _fx as timm_fx
    except ImportError:  # timm is a dependency, but tracing plain torch models must not need it
        return (), ()
    return tuple(timm_fx.get_notrace_modules()), tuple(timm_fx.get_notrace_functions())


class _Tracer(ConcreteTracer):
    """The concrete-shape tracer (trace_concrete.py) that remembers which module it is inside, for error
    messages, and which modules it traced into only because it had concrete shapes (``try_types``)."""

    def __init__(self, example_inputs: tuple | None, leaf_types: tuple[type, ...], try_types: tuple[type, ...],
                 autowrap_functions: tuple, leaf_ids: set[int] = frozenset()):
        super().__init__(example_inputs, autowrap_functions=autowrap_functions)
        self.leaf_types, self.try_types, self.leaf_ids = leaf_types, try_types, leaf_ids
        self.module_scope: list[tuple[str, nn.Module]] = []
        self.failed_scope: list[tuple[str, nn.Module]] | None = None

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return (isinstance(m, self.leaf_types) or id(m) in self.leaf_ids or super().is_leaf_module(m, qualname)
                or (self.example is None and isinstance(m, self.try_types)))

    def call_module(self, m, forward, args, kwargs):
        if self.computing:          # a leaf running on meta values (trace_concrete.py): not traced
            return super().call_module(m, forward, args, kwargs)
        self.module_scope.append((self.path_of_module(m), m))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_scope is None:   # the innermost module, recorded before unwinding
                self.failed_scope = list(self.module_scope)
            raise
        finally:
            self.module_scope.pop()


class _RetryAsLeaf(Exception):
    """Tracing into ``module`` (one torch.fx alone would keep whole) failed: trace again with it a leaf."""

    def __init__(self, path: str, module: nn.Module, cause: BaseException):
        self.path, self.module, self.cause = path, module, cause
        super().__init__(path)


def _user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost stack frame outside torch itself: the model's own source line."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_TORCH_DIR)]
    own = tuple(os.path.join("autosplit", f) for f in ("trace.py", "trace_concrete.py"))
    frames = [f for f in frames if not f.filename.endswith(own)]
    return frames[-1] if frames else None


def _explain(exc: BaseException, scope: list[tuple[str, nn.Module]]) -> TraceError:
    path, module = scope[-1] if scope else ("", None)
    where = f"module '{path or '<root>'}' ({type(module).__module__}.{type(module).__qualname__})" if module \
        else "the model's forward"
    frame = _user_frame(exc)
    line = f"\n  at {frame.filename}:{frame.lineno}: {frame.line}" if frame else ""
    leaf = type(module).__qualname__ if module is not None else "TheModule"
    return TraceError(
        f"torch.fx cannot trace {where}: {type(exc).__name__}: {exc}{line}\n"
        f"How to fix: make that module a leaf (autosplit.compile(..., leaf_modules=[{leaf}])), so it runs "
        f"whole and replicated; or fix the Python control flow that depends on tensor values with "
        f"concrete_args={{'name': value}}; or rewrite the branch with torch.where.")


class ModuleState:
    """What every module under a model holds, by identity, to put back after a planning run of its forward.

    Why: planning runs the model's code on proxies (tracing) and on meta tensors (shape propagation,
    whose leaves run their own forward).  A forward that keeps something on ``self`` (a lazily built
    index table with the N it was built for) then keeps a proxy or a meta tensor there, and the stage
    modules, which share these module objects, run with it later ("Tensor on device meta is not on the
    expected device cpu").  Which attributes a forward writes is decided by what the run did, never by
    their names: every entry of every module's ``__dict__`` and of its parameter, buffer and submodule
    tables that was added, replaced or removed is put back as it was.
    """

    _TABLES = ("_parameters", "_buffers", "_modules")

    def __init__(self, model: nn.Module):
        self._saved = [(m, dict(vars(m)), {t: dict(vars(m)[t]) for t in self._TABLES if t in vars(m)})
                       for m in model.modules()]

    def restore(self) -> None:
        for module, attrs, tables in self._saved:
            _put_back(vars(module), attrs)
            for name, entries in tables.items():
                _put_back(vars(module)[name], entries)


def _put_back(now: dict, saved: dict) -> None:
    """Make ``now`` hold exactly ``saved``'s entries (compared by identity: a tensor has no ``==``)."""
    for key in [k for k in now if k not in saved]:
        del now[key]
    for key, value in saved.items():
        if key not in now or now[key] is not value:
            now[key] = value


@contextlib.contextmanager
def kept_module_state(model: nn.Module) -> Iterator[None]:
    """Run a planning step on ``model`` and leave every one of its modules as it was (``ModuleState``)."""
    state = ModuleState(model)
    try:
        yield
    finally:
        state.restore()


def keeps_module_state(fn):
    """``fn(model, ...)`` as a planning step that leaves ``model``'s modules as they were (``kept_module_state``)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        model = args[0] if args else kwargs.get("model")
        if not isinstance(model, nn.Module):       # fn's own check refuses it
            return fn(*args, **kwargs)
        with kept_module_state(model):
            return fn(*args, **kwargs)
    return run


def _concrete_args(model: nn.Module, n_inputs: int, given: dict | None) -> dict:
    """Fix every forward parameter after the example inputs to its default value (or the user's)."""
    params = list(inspect.signature(model.forward).parameters.values())
    concrete = {}
    for p in params[n_inputs:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if given and p.name in given:
            concrete[p.name] = given[p.name]
        elif p.default is not inspect.Parameter.empty:
            concrete[p.name] = p.default
    return concrete


def trace(model: nn.Module, n_inputs: int = 1, *, leaf_modules: Sequence[type] = (),
          concrete_args: dict | None = None, example_inputs: Sequence[torch.Tensor] | None = None) -> fx.GraphModule:
    """Trace ``model`` (which is not modified) into a GraphModule sharing its parameters.

    The graph follows train / eval mode (trace_modes.py): the model is traced in both modes; constants
    frozen from ``self.training`` become ModeSwitch nodes, and a submodule whose ops differ between
    the modes is traced again as a leaf.  The model's own mode flags are restored afterwards.

    Args:
        model: the nn.Module.
        n_inputs: how many positional inputs the example has (later forward parameters take their
            defaults or ``concrete_args``).
        leaf_modules: module classes kept whole (one ``call_module`` node each).
        concrete_args: forward parameters fixed to a value.
        example_inputs: the ``n_inputs`` inputs (any device; only shapes and dtypes are read): tracing
            with concrete shapes (trace_concrete.py), where a branch on a shape is decided from them and
            kept as a shape guard, and timm's no-trace modules are traced into.  None: plain symbolic
            tracing, timm's no-trace modules kept whole.
    """
    if example_inputs is not None and len(example_inputs) != n_inputs:
        raise TraceError(f"trace: {len(example_inputs)} example inputs for n_inputs={n_inputs}")
    if example_inputs is not None:
        # symbolic first: running every op on meta tensors too costs ~2.5x the trace (0.5 s of a 1.2 s
        # compile of a small ViT), and where symbolic tracing succeeds and keeps none of timm's no-trace
        # modules whole, the concrete trace records the same graph (no shape was turned into a value)
        try:
            gm = _trace_modes(model, n_inputs, leaf_modules, concrete_args, None)
        except TraceError:
            gm = None
        if gm is not None and not _keeps_notrace_modules(gm):
            return gm
    return _trace_modes(model, n_inputs, leaf_modules, concrete_args, example_inputs)


def _keeps_notrace_modules(gm: fx.GraphModule) -> bool:
    """Does ``gm`` run one of timm's no-trace modules whole (concrete shapes may trace into it)?"""
    notrace, _ = _timm_notrace()
    return any(n.op == "call_module" and isinstance(gm.get_submodule(n.target), notrace) for n in gm.graph.nodes)


def _trace_modes(model: nn.Module, n_inputs: int, leaf_modules, concrete_args, example_inputs) -> fx.GraphModule:
    """``trace``'s body: both modes traced, compared, and the graph made to follow the mode."""
    flags = {m: m.training for m in model.modules()}
    state = ModuleState(model)
    leaf_ids: dict[int, str] = {}              # id(module) -> why it was made a leaf here
    try:
        for _ in range(len(flags) + 1):        # each round makes one or more modules leaves
            try:
                # each trace starts from the model as the user gave it: what the train-mode trace left on
                # a module (a cache its forward filled) would make the eval-mode trace read it as an
                # attribute and differ, making that module a leaf for no reason of its own
                state.restore()
                model.train(True)
                train_gm = _trace_once(model, n_inputs, leaf_modules, concrete_args, leaf_ids, example_inputs)
                state.restore()
                model.train(False)
                eval_gm = _trace_once(model, n_inputs, leaf_modules, concrete_args, leaf_ids, example_inputs)
                constants = mode_constants(train_gm, eval_gm)
                break
            except ModeBranch as branch:
                why = "its forward runs different operations in train and eval mode (trace_modes.py)"
                found = [model.get_submodule(p) for p in differing_modules(train_gm, eval_gm)]
                found = [m for m in found if id(m) not in leaf_ids]
                if not found:                   # the first difference's module (the root: refused there)
                    path, module = branch_module(model, branch)
                    if id(module) in leaf_ids:  # defensive: a leaf cannot differ inside
                        raise TraceError(f"module '{path}' differs between train and eval mode even as a leaf"
                                         ) from branch
                    found = [module]
                leaf_ids.update((id(m), why) for m in found)
            except _RetryAsLeaf as retry:
                leaf_ids[id(retry.module)] = (f"timm registers {type(retry.module).__qualname__} as not traceable by "
                                              f"torch.fx, and tracing it with concrete shapes failed: "
                                              f"{_first_line(retry.cause)}")
    finally:
        state.restore()         # the training flags too
    follow_mode(train_gm, constants, model.training)
    return train_gm


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _trace_once(model: nn.Module, n_inputs: int, leaf_modules, concrete_args, leaf_ids: dict[int, str],
                example_inputs) -> fx.GraphModule:
    timm_leaves, timm_functions = _timm_notrace()
    tracer = _Tracer(None if example_inputs is None else tuple(example_inputs), tuple(leaf_modules), timm_leaves,
                     timm_functions, leaf_ids)
    concrete = _concrete_args(model, n_inputs, concrete_args)
    # fx stores each tensor the forward creates as a constant (``_tensor_constant0``) on the root, i.e.
    # on the user's model; the GraphModule has its own reference.  The caller (``trace``) removes them
    # with everything else the trace wrote: left there, the next trace (the other mode) would number
    # its constants from 2 and the modes would differ by name only, making the module holding them a
    # leaf (beit's and eva02's attention were).
    try:
        graph = tracer.trace(model, concrete_args=concrete or None)
        gm = fx.GraphModule(tracer.root, graph, model.__class__.__name__)
    except TraceError:
        raise
    except Exception as exc:  # fx raises many types (TraceError, TypeError, RuntimeError ...)
        tried = [(p, m) for p, m in tracer.failed_scope or [] if isinstance(m, tracer.try_types)]
        if tried and tracer.example is not None:    # the innermost one fx alone keeps whole: keep it whole
            raise _RetryAsLeaf(*tried[-1], exc) from exc
        raise _explain(exc, tracer.failed_scope or []) from exc
    _drop_concrete_placeholders(gm.graph, n_inputs)
    gm.recompile()
    for node in gm.graph.nodes:
        node.meta["module_path"] = _module_path(node)
        if node.op == "call_module":
            why = _leaf_reason(gm.get_submodule(node.target), tracer)
            if why:
                node.meta["leaf"] = why
    return gm


def _leaf_reason(module: nn.Module, tracer: _Tracer) -> str | None:
    """Why ``module`` runs whole, where that is not because it is torch's own op (None then)."""
    if id(module) in tracer.leaf_ids:
        return tracer.leaf_ids[id(module)]
    if isinstance(module, tracer.leaf_types):
        return "listed in leaf_modules"
    if isinstance(module, tracer.try_types):
        return (f"timm registers {type(module).__qualname__} as not traceable by torch.fx (traced without "
                f"example inputs, so not with concrete shapes)")
    return None


def _module_path(node: fx.Node) -> str:
    if node.op in ("call_module", "get_attr"):
        target = str(node.target)
        return target if node.op == "call_module" else target.rpartition(".")[0]
    stack = node.meta.get("nn_module_stack")
    if stack:
        path, _ = list(stack.values())[-1]
        return path
    return ""


def _drop_concrete_placeholders(graph: fx.Graph, n_inputs: int) -> None:
    """Replace placeholders fx made for concrete args (they carry a default) by their value.

    fx keeps them, guarded by ``_assert_is_none`` / ``_assert`` checks; once the value is substituted
    those checks have constant arguments, so we remove them and let dead-code elimination do the rest.
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node in placeholders[n_inputs:]:
        _substitute(node, node.args[0] if node.args else None)
        graph.erase_node(node)
    checks = (torch._assert, fx._symbolic_trace._assert_is_none)
    for node in list(graph.nodes):  # forward order, so folded constants flow into later nodes
        if node.op != "call_function" or node.all_input_nodes:
            continue
        if node.target in checks:
            graph.erase_node(node)
        elif getattr(node.target, "__module__", None) == "_operator":  # e.g. `False == False`
            _substitute(node, node.target(*node.args, **node.kwargs))
            graph.erase_node(node)
    graph.eliminate_dead_code(is_impure_node=keeps_effect)   # an unused h.add_(g) still writes h


def _substitute(node: fx.Node, value) -> None:
    """Replace every use of ``node`` by the constant ``value``."""
    for user in list(node.users):
        # map_aggregate, not pytree: it also looks inside slices (x[:, :n] holds n in a slice)
        user.args = fx.node.map_aggregate(user.args, lambda a: value if a is node else a)
        user.kwargs = fx.node.map_aggregate(user.kwargs, lambda a: value if a is node else a)
