"""FLOPs, memory traffic and saved activations of one graph node, from its meta shapes.

Terms:
  FLOP         -- one floating-point add or multiply; a multiply-accumulate (MAC) is 2 FLOPs.
  fwd_bytes    -- bytes the forward reads and writes in main memory: tensor inputs (parameters read
                  through get_attr included) + outputs + the parameters of a call_module's module.
  bwd_bytes    -- grad of the output read + saved tensors read + grad of every input written
                  + the module's parameters read and their grads written (2 x param_bytes)
                  + parameters fed by get_attr read again, for ops that need their weight in backward.
  param_bytes  -- parameters the node owns: all params of a call_module's module; the tensor of a
                  get_attr (parameter or buffer); 0 otherwise.
  saved_bytes  -- activation bytes autograd keeps from forward to backward (parameters and views of
                  them, like ``self.weight.t()``, excluded: they are kept anyway).  A matmul-class op whose
                  output is narrower than its input (autocast) keeps its input in the output's dtype.  Per rule below; views and add/sub/neg save nothing.
  view         -- an op that only re-describes memory (reshape, permute, getitem ...): 0 FLOPs, 0 bytes.
                  ``reshape`` / ``flatten`` that cannot be a view (e.g. after ``transpose``) count as a copy.
  unknown op   -- an op with no rule: 0 FLOPs, bytes = inputs + outputs, saves its inputs (conservative).

Which rule prices a node is the op registry's cost class (passes/op_registry.py, ``cost``): the rule
tables below are keyed by cost class, never by op name.

Rules (N = output elements):
  linear / conv        N * K MACs (K = in_features, or Cin/groups * kernel size); bias +N FLOPs.
  matmul, mm, bmm      N * K MACs (K = contracted dim); addmm / baddbmm +N for the add.
  einsum               product of all index sizes (the loop nest) MACs per extra operand.
  sdpa                 2 matmuls of B*L*S*E MACs (QK^T, PV) + softmax 5 FLOPs per score; is_causal halves.
                       Saves q, k, v, out and a float32 logsumexp per row (flash style, no score matrix).
                       Backward as flash kernels run it: 5 matmuls (QK^T recomputed, dV, dP, dQ, dK) and
                       the softmax twice (recompute, gradient): 2.5x the forward's matmul FLOPs.
  MultiheadAttention   in-projections + the two attention matmuls + out-projection + softmax.
  norms                layer/group/batch norm 5 FLOPs/elt (+1 each for weight, bias); rms_norm 4 (+1).
  pointwise            per-element FLOPs: the registry entry's ``elt_cost`` (passes/op_registry.py).
  softmax              5 FLOPs/elt (max, sub, exp, sum, div); saves its output.
  dropout (p > 0)      2 FLOPs/elt (draw, scale); saves a 1-byte/elt mask.  p == 0 is a no-op (a view).
  mean / sum / pooling 1 FLOP per input element.
  copies (cat, clone..) 0 FLOPs, bytes = inputs + outputs.
Backward FLOPs: 2x forward for linear, conv, matmul-like ops (grad of each operand / of input and weight),
attention and norms; 2x for non-linear pointwise ops (evaluate the derivative, then multiply by the grad)
and mul/div (one product per operand); 1x for add/sub/neg, relu, softmax (y * (g - sum(g * y))),
dropout (mask multiply) and reductions (broadcast of the grad).
"""
from __future__ import annotations

import math
from dataclasses import astuple, dataclass
from typing import NamedTuple

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_leaves

from autosplit.passes.op_dims import named, nth
from autosplit.passes.op_names import op_name
from autosplit.passes.op_registry import arguments, cost_entry, module_entry
from autosplit.passes.shape_prop import tensor_bytes


@dataclass(frozen=True)
class NodeCost:
    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_bytes: int = 0
    bwd_bytes: int = 0
    param_bytes: int = 0
    saved_bytes: int = 0

    @property
    def fwd_macs(self) -> float:
        return self.fwd_flops / 2

    def __add__(self, other: NodeCost) -> NodeCost:
        return NodeCost(*(a + b for a, b in zip(astuple(self), astuple(other))))


ZERO = NodeCost()


class _Est(NamedTuple):     # what a rule returns; bytes are added generically by node_cost
    fwd_flops: int
    bwd_flops: int
    saved: int
    extra_bytes: int = 0    # forward traffic of intermediates the op writes and reads back


# ----------------------------------------------------------------------------- argument helpers

def _node_arg(node: fx.Node, i: int, name: str | None = None, default=None):
    """Argument ``name`` of the registry's normalised view (passes/op_dims.py ``named``: by name,
    overload resolved, whatever the caller spelled by keyword); without a name, the ``i``-th in the
    signature's order (``nth``: operands named differently by overloads, as mm's ``mat2``)."""
    return nth(node, i, default) if name is None else named(node, i, name, default)


