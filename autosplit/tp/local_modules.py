"""Local modules of tensor-parallel layers, holding this rank's shard under the original names.

Terms:
  column-parallel -- a plain ``nn.Linear`` whose output features are this rank's rows of the weight.
  row-parallel    -- ``RowParallelLinear``: this rank's columns; it returns a partial sum and does not
                     add its bias (the graph adds the bias once, after the all-reduce, so the bias
                     stays replicated with identical gradients on every rank).
  LocalMultiheadAttention -- ``nn.MultiheadAttention`` (self-attention, no masks) restricted to this
                     rank's heads; returns a partial sum like a row-parallel layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone(), requires_grad=t.requires_grad)


def column_linear(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    local = nn.Linear(linear.in_features, len(rows), bias=linear.bias is not None, device="meta")
    local.weight = _param(linear.weight.index_select(0, rows.to(linear.weight.device)))
    if linear.bias is not None:
        local.bias = _param(linear.bias.index_select(0, rows.to(linear.bias.device)))
    return local.train(linear.training)


class RowParallelLinear(nn.Linear):
    """``F.linear(x, weight)`` on this rank's input features; the bias is added after the all-reduce."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def row_linear(linear: nn.Linear, cols: torch.Tensor) -> RowParallelLinear:
    local = RowParallelLinear(len(cols), linear.out_features, bias=linear.bias is not None, device="meta")
    local.weight = _param(linear.weight.index_select(1, cols.to(linear.weight.device)))
    if linear.bias is not None:
        local.bias = _param(linear.bias)
    return local.train(linear.training)


class _OutProj(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = _param(weight)
        self.bias = _param(bias) if bias is not None else None


class LocalMultiheadAttention(nn.Module):
    """Self-attention over this rank's heads; returns (partial output, None)."""

    def __init__(self, mha: nn.MultiheadAttention, rows: torch.Tensor, cols: torch.Tensor, heads: int):
        super().__init__()
        self.num_heads, self.batch_first, self.dropout = heads, mha.batch_first, mha.dropout
        self.in_proj_weight = _param(mha.in_proj_weight.index_select(0, rows.to(mha.in_proj_weight.device)))
        self.in_proj_bias = _param(mha.in_proj_bias.index_select(0, rows.to(mha.in_proj_bias.device))) \
            if mha.in_proj_bias is not None else None
        self.out_proj = _OutProj(mha.out_proj.weight.index_select(1, cols.to(mha.out_proj.weight.device)),
                                 mha.out_proj.bias)
        self.train(mha.training)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        x = query if self.batch_first else query.transpose(0, 1)           # (B, N, E)
        B, N, _ = x.shape
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        q, k, v = (t.reshape(B, N, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))  # (B, h, N, D)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        y = F.linear(y.transpose(1, 2).reshape(B, N, -1), self.out_proj.weight)   # (B, N, E) partial
        return (y if self.batch_first else y.transpose(0, 1)), None


def attention_heads(qkv: torch.Tensor, heads: int, batch_first: bool) -> torch.Tensor:
    """``nn.MultiheadAttention``'s core on this rank's heads: (B, N, 3*heads*D) fused q, k, v in
    (3, heads, D) order -> (B, N, heads*D).  The 2D rewrite puts the projections around it."""
    x = qkv if batch_first else qkv.transpose(0, 1)                     # (B, N, 3*h*D)
    B, N, _ = x.shape
    q, k, v = (t.reshape(B, N, heads, -1).transpose(1, 2) for t in x.chunk(3, dim=-1))   # (B, h, N, D)
    y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, -1)       # (B, N, h*D)
    return y if batch_first else y.transpose(0, 1)


attention_heads.cost_rule = "attention_heads"      # its FLOPs: cost_model/flops.py
