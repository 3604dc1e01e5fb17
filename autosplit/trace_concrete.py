"""Tracing with concrete shapes: proxies that carry meta values, so a branch on a shape is decided.

Terms:
  meta value  -- what a traced value would be for the example inputs, computed while tracing by running
                 each recorded op on meta tensors (shapes, strides and dtypes, no data): a tensor on the
                 meta device, or a Python value (``x.shape[1] % 7``, ``len(x)``, ``int(N ** 0.5)``).
                 Unknown where the op cannot run on meta tensors (it reads data: ``.item()``).
  decision    -- Python turning a traced value into a plain one (``bool``, ``int``, ``len``, an index,
                 ``float``, iterating it).  torch.fx refuses every decision; here one whose meta value is
                 a Python value is taken from that value (as Colossal-AI's ColoTracer and Hugging Face's
                 fx tracer do).  A decision on a tensor (its values: unknown when planning), on an unknown
                 value, or on one derived from a tensor's device / dtype / requires_grad (which a run
                 may change: another device, autocast, no_grad) is still refused as torch.fx refuses it.
  shape guard -- each decision is also recorded in the graph, where it was taken: a ``shape_guard``
                 node recomputes the value from the tensors of the run and refuses the call
                 (``ShapeGuardError``) when it differs from the traced one, since the graph holds only the
                 branch taken for the example's shapes.  Shape propagation at other sizes runs it too.
"""
from __future__ import annotations

import inspect
import linecache
import operator
import os

import torch
import torch.fx as fx
from torch.fx.node import has_side_effect, map_aggregate
from torch.fx.proxy import Attribute

from autosplit.errors import AutosplitError

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_FILES = tuple(os.path.join(os.path.dirname(__file__), f) for f in ("trace.py", "trace_concrete.py",
                                                                         "trace_modes.py"))
# reads whose value a run may change (another device, autocast's dtypes, no_grad): never decided
_RUN_DEPENDENT = frozenset({"device", "dtype", "is_cuda", "is_cpu", "is_meta", "is_mps", "is_xpu", "requires_grad",
                            "get_device", "type"})
_CONVERT = {"bool": bool, "int": int, "index": operator.index, "float": float, "len": len}
_UNKNOWN = object()


class ShapeGuardError(AutosplitError):
    """A traced graph called with shapes for which the model's code would have branched otherwise."""


@has_side_effect            # an impure node: dead-code elimination keeps it though nothing reads it
def shape_guard(value, how: str, expected, where: str) -> None:
    """Refuse the run unless ``how(value) == expected``, the decision taken when the graph was traced."""
    got = _CONVERT[how](value)
    if got != expected:
        raise ShapeGuardError(
            f"shape guard at {where}: when the plan was traced the model's code took {how}(...) = {expected!r} "
            f"from the example input's shapes, and this call gives {got!r}; the graph holds only the branch "
            f"taken for those shapes.  Plan again for these inputs (autosplit.compile(..., example_input=<a "
            f"microbatch of this shape>)), or call it with the shapes it was planned for.")


def is_guard(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is shape_guard


class _Decides:
    """Proxy methods that turn a traced value into a Python one: the tracer decides them."""

    def __getattr__(self, k: str):
        return _DecidingAttribute(self, k)

    def __len__(self) -> int:
        return self.tracer.decide(self, "len")

    def __int__(self) -> int:
        return self.tracer.decide(self, "int")

    def __index__(self) -> int:
        return self.tracer.decide(self, "index")

    def __float__(self) -> float:
        return self.tracer.decide(self, "float")

    def __setitem__(self, key, value) -> None:
        # a write into a traced tensor (``t[:, :, 2] = y``, a buffer built from a traced size): a node,
        # kept by dead-code elimination (op_names.keeps_effect), as Hugging Face's fx tracer records it
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


class DecidingProxy(_Decides, fx.Proxy):
    pass


class _DecidingAttribute(_Decides, Attribute):
    pass


def _where() -> str:
    """``file:line (`source`)`` of the model's code taking the decision (the innermost frame outside torch
    and this tracer)."""
    frame = inspect.currentframe()
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH_DIR) and name not in _OWN_FILES:
            short = name.rpartition("site-packages" + os.sep)[2]
            short = os.path.relpath(short) if short.startswith(os.getcwd() + os.sep) else short
            return f"{short}:{frame.f_lineno} (`{linecache.getline(name, frame.f_lineno).strip()}`)"
        frame = frame.f_back
    return "<unknown>"


