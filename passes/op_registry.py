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
  lower      -- what the lowering rewrites on a sharded node: "sizes" (its size arguments are spelled
                local: reshape, view, expand), "unflatten", "split" (an int split size), "stats" (a layer
                norm computed from split statistics in a grid).
  arguments  -- the normalised view of a call: every argument by its name, from torch's own signature
                (overload resolved by the operands' types), as torch.fx.operator_schemas gives it.
"""
from __future__ import annotations

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


OPAQUE = Op()
OPS: dict[str, Op] = {}


def _declare(names, **props) -> None:
    for name in names.split():
        assert name not in OPS, f"{name} declared twice"
        OPS[name] = Op(**props)


# -- GEMMs, convolutions, attention, norms --------------------------------------------------------
_declare("linear", kind="linear", shard="linear_fn", weighted=True, fresh_grad=True)
_declare("Linear", kind="linear", fresh_grad=True)                 # nn.Linear: rules.py reads its class
_declare("linear_2d", kind="gemm", fresh_grad=True)                # a grid's block product (autosplit/tp/ops.py)
_declare("matmul bmm", kind="gemm", shard="matmul", fresh_grad=True)
_declare("mm", kind="gemm", shard="matmul")
_declare("conv1d conv2d conv3d", kind="conv", shard="conv", weighted=True, fresh_grad=True)
_declare("Conv1d Conv2d Conv3d", kind="conv", fresh_grad=True)
_declare("scaled_dot_product_attention", kind="attention", shard="sdpa", fresh_grad=True, random="dropout_p")
_declare("MultiheadAttention LocalMultiheadAttention", kind="attention", fresh_grad=True)
_declare("layer_norm", kind="norm", shard="norm", fresh_grad=True, lower="stats")
_declare("rms_norm", kind="norm", shard="norm")
_declare("LayerNorm layer_norm_2d LayerNorm2d", kind="norm", fresh_grad=True)
_declare("embedding", kind="gather", shard="embedding")

# -- pointwise ------------------------------------------------------------------------------------
_declare("neg contiguous to float half bfloat16 type_as clone detach identity Identity positive",
         kind="pointwise", shard="unary", linear_in="first")
_declare("gelu silu relu tanh sigmoid exp sqrt rsqrt erf abs softplus mish hardswish hardsigmoid leaky_relu "
         "elu log square reciprocal cos sin sign GELU SiLU ReLU Tanh Sigmoid Softplus Mish Hardswish Hardsigmoid "
         "LeakyReLU ELU QuickGELU GELUTanh", kind="pointwise", shard="unary")
_declare("dropout Dropout DropPath", kind="random", shard="unary", random="")
_declare("add sub", kind="pointwise", shard="binary", linear_in="all")
_declare("mul", kind="pointwise", shard="binary", linear_in="one")
_declare("truediv div", kind="pointwise", shard="binary", linear_in="first")
_declare("pow maximum minimum floordiv", kind="pointwise", shard="binary")
_declare("where", kind="pointwise", shard="where")
_declare("dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout native_dropout bernoulli rand_like "
         "randn_like randint_like", kind="random", random="")

# -- views, shapes ---------------------------------------------------------------------------------
_declare("reshape view", kind="view", shard="view", linear_in="first", lower="sizes")
_declare("flatten", kind="view", shard="view", linear_in="first")
_declare("unflatten", kind="view", shard="view", linear_in="first", lower="unflatten")
_declare("expand", kind="view", shard="expand", linear_in="first", lower="sizes")
_declare("permute", kind="view", shard="permute", linear_in="first")
_declare("transpose swapaxes swapdims t", kind="view", shard="transpose", linear_in="first")
_declare("unsqueeze", kind="view", shard="unsqueeze", linear_in="first")
_declare("squeeze", kind="view", shard="squeeze", linear_in="first")
_declare("unbind", kind="view", shard="unbind", linear_in="first")
_declare("split", kind="view", shard="chunk", linear_in="first", lower="split")
_declare("chunk tensor_split", kind="view", shard="chunk", linear_in="first")
_declare("getitem", kind="view", shard="getitem", linear_in="first")
_declare("cat concat", kind="view", shard="cat", linear_in="all")
_declare("stack", kind="view", shard="stack", linear_in="all")
_declare("size", kind="shape")
_declare("numel", kind="count")
_declare("dim ndimension", kind="rank")
_declare("getattr", kind="attr")

# -- reductions, scans, softmax --------------------------------------------------------------------
_declare("sum", kind="reduction", shard="reduce", reduce="partial", linear_in="first")
_declare("mean amax amin prod max min var std logsumexp norm any all argmax argmin", kind="reduction",
         shard="reduce", reduce="whole")
_declare("cumsum", kind="scan", shard="scan", linear_in="first")
_declare("cumprod logcumsumexp", kind="scan", shard="scan")
_declare("softmax log_softmax softmin Softmax LogSoftmax Softmin", kind="softmax", shard="softmax")


def op(node: fx.Node, gm: fx.GraphModule | None = None) -> Op:
    """The entry of what ``node`` runs (an in-place form: its base's); OPAQUE when undeclared.  ``gm`` is
    needed for module calls only."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return OPAQUE
    name = inplace_base(node, gm) or op_name(node, gm)
    return OPS.get(name, OPAQUE)


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
    if target is None:
        return None
    try:
        found = normalize_function(target, tuple(node.args), dict(node.kwargs),
                                   arg_types=tuple(_type(a) for a in node.args),
                                   kwarg_types={k: _type(v) for k, v in node.kwargs.items()},
                                   normalize_to_only_use_kwargs=True)
    except (RuntimeError, TypeError, ValueError):
        return None
    return dict(found.kwargs) if found is not None else None
