"""Tiny models that exercise the edges of the tensor-parallel rules and of tracing (tests/test_edge_ops.py).

Each is a small ViT (32 px images, width 32, 4 heads, depth 2, widths and heads dividing by 4, so that
(1, 2, 1) and (1, 4, 1) with tp_mode="2d" can split them) whose attention or MLP is written the way
real code sometimes writes it:
  softmax_implicit -- ``F.softmax(scores)`` with no dim: torch's implicit dim (1 for a 4-D tensor), on
                      scores laid out (B, keys, queries, heads) so that the implicit dim is the keys;
  dims_negative    -- negative dims and dims passed by keyword (``transpose(dim0=-3, dim1=-2)``,
                      ``unsqueeze(dim=-1)``, ``softmax(dim=-1)``, ``sum(dim=-1)``);
  shape_reads      -- ``x.numel()`` and ``x.size(-1)`` of the MLP's hidden activation, a tensor that
                      tensor parallelism splits on its last dim, used as numbers;
  shape_chain      -- the same through scalar arithmetic (``h.numel() // (h.size(0) * h.size(1))``);
  shape_index      -- ``h.shape[-1]``, ``h.size()[2]``, ``h.shape[0]`` and ``(N,) = h.shape[1:2]`` of that activation;
  inplace          -- ``h.mul_(s)``, ``h.add_(g)``, ``y.mul_(gamma)`` and the function forms
                      ``torch.sigmoid_(g)``, ``F.relu_(h)`` (results unused) on split activations;
  inplace_alias    -- an in-place add whose written tensor is also read through another name
                      afterwards (the write must reach that reader);
  einsum           -- attention as ``torch.einsum`` with explicit and ellipsis subscripts; ``einsum_mlp``:
                      a gate as an einsum of the activation and a weight with the implicit output (B, 2C, N);
  pad              -- ``F.pad`` of the tokens, of the channels (both cut back after) and by zeros only;
  slice_traced     -- ``x[:, :n]`` with ``n`` computed from a shape while tracing (a node inside a
                      ``slice``), and a slice bound that depends on train / eval mode.
Also the tiny timm models the issue names (pit, samvit), built with ``pretrained=False``.
"""
from __future__ import annotations

import math

import timm
import torch
import torch.nn.functional as F
from torch import nn

from tests.models import VARIANTS

DIM, HEADS = 32, 4


class _Attention(nn.Module):
    """Fused qkv, scores written out by hand; ``scores`` is the variant's softmax step."""

    def __init__(self, dim, heads, variant):
        super().__init__()
        self.heads, self.variant = heads, variant
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):                                                  # (B, N, C)
        B, N, C = x.shape
        d = C // self.heads
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, d).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, N, d)
        if self.variant == "softmax_implicit":
            s = (q @ k.transpose(-2, -1)) / math.sqrt(d)                   # (B, H, Nq, Nk)
            s = F.softmax(s.permute(0, 3, 2, 1))                           # (B, Nk, Nq, H): implicit dim 1 = keys
            y = s.permute(0, 3, 2, 1) @ v                                  # (B, H, Nq, d)
        elif self.variant == "dims_negative":
            s = (q @ k.transpose(dim0=-1, dim1=-2)).mul(d ** -0.5)         # (B, H, N, N)
            s = s - s.amax(dim=-1, keepdim=True)
            s = s.exp() / s.exp().sum(dim=-1).unsqueeze(dim=-1)            # softmax over keys, by hand
            y = s.softmax(dim=-1) @ v                                      # a second softmax, negative dim
        elif self.variant == "einsum":
            s = torch.einsum("bhqd,bhkd->bhqk", q, k) * d ** -0.5           # (B, H, Nq, Nk)
            y = torch.einsum("...qk,...kd->...qd", s.softmax(-1), v)        # ellipsis over (B, H)
        else:
            y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(dim0=-3, dim1=-2).reshape(B, N, C))


