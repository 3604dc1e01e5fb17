"""Small models written to break the sharding engine's lowering (an independent review of issue 34):
each is a place where a split could compute something other than single-device training.

  chain        -- a row-parallel linear straight into a column-parallel one (the all-reduce's output
                  feeds a split op: its gradient must be summed again, backward)
  add_scalar   -- a Partial sum plus a Python number (each rank would add the number)
  flinear      -- ``F.linear`` of a parameter weight and bias, row-parallel (the bias after the sum)
  square       -- ``y * y`` of a Partial y (one operand, two places)
  param_twice  -- one parameter read by a split op and by a whole op
  mha_mask     -- ``nn.MultiheadAttention`` with a positional key-padding mask
  mha_kw       -- ``nn.MultiheadAttention`` called with q, k, v as keywords
  unflatten    -- an attention written with ``unflatten`` (its sizes must become the rank's)
Inputs are (B, 3, 32, 32) images, read as 16 tokens of 48 features.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.models import VARIANTS


def _tokens(embed, x):                                          # (B, 3, 32, 32) -> (B, 16, 32)
    B = x.shape[0]
    return embed(x.reshape(B, 3, 16, 64).permute(0, 2, 1, 3).reshape(B, 16, 192)[..., :48])


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.n0 = nn.Linear(48, 32), nn.LayerNorm(32)
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32, bias=False)
        self.norm, self.head = nn.LayerNorm(32), nn.Linear(32, 7)

    def tokens(self, x):
        return self.n0(_tokens(self.embed, x))

    def mlp(self, t):
        return self.fc2(F.gelu(self.fc1(t)))


class Chain(_Base):
    def __init__(self):
        super().__init__()
        self.fc3, self.fc4 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        t = _tokens(self.embed, x)
        z = self.fc4(F.gelu(self.fc3(self.mlp(t))))
        return self.head(self.norm(z + t).mean(1))


class AddScalar(_Base):
    def forward(self, x):
        t = self.tokens(x)
        y = self.mlp(t) + 1.0
        return self.head((t * y.mean(-1, keepdim=True)).mean(1))


class FLinear(_Base):
    def __init__(self):
        super().__init__()
        self.w2, self.b2 = nn.Parameter(torch.randn(32, 64) * 0.1), nn.Parameter(torch.randn(32) * 0.1)

    def forward(self, x):
        t = self.tokens(x)
        y = F.linear(F.gelu(self.fc1(t)), self.w2, self.b2)
        return self.head(self.norm(y + t).mean(1))


class Square(_Base):
    def forward(self, x):
        t = self.tokens(x)
        y = self.mlp(t)
        return self.head(self.norm(y * y + t).mean(1))


class ParamTwice(_Base):
    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor([1.5]))

    def forward(self, x):
        t = self.tokens(x)
        y = self.fc2(F.gelu(self.fc1(t) * self.s))
        return self.head(self.norm(y + t).mean(1) * self.s)


class _Attention(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how, self.embed, self.n0 = how, nn.Linear(48, 32), nn.LayerNorm(32)
        if how == "unflatten":
            self.qkv, self.proj = nn.Linear(32, 96), nn.Linear(32, 32)
        else:
            self.mha = nn.MultiheadAttention(32, 2, batch_first=True)
        self.head = nn.Linear(32, 7)

    def forward(self, x):
        t = self.n0(_tokens(self.embed, x))
        if self.how == "mask":
            y, _ = self.mha(t, t, t, t[..., 0] > 0.5, False)
        elif self.how == "kw":
            y, _ = self.mha(query=t, key=t, value=t, need_weights=False)
        else:
            q, k, v = self.qkv(t).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4).unbind(0)
            y = self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        return self.head((y + t).mean(1))


REVIEW = dict(review_chain=Chain, review_add_scalar=AddScalar, review_flinear=FLinear, review_square=Square,
              review_param_twice=ParamTwice, review_mha_mask=lambda: _Attention("mask"),
              review_mha_kw=lambda: _Attention("kw"), review_unflatten=lambda: _Attention("unflatten"))
VARIANTS.update(REVIEW)