def _arg(node: fx.Node, i: int, name: str | None = None, default=None):
    """``_node_arg``'s value: a Node's meta['val'], else the constant."""
    a = _node_arg(node, i, name, default)
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def _is_param(a: fx.Node) -> bool:
    """True for a get_attr, or a view of one (``self.weight.t()``): not an activation."""
    while a.op in ("call_function", "call_method") and a.args and isinstance(a.args[0], fx.Node) \
            and _rule_key(a, None) in ("view", "reshape"):
        a = a.args[0]
    return a.op == "get_attr"


def _act_bytes(node: fx.Node, *positions: tuple[int, str], compute: bool = False) -> int:
    """Bytes of the given args that are activations (tensors that are not parameters or their views).

    ``compute``: count them in the op's output dtype when that is narrower, because autocast casts a
    float32 input to bfloat16 / float16 before a matmul and autograd keeps the cast copy.
    """
    out = node.meta.get("val")
    total = 0
    for i, name in positions:
        a = _node_arg(node, i, name)
        if isinstance(a, fx.Node) and not _is_param(a):
            val = a.meta.get("val")
            if compute and isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor) \
                    and val.is_floating_point() and out.is_floating_point() and out.element_size() < val.element_size():
                total += val.numel() * out.element_size()
            else:
                total += tensor_bytes(val)
    return total


def _tensors(value) -> list[torch.Tensor]:
    return [x for x in tree_leaves(value) if isinstance(x, torch.Tensor)]


def _numel(node: fx.Node) -> int:
    return sum(t.numel() for t in _tensors(node.meta.get("val")))


# ----------------------------------------------------------------------------- matmul-like rules

def _weight(node, module, i, name):
    return getattr(module, name) if module is not None else _arg(node, i, name)


def _linear(node, module):
    x, w, b = _arg(node, 0, "input"), _weight(node, module, 1, "weight"), _weight(node, module, 2, "bias")
    n = _numel(node)
    macs = n * x.shape[-1]
    if isinstance(w, torch.Tensor) and w.dim() > 2:   # conv: (Cout, Cin / groups, *kernel)
        macs = n * math.prod(w.shape[1:])
    bias = n if b is not None else 0
    return _Est(2 * macs + bias, 4 * macs + bias, _act_bytes(node, (0, "input"), compute=True))


def _linear_2d(node, module):
    """(..., in/q) local block times the gathered (out/q, in) weight: a local GEMM over the full
    input features; backward two GEMMs.  Saves only the local blocks (x and w)."""
    x, q = _arg(node, 0), node.args[4]          # our own op (autosplit/tp/ops.py): positional
    macs = _numel(node) * x.shape[-1] * q
    return _Est(2 * macs, 4 * macs, tensor_bytes(x))          # w is the parameter itself: not extra


def _matmul(node, module):   # matmul / mm / bmm: out[..., m, n] = sum_k a[..., m, k] b[..., k, n]
    return _mm(node, (0, None), (1, None), add=0)          # other (matmul) / mat2 (mm, bmm)


def _addmm(node, module):    # addmm(input, m1, m2) / baddbmm(input, b1, b2) = beta input + alpha m1 @ m2
    return _mm(node, (1, None), (2, None), add=_numel(node))   # mat1, mat2 / batch1, batch2


def _mm(node, pa, pb, add):
    macs = _numel(node) * _arg(node, *pa).shape[-1]
    return _Est(2 * macs + add, 4 * macs + add, _act_bytes(node, pa, pb, compute=True))


def _einsum_operands(node):
    eq = node.args[0]
    ops = node.args[1:]
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = ops[0]
    return eq, ops


def _einsum(node, module):
    eq, ops = _einsum_operands(node)
    terms = eq.replace(" ", "").partition("->")[0].split(",")
    sizes, ellipsis = {}, 1
    for term, op in zip(terms, ops):
        shape = list(op.meta["val"].shape)
        pre, _, post = term.partition("...")
        for letter, size in zip(pre, shape):
            sizes[letter] = max(sizes.get(letter, 1), size)
        for letter, size in zip(post, shape[len(shape) - len(post):]):
            sizes[letter] = max(sizes.get(letter, 1), size)
        if "..." in term:
            ellipsis = max(ellipsis, math.prod(shape[len(pre):len(shape) - len(post)]))
    loop = ellipsis * math.prod(sizes.values())
    if len(ops) == 1:   # a reduction / transpose of one operand
        return _Est(loop, loop, 0)
    macs = (len(ops) - 1) * loop
    saved = sum(tensor_bytes(o.meta["val"]) for o in ops if not _is_param(o))
    return _Est(2 * macs, 4 * macs, saved)


# ----------------------------------------------------------------------------- attention rules