class ConcreteTracer(fx.Tracer):
    """An fx.Tracer whose proxies carry meta values (``example_inputs`` given) and decide on shapes.

    Args:
        example_inputs: the model's positional inputs (any device: only shapes, strides and dtypes are
            read), or None: no meta values, every decision refused as torch.fx refuses it.
        autowrap_functions: as for ``fx.Tracer``.
    """

    def __init__(self, example_inputs: tuple | None, autowrap_functions: tuple = ()):
        super().__init__(autowrap_functions=autowrap_functions)
        self.values: dict[fx.Node, object] = {}       # node -> its meta value (absent: unknown)
        self.run_dependent: set[fx.Node] = set()      # nodes whose Python value a run may change
        self._metas: dict[int, tuple] = {}            # id(tensor) -> (tensor, its meta copy)
        self._states: dict[int, dict] = {}            # id(module) -> its parameters and buffers on meta
        self._placeholders = 0
        self.computing = False        # running an op on meta values: module calls and reads are not traced
        self.example = None if example_inputs is None else tuple(self._meta(x) for x in example_inputs)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return DecidingProxy(node, self)

    # fx patches nn.Module's __call__ and __getattr__ while it traces; running a leaf on meta values
    # must call its submodules and read its (meta) parameters as plain Python does
    def call_module(self, m, forward, args, kwargs):
        if self.computing:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if self.computing:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    # -- meta values -----------------------------------------------------------------------------
    def _meta(self, value):
        if not isinstance(value, torch.Tensor) or value.device.type == "meta":
            return value
        key = id(value)
        if key not in self._metas:       # the tensor is kept with its copy: its id stays its own
            m = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
            self._metas[key] = (value, m.requires_grad_(value.requires_grad) if value.is_floating_point() else m)
        return self._metas[key][1]

    def _arg(self, a):
        if isinstance(a, fx.Proxy):
            value = self.values.get(a.node, _UNKNOWN)
            if value is _UNKNOWN:
                raise LookupError(a.node.name)
            return value
        return self._meta(a)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if self.example is not None:
            self._record(proxy.node, kind, target, args, kwargs)
        return proxy

    def _record(self, node: fx.Node, kind: str, target, args, kwargs) -> None:
        try:
            value = self._compute(kind, target, args, kwargs)
        except Exception:       # noqa: BLE001  (an op that cannot run on meta tensors: its value is unknown)
            return
        if value is _UNKNOWN:
            return
        self.values[node] = value
        reads = target if kind == "call_method" else args[1] if target is getattr and len(args) > 1 else None
        tainted = any(isinstance(a, fx.Proxy) and a.node in self.run_dependent
                      for a in _flat((args, kwargs)))
        if (reads in _RUN_DEPENDENT or tainted) and not isinstance(value, torch.Tensor):
            self.run_dependent.add(node)     # a tensor made with x.device / x.dtype keeps only its shape

    def _compute(self, kind: str, target, args, kwargs):
        if kind == "placeholder":
            i, self._placeholders = self._placeholders, self._placeholders + 1
            return self.example[i] if i < len(self.example) else _UNKNOWN
        if kind == "output":
            return _UNKNOWN
        args, kwargs = map_aggregate(args, self._arg), map_aggregate(kwargs, self._arg)
        self.computing = True
        try:
            with torch.device("meta"):      # tensors the op makes without a device are meta tensors too
                if kind == "get_attr":
                    value = self.root
                    for part in str(target).split("."):
                        value = getattr(value, part)
                    return self._meta(value)
                if kind == "call_function":
                    return target(*args, **kwargs)
                if kind == "call_method":
                    return getattr(args[0], target)(*args[1:], **kwargs)
                module = self.root.get_submodule(target)
                return torch.func.functional_call(module, self._state(module), tuple(args), kwargs, strict=False)
        finally:
            self.computing = False

    def _state(self, module: torch.nn.Module) -> dict:
        if id(module) not in self._states:
            self._states[id(module)] = {n: self._meta(t) for n, t in [*module.named_parameters(),
                                                                       *module.named_buffers()]}
        return self._states[id(module)]

    # -- decisions --------------------------------------------------------------------------------
    def to_bool(self, obj: fx.Proxy) -> bool:
        return self.decide(obj, "bool")

    def iter(self, obj: fx.Proxy):
        return (obj[i] for i in range(self.decide(obj, "len")))

    def decide(self, proxy: fx.Proxy, how: str):
        """The Python value ``how(proxy)`` (bool, int, index, float, len) from its meta value, recorded as
        a shape guard; refused as torch.fx refuses it where that value is not a shape's."""
        node = proxy.node
        value = self.values.get(node, _UNKNOWN)
        if value is _UNKNOWN or isinstance(value, torch.Tensor) or node in self.run_dependent:
            self._refuse(proxy, how, value)
        decided = _CONVERT[how](value)
        self.create_proxy("call_function", shape_guard, (proxy, how, decided, _where()), {})
        return decided

    def _refuse(self, proxy: fx.Proxy, how: str, value):
        if isinstance(value, torch.Tensor):
            why = "it is a tensor's values, which planning does not know (it sees shapes only)"
        elif proxy.node in self.run_dependent:
            why = "it is read from a tensor's device, dtype or requires_grad, which a run may change"
        elif self.example is None:
            why = "no example input was given to take it from"
        else:
            why = "the op making it cannot run on meta tensors (it reads data)"
        if how == "bool":
            raise fx.proxy.TraceError(f"symbolically traced variables cannot be used as inputs to control flow "
                                      f"({why})")
        raise fx.proxy.TraceError(f"{how}() of a traced value cannot be decided when tracing ({why})")


def _flat(value) -> list:
    found: list = []
    map_aggregate(value, lambda a: found.append(a) or a)
    return found
