"""Propagate shapes and dtypes through a traced graph on the meta device.

Terms:
  meta tensor -- a tensor on ``torch.device("meta")``: shape, dtype and strides, no storage.  Running the
                 graph on meta tensors costs no memory, so a 22-billion-parameter model plans on a laptop.
  val         -- ``node.meta["val"]``: the node's result computed on meta tensors (a tensor, a tuple of
                 them, or a plain Python value such as an int from ``x.shape[0]``).

The model's own parameters may be real or already on meta; real ones are swapped for meta stand-ins
per call (``torch.func.functional_call``), so nothing is copied or allocated.

  memo        -- within one propagation, the result of an op on meta inputs is a function of the op, its
                 inputs' metadata (shape, stride, offset, dtype) and its other arguments; a ViT repeats the
                 same block dozens of times, so each (op, metadata) is computed once and its result's
                 metadata replayed for the repeats (fresh meta tensors: nothing aliases).  Only what is
                 known pure is memoized: functions and methods that are not in-place, and torch.nn's own
                 modules keyed by their configuration (``extra_repr``) and parameter shapes; a value
                 that is not plain data (a real tensor, an object) is never memoized.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from autosplit.errors import REPORT, AutosplitError, PlanError
from autosplit.passes.infra import MetaPass
from autosplit.passes.op_registry import writes_inputs


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


_PLAIN = (bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout, type(None),
          type(Ellipsis))


def _meta_key(value):
    """A hashable description of ``value``'s metadata, or None where it holds anything but meta tensors
    and plain data (then the call is not memoized)."""
    leaves, spec = tree_flatten(value, is_leaf=lambda x: isinstance(x, torch.Size))   # pytree rebuilds a tuple
    out = []
    for x in leaves:
        if isinstance(x, torch.Size):
            out.append((torch.Size, tuple(x)))
        elif isinstance(x, torch.Tensor):
            if x.device.type != "meta":
                return None
            out.append((tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.requires_grad))
        elif isinstance(x, slice) and all(isinstance(v, _PLAIN) for v in (x.start, x.stop, x.step)):
            out.append((slice, x.start, x.stop, x.step))
        elif isinstance(x, _PLAIN):
            out.append((type(x), x))
        else:
            return None
    return spec, tuple(out)


def _replayable(key) -> bool:
    """A result is replayed as fresh meta tensors that do not require grad: one that does (an input
    returned as it is, e.g. ``p.contiguous()`` of a parameter) is not memoized."""
    return key is not None and not any(len(x) == 5 and x[4] for x in key[1])


def _rebuild(key):
    """Fresh meta tensors (and the plain values) a ``_meta_key`` describes."""
    spec, leaves = key
    out = []
    for x in leaves:
        if x[0] is slice:
            out.append(slice(*x[1:]))
        elif x[0] is torch.Size:
            out.append(torch.Size(x[1]))
        elif isinstance(x[0], type):
            out.append(x[1])
        else:
            shape, stride, offset, dtype, _ = x
            size = offset + 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else offset
            out.append(torch.empty(size, dtype=dtype, device="meta").as_strided(shape, stride, offset))
    return tree_unflatten(out, spec)


def _pure_target(target) -> bool:
    """torch's functions and Tensor methods (a method's target is its name) that do not write their
    inputs, and the operator module's and builtins' functions but item assignment.  A user function
    (a ``torch.fx.wrap``-ed leaf) might read state that changes between calls: never memoized."""
    if writes_inputs(target):          # the registry: in-place forms, item assignment
        return False
    if isinstance(target, str) or isinstance(target, torch._ops.OpOverload) or getattr(target, "meta_pure", False):
        return True     # meta_pure: a function that says so (autosplit.tp.ops' collectives)
    return (getattr(target, "__module__", None) or "").split(".")[0] in ("torch", "_operator", "operator", "builtins")


class _MetaInterpreter(fx.Interpreter):
    def __init__(self, module, memo: bool = True):
        super().__init__(module)
        self._memo: dict | None = {} if memo else None   # (op, target, inputs' metadata) -> result's metadata

    def _memoized(self, op: str, target, what, args, kwargs, compute):
        key = _meta_key((args, kwargs)) if self._memo is not None and "out" not in kwargs else None
        if key is None or what is None:
            return compute()
        key = (op, target, what, key)
        if key in self._memo:
            return _rebuild(self._memo[key])
        result = compute()
        recorded = _meta_key(result)
        if _replayable(recorded):
            self._memo[key] = recorded
        return result

    def call_function(self, target, args, kwargs):
        compute = lambda: super(_MetaInterpreter, self).call_function(target, args, kwargs)
        return self._memoized("f", target, True if _pure_target(target) else None, args, kwargs, compute)

    def call_method(self, target, args, kwargs):
        compute = lambda: super(_MetaInterpreter, self).call_method(target, args, kwargs)
        return self._memoized("m", target, True if _pure_target(target) else None, args, kwargs, compute)

    def get_attr(self, target, args, kwargs):
        return to_meta(super().get_attr(target, args, kwargs))

    def call_module(self, target, args, kwargs):
        module = self.fetch_attr(target)
        what = None
        if (type(module).__module__.startswith("torch.nn.modules.") and not any(True for _ in module.children())
                and not any(True for _ in module.buffers())):
            # torch.nn's own layers: their forward depends on the parameters' shapes and the configuration
            # extra_repr prints (features, eps, p, ...); user modules may read anything, so never memoized
            what = (type(module), module.extra_repr(), module.training,
                    tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()))
        return self._memoized("mod", None, what, args, kwargs, lambda: self._call_module(module, args, kwargs))

    def _call_module(self, module, args, kwargs):
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

    def __init__(self, example_inputs: tuple, memo: bool = True):
        """``memo=False`` computes every node (the memo's tests compare the two)."""
        self.example_inputs, self.memo = to_meta(tuple(example_inputs)), memo

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        with torch.no_grad():
            _MetaInterpreter(graph_module, self.memo).run(*self.example_inputs)
        return PassResult(graph_module, False)


def tensor_bytes(value) -> int:
    """Total bytes of the tensors inside a ``val``."""
    if isinstance(value, torch.Tensor):       # most values: no pytree walk (the search annotates 10^5 nodes)
        return value.numel() * value.element_size()
    return sum(x.numel() * x.element_size() for x in tree_leaves(value) if isinstance(x, torch.Tensor))


class ExampleShapeProp(MetaShapeProp):
    """MetaShapeProp of the user's example microbatch, with a failure put where it belongs.

    Terms:
      ours -- the graph we built fails where the model itself does not: its own forward runs on the
              example (on meta tensors), or the graph is one our rewrite made after a propagation that
              passed.  A PlanError naming the node and module path, saying it is an autosplit bug.
      theirs -- the model's own forward fails on the example too: the example's shapes are shown with
              what it must be (one microbatch, batch dim first), the usual cause, and the model's error.
    """

    def __init__(self, example_inputs: tuple, memo: bool = True, model=None, concrete_args: dict | None = None):
        """``model``: the user's model, whose forward decides whose failure it is; None for a graph that
        our rewrite made (tensor parallelism), after the model's own graph propagated.
        ``concrete_args``: the forward parameters the trace fixed ({name: value}), passed to that forward."""
        super().__init__(example_inputs, memo)
        self.model, self.concrete_args = model, dict(concrete_args or {})

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        try:
            return super().call(graph_module)
        except AutosplitError as exc:
            own = _eager_failure(self.model, self.example_inputs, self.concrete_args) if self.model is not None else None
            if self.model is None or own is None:
                where = "the tensor-parallel rewrite's graph" if self.model is None else \
                    "the traced graph (the model's own forward runs on this example_input)"
                raise PlanError(f"{exc}\nThis fails in {where}: {REPORT}") from exc
            shapes = ", ".join(str(tuple(x.shape)) for x in self.example_inputs)
            raise AutosplitError(f"{exc}\nexample_input has shape {shapes}; it must be one microbatch of what the "
                                 f"model's forward takes, batch dim first (e.g. (B, C, H, W)); the model's own "
                                 f"forward fails on it too: {type(own).__name__}: {_first_part(own)}") from exc


def _eager_failure(model: torch.nn.Module, inputs: tuple, kwargs: dict) -> Exception | None:
    """The error the model's own forward raises on ``inputs`` and ``kwargs`` (its concrete args), or
    None when it runs.  First on meta tensors, with meta stand-ins for every parameter and buffer
    (non-persistent ones too: ``state_dict`` leaves those out, and a real buffer among meta tensors
    fails for a reason of its own); nothing is allocated.  A forward that cannot run on meta (it
    reads a value, ``.item()``) then runs on zeros on the model's device, as a leaf does in
    ``_call_module``, with copies of its buffers."""
    metas: dict[int, torch.Tensor] = {}       # tied tensors share one stand-in (functional_call checks ties)
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    state = {name: metas.setdefault(id(t), to_meta(t)) for name, t in named}
    try:
        with torch.no_grad():
            torch.func.functional_call(model, state, tuple(inputs), dict(kwargs))
        return None
    except Exception as exc:        # noqa: BLE001  (any failure of the user's forward is the answer)
        on_meta = exc
    if any(t.device.type == "meta" for _, t in named):
        return on_meta               # a model on meta has no values to run on
    # copies of the buffers take what the forward writes (BatchNorm's running stats): the model is left as it was
    clones: dict[int, torch.Tensor] = {}
    copies = {name: clones.setdefault(id(b), b.clone()) for name, b in model.named_buffers(remove_duplicate=False)}
    device = named[0][1].device if named else torch.device("cpu")     # where the model's tensors are
    zeros = tree_map(lambda x: torch.zeros(x.shape, dtype=x.dtype, device=device) if isinstance(x, torch.Tensor)
                     else x, tuple(inputs))
    try:
        with torch.no_grad():
            torch.func.functional_call(model, copies, zeros, dict(kwargs))
    except Exception as exc:        # noqa: BLE001
        return exc
    return None