def _sdpa(node, module):
    q, k, v = _arg(node, 0, "query"), _arg(node, 1, "key"), _arg(node, 2, "value")
    mask, p = _arg(node, 3, "attn_mask"), _arg(node, 4, "dropout_p", 0.0)
    out = node.meta["val"]
    batch, L, S = math.prod(out.shape[:-2]), q.shape[-2], k.shape[-2]
    scores = batch * L * S // (2 if _arg(node, 5, "is_causal", False) else 1)
    macs = scores * (q.shape[-1] + v.shape[-1])
    pointwise = scores * (5 + (1 if mask is not None else 0) + (2 if p else 0))
    fwd = 2 * macs + pointwise
    lse = batch * L * 4
    saved = _act_bytes(node, (0, "query"), (1, "key"), (2, "value")) + tensor_bytes(out) + lse
    # flash backward: QK^T again, then dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q (5 matmuls to the
    # forward's 2), the softmax recomputed from the saved logsumexp and its gradient (2 x pointwise)
    return _Est(fwd, 5 * macs + 2 * pointwise, saved)


def _seq_and_batch(x: torch.Tensor, batch_first: bool) -> tuple[int, int]:
    """(sequence length, batch size) of an nn.MultiheadAttention input: (L, N, E), (N, L, E) or (L, E)."""
    if x.dim() == 2:
        return x.shape[0], 1
    return (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])


def _mha(node, m: nn.MultiheadAttention):
    q, k = _arg(node, 0, "query"), _arg(node, 1, "key")
    need_weights = _arg(node, 4, "need_weights", True)
    (L, N), (S, _) = _seq_and_batch(q, m.batch_first), _seq_and_batch(k, m.batch_first)
    E, H = m.embed_dim, m.num_heads
    proj = N * (L * E * E + S * m.kdim * E + S * m.vdim * E + L * E * E)   # q, k, v in; out
    attn = 2 * N * L * S * E                                                # QK^T and PV over all heads
    bias = N * (L + 2 * S + L) * E if m.in_proj_bias is not None else 0
    fwd = 2 * (proj + attn) + bias + 5 * N * H * L * S
    elt = q.element_size()
    inner = N * (2 * L + 2 * S) * E * elt                                   # q, k, v, context
    probs = N * H * L * S * elt if need_weights else N * H * L * 4          # weights, or logsumexp
    saved = sum(tensor_bytes(a.meta["val"]) for a in node.all_input_nodes if not _is_param(a))
    return _Est(fwd, 2 * fwd, saved + inner + probs, 2 * inner + (2 * probs if need_weights else 0))


# ----------------------------------------------------------------------------- pointwise, norms, reductions

def _pointwise(node, module):
    """FLOPs per element from the entry's ``elt_cost`` (passes/op_registry.py)."""
    per_elt, bwd_mult, needs = cost_entry(node).elt_cost
    n = _numel(node)
    found = arguments(node)                    # keyword operands too (torch.add(x, other=y))
    values = list(found.values()) if found is not None else list(node.args)
    tensor_args = [i for i, a in enumerate(values) if isinstance(a, fx.Node)
                   and isinstance(a.meta.get("val"), torch.Tensor)]
    if needs == "output":
        saved = tensor_bytes(node.meta["val"])
    elif needs == "input" or (needs == "inputs" and len(tensor_args) > 1):
        saved = _act_bytes(node, *((i, None) for i in tensor_args))
    else:
        saved = 0
    return _Est(per_elt * n, bwd_mult * per_elt * n, saved)


# name: (weight's position, bias's, FLOPs per element before the affine, saves per-row statistics)
_NORM_AFFINE = {"layer_norm": (2, 3, 5, True), "group_norm": (2, 3, 5, False), "batch_norm": (3, 4, 5, False),
                "rms_norm": (2, None, 4, True)}


def _norm(name):
    w_pos, b_pos, base, row_stats = _NORM_AFFINE[name]

    def rule(node, module):
        x = _arg(node, 0, "input")
        w = _weight(node, module, w_pos, "weight")
        b = _weight(node, module, b_pos, "bias") if b_pos is not None else None
        per_elt = base + (w is not None) + (b is not None)
        stats = 8 * x.numel() // x.shape[-1] if row_stats else 0  # fp32 mean, rstd
        fwd = per_elt * x.numel()
        return _Est(fwd, 2 * fwd, _act_bytes(node, (0, "input")) + stats)
    return rule


def _softmax(node, module):
    n = _numel(node)
    return _Est(5 * n, 5 * n, tensor_bytes(node.meta["val"]))


def _dropout(node, module):
    p = module.p if module is not None else _arg(node, 1, "p", 0.5)
    training = True if module is not None else _arg(node, 2, "training", True)
    if not p or not training:
        return None                     # aten returns its input unchanged: a no-op
    n = _numel(node)
    return _Est(2 * n, n, n)            # the mask: one byte per element


