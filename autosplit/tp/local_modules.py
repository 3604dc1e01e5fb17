"""Local modules of tensor-parallel layers, holding this rank's shard under the original names.

Terms:
  column-parallel -- a plain ``nn.Linear`` whose output features are this rank's rows of the weight.
  row-parallel    -- ``RowParallelLinear``: this rank's columns; it returns a partial sum and does not
                     add its bias (the graph adds the bias once, after the all-reduce, so the bias
                     stays replicated with identical gradients on every rank).
An ``nn.MultiheadAttention`` has no local module: the engine sees it as a linear, an attention and
a linear (passes/decompose_attention.py) and splits those like any attention block.
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
