"""What an op is, declared once: the passes and the cost model ask here and never compare an op's name.

Terms:
  entry      -- one op, keyed by its short name (passes/op_names.py: the function, the Tensor method or
                the module class), with everything the passes read about it.  An in-place form
                (``x.add_(y)``, ``x += y``, ``F.relu(x, inplace=True)``) is its base's entry.
  kind       -- linear (a weight's GEMM: F.linear, nn.Linear), conv, gemm (two activations or a grid's
                block product: matmul, linear_2d), attention, norm, softmax, pointwise, view, reduction,
                scan, random, shape (reads a shape: ``size``), count (``numel``), rank (``dim``), attr
                (``getattr``), gather (embedding), opaque (anything not declared).
  shard      -- the sharding rule: the ``Rules`` method of passes/sharding/rules.py building its OpRule
                (``"_" + shard``); empty: no rule (opaque), or one chosen by module class there.
  linear_in  -- which operands a Partial (unsummed) value may pass through: "all" (add), "one" with the
                others Replicate (mul), "first" (views, div), or "" (OpRule.linear).
  reduce     -- a reduction's output: "partial" (a shard of the reduced dim gives a Partial sum: sum)
                or "whole" (the dim is needed whole: mean, max).
  weighted   -- takes (input, weight, bias): a split bias is added after the Partial sum.
  fresh_grad -- its backward makes a new tensor for its input's gradient (a GEMM's, a norm's).
  random     -- draws random numbers: None (never), "" (always), or the argument holding the probability
                that makes it random when not 0 (SDPA's ``dropout_p``).
  rowwise    -- every index of the dims the op keeps is computed from the same index alone (pointwise ops,
                norms over trailing dims, linears and convolutions over their leading dims): a padded dim
                may stay split through it (OpRule.rowwise), and a run of such ops may be split into row
                chunks (passes/tp_overlap.py).
  writes     -- writes its first operand though it has no in-place spelling (item assignment): never
                memoized, never dropped (passes/shape_prop.py).
  other      -- the entry a call takes when torch resolves it to the overload with a second tensor
                (``torch.max(a, b)`` is ``maximum``, elementwise; ``torch.max(a, 1)`` is the reduction).
  cost       -- the cost class cost_model/flops.py prices it by (its rule table's key): linear, conv,
                matmul, addmm, einsum, scaled_dot_product_attention, multi_head_attention, softmax,
                dropout, reduce, reshape, getitem, cast, contiguous, copy, view, pointwise, layer_norm,
                group_norm, batch_norm, rms_norm; empty: no cost rule (priced as an unknown op).  A
                module is priced by its nearest class of torch's own that is declared (``module_entry``).
  elt_cost   -- a pointwise op's (forward FLOPs per output element, backward multiple, what its backward
                keeps: None, "input", "inputs" or "output").
  lower      -- what the lowering rewrites on a sharded node: "sizes" (its size arguments are spelled
                local: reshape, view, expand), "unflatten", "split" (an int split size), "stats" (a layer
                norm computed from split statistics in a grid).
  arguments  -- the normalised view of a call: every argument by its name, from torch's own signature
                (overload resolved by the operands' types), as torch.fx.operator_schemas gives it.
"""
from __future__ import annotations

import inspect

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

from autosplit.passes.op_names import inplace_base, op_name


@dataclass(frozen=True)
class Op:
    kind: str = "opaque"
    shard: str = ""
    linear_in: str = ""
    reduce: str = ""
    weighted: bool = False
    fresh_grad: bool = False
    random: str | None = None
    lower: str = ""
    rowwise: bool = False
    writes: bool = False
    other: str = ""
    cost: str = ""
    elt_cost: tuple | None = None


OPAQUE = Op()
OPS: dict[str, Op] = {}


def _declare(names, **props) -> None:
    for name in names.split():
        assert name not in OPS, f"{name} declared twice"
        OPS[name] = Op(**props)