def _reduce(node, module):
    n = sum(t.numel() for a in node.all_input_nodes for t in _tensors(a.meta.get("val")))
    return _Est(n, n, 0)


def _copy(node, module):
    return _Est(0, 0, 0)


# ----------------------------------------------------------------------------- views

def _reshape(node, module):
    """A view when the input's strides allow one; otherwise reshape copies."""
    x, out = _arg(node, 0, "input"), node.meta["val"]
    try:
        x.view(out.shape)
        return None
    except RuntimeError:
        return _copy(node, module)


def _getitem(node, module):
    """Indexing with ints / slices / None is a view; with tensors or lists it gathers (a copy)."""
    if not isinstance(_arg(node, 0), torch.Tensor):
        return None                     # picking an element of a tuple
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    gathers = any(isinstance(i, list) or isinstance(i, fx.Node) and isinstance(i.meta.get("val"), torch.Tensor)
                  for i in index)
    return _copy(node, module) if gathers else None


def _cast(node, module):
    """to / float / half ...: a copy only when the dtype changes."""
    x, out = _arg(node, 0, "input"), node.meta["val"]
    return None if x.dtype == out.dtype else _copy(node, module)


def _contiguous(node, module):
    """A copy only when the input's layout (or dtype) changes."""
    x = _arg(node, 0, "input")
    return None if x.is_contiguous() else _copy(node, module)


# ----------------------------------------------------------------------------- rule tables

_RULES = {   # cost class (passes/op_registry.py): (rule, reads its weight in backward)
    "linear": (_linear, True), "conv": (_linear, True), "matmul": (_matmul, True), "addmm": (_addmm, True),
    "einsum": (_einsum, True), "scaled_dot_product_attention": (_sdpa, False),
    "multi_head_attention": (_mha, True), "linear_2d": (_linear_2d, True),
    "softmax": (_softmax, False), "dropout": (_dropout, False),
    "reduce": (_reduce, False), "reshape": (_reshape, False), "getitem": (_getitem, False),
    "cast": (_cast, False), "contiguous": (_contiguous, False), "copy": (_copy, False),
    **{n: (_norm(n), True) for n in _NORM_AFFINE},
    "pointwise": (_pointwise, False), "view": (lambda node, module: None, False),
}


def _rule_key(node: fx.Node, module: nn.Module | None) -> str | None:
    """The cost class of ``node``: the registry's (our own graph ops too: passes/op_registry.py ``cost_entry``)."""
    entry = module_entry(module, torch_only=True) if module is not None else cost_entry(node)
    return entry.cost or None


def _module_params(module: nn.Module | None) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters()) if module is not None else 0


def node_cost(node: fx.Node, gm: fx.GraphModule, unknown: set | None = None) -> NodeCost:
    """Cost of ``node`` (needs meta['val'] on it and its inputs).  Adds unruled op names to ``unknown``."""
    if node.op == "get_attr":
        return NodeCost(param_bytes=tensor_bytes(node.meta.get("val")))
    if node.op not in ("call_function", "call_method", "call_module") or not _tensors(node.meta.get("val")):
        return ZERO                     # placeholders, output, and Python-value arithmetic on shapes
    module = gm.get_submodule(node.target) if node.op == "call_module" else None
    ins = node.all_input_nodes
    if getattr(node.target, "comm_kind", None) and not cost_entry(node).cost:
        # a collective: its time is communication (comm.py ``collective_time``), priced there alone; as a
        # memory-bound op here too it would be priced twice (NCCL's kernels copy inside that time)
        return ZERO
    in_b = sum(tensor_bytes(a.meta.get("val")) for a in ins)
    attr_b = sum(tensor_bytes(a.meta.get("val")) for a in ins if _is_param(a))
    out_b, param_b = tensor_bytes(node.meta["val"]), _module_params(module)
    key = _rule_key(node, module)
    if key in _RULES:
        rule, weighted = _RULES[key]
        est = rule(node, module)
        if est is None:
            return NodeCost(param_bytes=param_b)
    elif not any(_tensors(a.meta.get("val")) for a in ins):
        est, weighted = _Est(0, 0, 0), False        # a factory (zeros, arange ...): writes its output
    else:
        if unknown is not None:
            unknown.add(op_name(node, gm, qualified=True))
        est, weighted = _Est(0, 0, in_b - attr_b), False
    return NodeCost(
        fwd_flops=int(est.fwd_flops), bwd_flops=int(est.bwd_flops),
        fwd_bytes=in_b + out_b + param_b + est.extra_bytes,
        bwd_bytes=out_b + est.saved + in_b + 2 * param_b + (attr_b if weighted else 0),
        param_bytes=param_b, saved_bytes=int(est.saved))