class _Mlp(nn.Module):
    def __init__(self, dim, variant):
        super().__init__()
        self.variant = variant
        self.fc1, self.gate, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, x):                                                  # (B, N, C)
        h = F.gelu(self.fc1(x))                                            # (B, N, 2C): split on its last dim
        if self.variant == "shape_reads":
            h = h * h.numel() / x.numel() + h / h.size(-1)                 # 2h + h / 2C with global sizes
        elif self.variant == "shape_chain":
            per_token = h.numel() // (h.size(0) * h.size(1))               # 2C, through scalar arithmetic
            h = h * (per_token / h.size(-1)) + h / per_token               # h + h / 2C with global sizes
        elif self.variant == "inplace":
            h.mul_(2.0)
            g = self.gate(x)                                               # a split GEMM's output, then
            torch.sigmoid_(g)                                              # function forms, results unused
            h.add_(g)
            F.relu_(h)
            y = self.fc2(h)
            return y.mul_(self.gamma)
        elif self.variant == "shape_index":
            (N,) = h.shape[1:2]                                            # a slice that misses the split dims
            h = (h * (h.shape[-1] / (4 * DIM)) + h / h.size()[2]).reshape(h.shape[0], N, -1)  # h/2 + h/2C, global
        elif self.variant == "einsum_mlp":
            h = torch.einsum("bnc,dc", x, self.gate.weight)                 # implicit output: (B, 2C, N)
            h = F.gelu(h.transpose(1, 2) + self.gate.bias) * F.gelu(self.fc1(x))
        elif self.variant == "pad":
            h = F.pad(h, (0, 0, 1, 0))[:, 1:] + F.pad(x, (0, 2))[..., :-2].repeat(1, 1, 2)  # tokens; channels
            h = F.pad(h, (0, 0, 0, 0, 0, 0))                                 # no padding: every dim kept
        elif self.variant == "inplace_alias":
            g = torch.sigmoid(self.gate(x))
            before = h
            h.add_(g)                                                      # `before` is h: it sees the add
            h = before * g
        return self.fc2(h)


class _Block(nn.Module):
    def __init__(self, dim, heads, attn, mlp):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.mlp = _Attention(dim, heads, attn), _Mlp(dim, mlp)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class EdgeViT(nn.Module):
    """Conv patch embedding, position embedding, blocks, mean pool, head.  ``variant`` names what the
    stem does ("slice_traced") and, unless ``blocks`` gives (attention, mlp) variants per block, what
    each of ``depth`` blocks does."""

    def __init__(self, variant="", blocks=None, img=32, patch=8, dim=DIM, depth=2, heads=HEADS, classes=8):
        super().__init__()
        self.variant = variant
        self.embed = nn.Conv2d(3, dim, patch, patch)
        self.pos = nn.Parameter(torch.randn(1, (img // patch) ** 2, dim) * 0.02)
        blocks = blocks or [(variant, variant)] * depth
        self.blocks = nn.ModuleList(_Block(dim, heads, a, m) for a, m in blocks)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x):                                                  # (B, 3, H, W)
        x = self.embed(x).flatten(2).transpose(1, 2) + self.pos           # (B, N, C)
        if self.variant == "slice_traced":
            n = x.shape[1] // 2 + (0 if self.training else 1)             # a traced bound, mode-dependent
            x = torch.cat([x[:, :n], x[:, n:] * 0.5], dim=1)              # (B, N, C)
            x = x[:, : x.shape[1] - (1 if self.training else 0)]           # drops a token in train mode only
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))                         # (B, classes)


def tiny_pit():
    """timm's pit_ti_224 at 32 px: a pooling ViT whose tokens are cut as ``x[:, :H]`` with a traced H."""
    return timm.create_model("pit_ti_224", pretrained=False, img_size=32, patch_size=8, stride=4,
                             base_dims=(8, 8, 8), depth=(1, 1, 1), heads=(2, 2, 2), mlp_ratio=2, num_classes=8)


def tiny_samvit():
    """timm's samvit_base_patch16 at 32 px: windowed attention whose padding is cut as ``x[:, :H, :W]``."""
    return timm.create_model("samvit_base_patch16", pretrained=False, img_size=32, patch_size=8, embed_dim=16,
                             depth=2, num_heads=2, global_attn_indexes=(1,), window_size=3, mlp_ratio=2,
                             neck_chans=8, num_classes=8)


EDGE_VARIANTS = ("softmax_implicit", "dims_negative", "shape_reads", "shape_chain", "shape_index", "inplace",
                 "inplace_alias", "slice_traced", "einsum", "einsum_mlp", "pad")
VARIANTS.update({f"edge_{v}": (lambda v=v: EdgeViT(v)) for v in EDGE_VARIANTS})


def edge_mixed_a():
    """Implicit-dim softmax with shape reads, then negative / keyword dims with in-place writes, then einsum
    attention with padding in the MLP."""
    return EdgeViT(blocks=[("softmax_implicit", "shape_reads"), ("dims_negative", "inplace"), ("einsum", "pad")])


def edge_mixed_b():
    """A traced, mode-dependent token slice in the stem, an aliased in-place write, shape arithmetic,
    indexed shape reads, an einsum attention with an einsum gate."""
    return EdgeViT("slice_traced", blocks=[("sdpa", "inplace_alias"), ("sdpa", "shape_chain"), ("sdpa", "shape_index"),
                                           ("einsum", "einsum_mlp")])


# Every variant in two models: what the multi-process tests train (one model per variant costs 3x).
VARIANTS.update(edge_mixed_a=edge_mixed_a, edge_mixed_b=edge_mixed_b)
VARIANTS.update(edge_pit=tiny_pit, edge_samvit=tiny_samvit)
