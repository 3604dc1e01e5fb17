"""``nn.MultiheadAttention`` calls as the ops they compute, so the sharding engine sees a linear, a
scaled-dot-product attention and a linear, and needs no rule, lowering or local module of its own.

Terms:
  plain self-attention -- the call this pass rewrites: query, key and value are one tensor, batched
                   (3 dims), with one fused in-projection (``_qkv_same_embed_dim``), no ``bias_k`` /
                   ``bias_v``, no ``add_zero_attn``, no mask, not causal, and its attention weights
                   (output 1) read by nobody.  Any other call stays a module (one opaque op the engine
                   runs whole), and ``describe_kept`` says why.
  the ops        -- torch's own ``F.multi_head_attention_forward`` on such a call, written as graph ops
                   (E = embed_dim, h = num_heads, D = E / h):
                     x (B, N, E) = query, moved batch-first          (transpose(0, 1) unless batch_first)
                     qkv (B, N, 3E) = F.linear(x, in_proj_weight, in_proj_bias)
                     q, k, v (B, h, N, D) = qkv.reshape(B, N, 3, h, D).permute(2, 0, 3, 1, 4).unbind(0)
                     y (B, h, N, D) = F.scaled_dot_product_attention(q, k, v, dropout_p=p in train, 0 in eval)
                     out (B, N, E) = F.linear(y.transpose(1, 2).reshape(B, N, E), out_proj.weight, out_proj.bias)
                   which is the layout of a timm attention block: the engine splits it by heads as it
                   splits those (the fused qkv rows by heads, out_proj's columns, the bias after the sum).
  mode constant  -- the dropout probability follows ``pm.train()`` / ``pm.eval()`` through a ModeSwitch
                   (autosplit/trace_modes.py), as a traced ``dropout_p=p if self.training else 0.`` does.

Requires meta['val'] (the query's rank and which outputs are read); the nodes it adds get meta['val']
by running them on meta tensors, and the module path of the call they replace.
"""
from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autosplit.passes.op_names import keeps_effect
from autosplit.trace_modes import ModeSwitch


def kept_reason(node: fx.Node, m: nn.MultiheadAttention) -> str:
    """Why the call ``node`` of ``m`` is not plain self-attention ("" when it is: module docstring)."""
    names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask",
             "average_attn_weights", "is_causal")
    args = dict(zip(names, node.args))
    args.update(node.kwargs)
    q, k, v = args.get("query"), args.get("key"), args.get("value")
    val = q.meta.get("val") if isinstance(q, fx.Node) else None
    reads_weights = any(u.target is operator.getitem and u.args[1] == 1 and u.users for u in node.users)
    checks = [
        (not (q is k is v), "query, key and value are different tensors"),
        (not isinstance(val, torch.Tensor) or val.dim() != 3, "its input is not batched (B, N, E)"),
        (not m._qkv_same_embed_dim, "kdim / vdim differ from embed_dim"),
        (m.bias_k is not None or m.add_zero_attn, "bias_k / bias_v or add_zero_attn"),
        (args.get("key_padding_mask") is not None or args.get("attn_mask") is not None, "a mask"),
        (bool(args.get("is_causal", False)), "is_causal"),
        (reads_weights, "its attention weights (output 1) are read"),
    ]
    return next((why for bad, why in checks if bad), "")


def decompose_attention(gm: fx.GraphModule) -> list[str]:
    """Rewrite every plain self-attention ``nn.MultiheadAttention`` call of ``gm`` in place (module
    docstring); returns a line per call kept whole, naming it and why."""
    kept = []
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        m = gm.get_submodule(node.target)
        if type(m) is not nn.MultiheadAttention:
            continue
        why = kept_reason(node, m)
        if why:
            kept.append(f"{node.target}: nn.MultiheadAttention kept whole ({why})")
            continue
        _rewrite(gm, node, m)
    gm.graph.eliminate_dead_code(is_impure_node=keeps_effect)     # fx calls x.add_(y) pure
    gm.graph.lint()
    gm.recompile()
    return kept


def _rewrite(gm: fx.GraphModule, node: fx.Node, m: nn.MultiheadAttention) -> None:
    g, path = gm.graph, node.meta.get("module_path", str(node.target))
    q = node.args[0] if node.args else node.kwargs["query"]
    E, h = m.embed_dim, m.num_heads
    new: list[fx.Node] = []

    def call(fn, *args, **kwargs) -> fx.Node:
        with g.inserting_before(node):
            n = g.call_function(fn, args, kwargs) if not isinstance(fn, str) else g.call_method(fn, args, kwargs)
        new.append(n)
        return n

    def attr(name: str) -> fx.Node:
        with g.inserting_before(node):
            n = g.get_attr(f"{node.target}.{name}")
        new.append(n)
        return n

    x = q if m.batch_first else call("transpose", q, 0, 1)                     # (B, N, E)
    shape = call(getattr, x, "shape")
    B, N = call(operator.getitem, shape, 0), call(operator.getitem, shape, 1)
    bias = attr("in_proj_bias") if m.in_proj_bias is not None else None
    qkv = call(F.linear, x, attr("in_proj_weight"), bias)                        # (B, N, 3E)
    qkv = call("permute", call("reshape", qkv, B, N, 3, h, E // h), 2, 0, 3, 1, 4)   # (3, B, h, N, D)
    parts = call("unbind", qkv, 0)
    qh, kh, vh = (call(operator.getitem, parts, i) for i in range(3))           # (B, h, N, D) each
    p = 0.0
    if m.dropout > 0:
        name = f"autosplit_attention_dropout_{len([k for k, _ in gm.named_children() if k.startswith('autosplit_attention')])}"
        gm.add_submodule(name, ModeSwitch(m.dropout, 0.0).train(m.training))
        with g.inserting_before(node):
            p = g.call_module(name, ())
        new.append(p)
    y = call(F.scaled_dot_product_attention, qh, kh, vh, dropout_p=p)           # (B, h, N, D)
    y = call("reshape", call("transpose", y, 1, 2), B, N, E)                    # (B, N, E)
    out_bias = attr("out_proj.bias") if m.out_proj.bias is not None else None
    out = call(F.linear, y, attr("out_proj.weight"), out_bias)                  # (B, N, E)
    out = out if m.batch_first else call("transpose", out, 0, 1)
    for n in new:
        n.meta["module_path"] = path
        if "nn_module_stack" in node.meta:
            n.meta["nn_module_stack"] = dict(node.meta["nn_module_stack"])
    for user in list(node.users):              # getitem 0 is the output; getitem 1 (weights) is unread
        if user.target is operator.getitem and user.args[1] == 0:
            user.replace_all_uses_with(out)
    _propagate(gm, new)


def _propagate(gm: fx.GraphModule, nodes: list[fx.Node]) -> None:
    """meta['val'] of the new ``nodes``, run on meta tensors in graph order."""
    def val(a):
        return fx.node.map_arg(a, lambda n: n.meta["val"])

    for n in nodes:
        args, kwargs = val(n.args), val(n.kwargs)
        if n.op == "get_attr":
            t = functools.reduce(getattr, n.target.split("."), gm)       # a parameter of the module
            n.meta["val"] = torch.empty(t.shape, dtype=t.dtype, device="meta")
        elif n.op == "call_module":
            n.meta["val"] = gm.get_submodule(n.target)()
        elif n.op == "call_method":
            n.meta["val"] = getattr(args[0], n.target)(*args[1:], **kwargs)
        else:
            with torch.no_grad():
                n.meta["val"] = n.target(*args, **kwargs)