# -- GEMMs, convolutions, attention, norms --------------------------------------------------------
_declare("linear", kind="linear", shard="linear_fn", weighted=True, fresh_grad=True, rowwise=True, cost="linear")
_declare("Linear", kind="linear", fresh_grad=True, rowwise=True, cost="linear")   # nn.Linear: rules.py reads its class
_declare("linear_2d", kind="gemm", fresh_grad=True, cost="linear_2d")  # a grid's block product (autosplit/tp/ops.py)
_declare("matmul bmm", kind="gemm", shard="matmul", fresh_grad=True, cost="matmul")
_declare("mm", kind="gemm", shard="matmul", cost="matmul")
_declare("addmm baddbmm", kind="gemm", cost="addmm")
_declare("einsum", kind="gemm", shard="einsum", cost="einsum")      # one class per subscript: rules.py
_declare("conv1d conv2d conv3d", kind="conv", shard="conv", weighted=True, fresh_grad=True, rowwise=True, cost="conv")
_declare("Conv1d Conv2d Conv3d", kind="conv", fresh_grad=True, rowwise=True, cost="conv")
_declare("scaled_dot_product_attention", kind="attention", shard="sdpa", fresh_grad=True, random="dropout_p",
         cost="scaled_dot_product_attention")
# attention's keys read whole by every query (autosplit/tp/ops.py whole_keys): an identity for the cost model
_declare("whole_keys", kind="pointwise", shard="whole_keys", linear_in="first", cost="view")
_declare("MultiheadAttention", kind="attention", fresh_grad=True, cost="multi_head_attention")
_declare("layer_norm", kind="norm", shard="norm", fresh_grad=True, lower="stats", rowwise=True, cost="layer_norm")
_declare("rms_norm", kind="norm", shard="norm", rowwise=True, cost="rms_norm")
_declare("LayerNorm layer_norm_2d LayerNorm2d", kind="norm", fresh_grad=True, rowwise=True, cost="layer_norm")
_declare("RMSNorm", kind="norm", rowwise=True, cost="rms_norm")
_declare("group_norm GroupNorm", kind="norm", cost="group_norm")
_declare("batch_norm _BatchNorm", kind="norm", cost="batch_norm")  # _BatchNorm: torch's base of BatchNorm1d/2d/3d
_declare("embedding", kind="gather", shard="embedding")

# -- pointwise ------------------------------------------------------------------------------------
# elt_cost: (forward FLOPs per element, backward multiple, what the backward keeps); exp/erf/tanh count 1 FLOP
_SUMS, _PRODUCTS = (1, 1, None), (1, 2, "inputs")
_declare("neg", kind="pointwise", shard="unary", linear_in="first", rowwise=True, cost="pointwise", elt_cost=_SUMS)
_declare("positive type_as", kind="pointwise", shard="unary", linear_in="first", rowwise=True)
_declare("contiguous", kind="pointwise", shard="unary", linear_in="first", rowwise=True, cost="contiguous")
_declare("to float half bfloat16", kind="pointwise", shard="unary", linear_in="first", rowwise=True, cost="cast")
_declare("type double", kind="pointwise", cost="cast")
_declare("clone", kind="pointwise", shard="unary", linear_in="first", rowwise=True, cost="copy")
_declare("detach identity Identity", kind="pointwise", shard="unary", linear_in="first", rowwise=True, cost="view")
_declare("relu ReLU", kind="pointwise", shard="unary", rowwise=True, cost="pointwise", elt_cost=(1, 1, "output"))
_declare("gelu GELU", kind="pointwise", shard="unary", rowwise=True, cost="pointwise", elt_cost=(8, 2, "input"))
_declare("silu SiLU", kind="pointwise", shard="unary", rowwise=True, cost="pointwise", elt_cost=(4, 2, "input"))
_declare("tanh sigmoid Tanh Sigmoid", kind="pointwise", shard="unary", rowwise=True, cost="pointwise",
         elt_cost=(4, 2, "output"))
_declare("exp sqrt rsqrt", kind="pointwise", shard="unary", rowwise=True, cost="pointwise", elt_cost=(1, 2, "output"))
_declare("erf abs softplus mish hardswish hardsigmoid leaky_relu elu log square reciprocal cos sin sign Softplus "
         "Mish Hardswish Hardsigmoid LeakyReLU ELU QuickGELU GELUTanh", kind="pointwise", shard="unary", rowwise=True)
_declare("dropout Dropout", kind="random", shard="unary", random="", rowwise=True, cost="dropout")
_declare("DropPath", kind="random", shard="unary", random="", rowwise=True)
_declare("_DropoutNd", kind="random", random="", cost="dropout")    # torch's base of Dropout1d/2d/3d, AlphaDropout
_declare("add sub", kind="pointwise", shard="binary", linear_in="all", rowwise=True, cost="pointwise", elt_cost=_SUMS)
_declare("rsub", kind="pointwise", cost="pointwise", elt_cost=_SUMS)
_declare("mul", kind="pointwise", shard="binary", linear_in="one", rowwise=True, cost="pointwise", elt_cost=_PRODUCTS)
_declare("truediv div", kind="pointwise", shard="binary", linear_in="first", rowwise=True, cost="pointwise",
         elt_cost=_PRODUCTS)
_declare("pow", kind="pointwise", shard="binary", rowwise=True, cost="pointwise", elt_cost=(1, 2, "input"))
_declare("maximum minimum floordiv", kind="pointwise", shard="binary", rowwise=True)
_declare("where", kind="pointwise", shard="elementwise", rowwise=True)
_declare("addcmul", kind="pointwise", shard="elementwise", rowwise=True, cost="pointwise", elt_cost=(3, 2, "inputs"))
_declare("dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout native_dropout bernoulli rand_like "
         "randn_like randint_like", kind="random", random="")

# -- views, shapes, copies -------------------------------------------------------------------------
_declare("reshape", kind="view", shard="view", linear_in="first", lower="sizes", cost="reshape")
_declare("view", kind="view", shard="view", linear_in="first", lower="sizes", cost="view")
_declare("flatten", kind="view", shard="view", linear_in="first", cost="reshape")
_declare("Flatten", kind="view", cost="reshape")
_declare("unflatten", kind="view", shard="view", linear_in="first", lower="unflatten", cost="view")
_declare("Unflatten", kind="view", cost="view")
_declare("expand", kind="view", shard="expand", linear_in="first", lower="sizes", cost="view")
_declare("permute", kind="view", shard="permute", linear_in="first", cost="view")
_declare("transpose swapaxes t", kind="view", shard="transpose", linear_in="first", cost="view")
_declare("swapdims", kind="view", shard="transpose", linear_in="first")
_declare("unsqueeze", kind="view", shard="unsqueeze", linear_in="first", cost="view")
_declare("squeeze", kind="view", shard="squeeze", linear_in="first", cost="view")
_declare("unbind", kind="view", shard="unbind", linear_in="first", cost="view")
_declare("split", kind="view", shard="chunk", linear_in="first", lower="split", cost="view")
_declare("chunk", kind="view", shard="chunk", linear_in="first", cost="view")
_declare("tensor_split", kind="view", shard="chunk", linear_in="first")
_declare("view_as expand_as narrow select movedim as_strided unfold", kind="view", cost="view")
_declare("getitem", kind="view", shard="getitem", linear_in="first", cost="getitem")
_declare("cat concat", kind="view", shard="cat", linear_in="all", cost="copy")
_declare("stack", kind="view", shard="stack", linear_in="all", cost="copy")
_declare("concatenate repeat tile roll flip gather index_select", kind="copy", cost="copy")
_declare("pad", kind="copy", shard="pad", cost="copy")
_declare("size", kind="shape", cost="view")
_declare("numel", kind="count")
_declare("dim", kind="rank", cost="view")
_declare("ndimension", kind="rank")
_declare("getattr", kind="attr", shard="field", linear_in="first", cost="view")   # x.max(1).indices: a field
_declare("setitem delitem", kind="write", writes=True)

# -- reductions, scans, softmax --------------------------------------------------------------------
_declare("sum", kind="reduction", shard="reduce", reduce="partial", linear_in="first", cost="reduce")
_declare("mean", kind="reduction", shard="reduce", reduce="whole", cost="reduce")
_declare("amax amin prod var std logsumexp norm any all argmax argmin", kind="reduction", shard="reduce",
         reduce="whole")
_declare("max", kind="reduction", shard="reduce", reduce="whole", other="maximum")
_declare("min", kind="reduction", shard="reduce", reduce="whole", other="minimum")
_declare("adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d avg_pool1d avg_pool2d avg_pool3d "
         "AdaptiveAvgPool1d AdaptiveAvgPool2d AvgPool1d AvgPool2d", kind="reduction", cost="reduce")
_declare("cumsum", kind="scan", shard="scan", linear_in="first")
_declare("cumprod logcumsumexp", kind="scan", shard="scan")
_declare("softmax log_softmax Softmax", kind="softmax", shard="softmax", cost="softmax")
_declare("softmin LogSoftmax Softmin", kind="softmax", shard="softmax")


def op(node: fx.Node, gm: fx.GraphModule | None = None) -> Op:
    """The entry of what ``node`` runs (an in-place form: its base's; a call torch resolves to the overload
    with a second tensor: the entry's ``other``); OPAQUE when undeclared.  ``gm`` is needed for module
    calls only."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return OPAQUE
    name = inplace_base(node, gm) or op_name(node, gm)
    entry = OPS.get(name, OPAQUE)
    if entry.other and "other" in (arguments(node) or {}):
        return OPS[entry.other]
    return entry


def _torch_class(cls: type) -> bool:
    return (cls.__module__ or "").split(".")[0] == "torch"


def module_entry(module, torch_only: bool = False) -> Op:
    """The entry of a module by its class: the class's own when declared, else its nearest base class of
    torch's own that is (a subclass of nn.LayerNorm is a norm); ``torch_only``: torch's classes alone
    (what the cost model prices by: another library's class of a declared name is not torch's op)."""
    for cls in type(module).__mro__:
        if (cls is type(module) and not torch_only) or _torch_class(cls):
            if cls.__name__ in OPS:
                return OPS[cls.__name__]
    return OPAQUE


# autosplit/tp/ops.py's ops that compute (or are priced as the identity they are: whole_keys)
_COMPUTING_TP_OPS = frozenset({"linear_2d", "layer_norm_2d", "whole_keys"})


def cost_entry(node: fx.Node, gm: fx.GraphModule | None = None) -> Op:
    """The entry cost_model/flops.py prices ``node`` by: a module's by ``module_entry`` of torch's classes;
    a function's only when it is torch's, the operator module's, a builtin or our own graph vocabulary
    (autosplit/tp/ops.py: ``linear_2d``, ``layer_norm_2d``, the collectives); a user function named
    like a torch op is not that op."""
    if node.op == "call_module":
        return module_entry((gm or node.graph.owning_module).get_submodule(node.target), torch_only=True)
    module = (getattr(node.target, "__module__", None) or "torch") if node.op == "call_function" else "torch"
    if module == "autosplit.tp.ops":
        # ours: the two that compute have entries; the collectives only move data (comm.py prices them),
        # whatever torch op shares a name with one (``gather``)
        return OPS[node.target.__name__] if node.target.__name__ in _COMPUTING_TP_OPS else OPAQUE
    if not module.startswith(("torch", "_operator", "operator", "builtins", "math")):
        return OPAQUE
    return op(node, gm)


def writes_inputs(target) -> bool:
    """Does calling ``target`` (a function, or a Tensor method's name) write its operands: an in-place
    form (a name ending in ``_``) or a declared writer (``writes``: item assignment)?"""
    name = target if isinstance(target, str) else getattr(target, "__name__", "") or ""
    return name.endswith("_") or OPS.get(name.strip("_"), OPAQUE).writes


def functional_linear(node: fx.Node, gm: fx.GraphModule | None = None) -> bool:
    """Is ``node`` an ``F.linear`` call (its weight an operand, not a module's parameter)?"""
    return node.op == "call_function" and op(node, gm).kind == "linear"


def _type(a) -> type:
    """An operand's Python type for picking the overload: a graph value's is its ``meta['val']``'s."""
    if isinstance(a, fx.Node):
        val = a.meta.get("val")
        return torch.Tensor if isinstance(val, torch.Tensor) or val is None else type(val)
    return type(a)


def arguments(node: fx.Node) -> dict | None:
    """Every argument of the call ``node`` by its name (defaults filled in), from torch's signature: a
    method's ``self`` is ``input`` of the ``torch`` function of its name.  None where torch gives no
    signature or no overload takes these arguments (a user function, ``operator.add``)."""
    if node.op == "call_method":
        target = getattr(torch, str(node.target), None)
    elif node.op == "call_function":
        target = node.target
    else:
        return None
    if not callable(target):
        return None                 # x.float(): torch.float is a dtype, not the method's function
    if inspect.isfunction(target) and not (getattr(target, "__module__", None) or "").startswith("torch"):
        # a Python function of ours or the user's (autosplit.tp.ops.layer_norm_2d): its own parameter
        # names are not torch's ("x", not "input"), so no pass may read it through torch's
        return None
    try:
        found = normalize_function(target, tuple(node.args), dict(node.kwargs),
                                   arg_types=tuple(_type(a) for a in node.args),
                                   kwarg_types={k: _type(v) for k, v in node.kwargs.items()},
                                   normalize_to_only_use_kwargs=True)
    except (RuntimeError, TypeError, ValueError, AssertionError):
        return None
    return dict(found.kwargs) if found is not None else None
