"""Tiny models the tests share: several ViT shapes from timm, torchvision, and a hand-written one.

Kept small (32 px images, width 32-48, depth 3-4) so multi-process tests stay fast on two CPU cores.
"""
from __future__ import annotations

import math

import timm
import torch
import torchvision
from timm.layers import SwiGLU
from torch import nn


def timm_cls(depth=4):
    return timm.models.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=depth, num_heads=2,
                                         mlp_ratio=2, num_classes=10)


def timm_avgpool():
    return timm.models.VisionTransformer(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3,
                                         class_token=False, global_pool="avg", num_classes=7)


def timm_registers_qknorm_layerscale():
    return timm.models.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=4, num_heads=4,
                                         reg_tokens=2, qk_norm=True, init_values=0.1, num_classes=10)


def timm_swiglu():
    return timm.models.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=4, num_heads=2,
                                         mlp_layer=SwiGLU, act_layer=nn.SiLU, mlp_ratio=8 / 3,
                                         no_embed_class=True, num_classes=10)


def torchvision_vit():
    return torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=4, num_heads=2,
                                                hidden_dim=32, mlp_dim=64, num_classes=10)


class HandAttention(nn.Module):
    """Separate q/k/v projections and softmax attention written out by hand."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):                                          # (B, N, C)
        B, N, C = x.shape
        d = C // self.heads
        q = self.q(x).view(B, N, self.heads, d).transpose(1, 2)     # (B, H, N, d)
        k = self.k(x).view(B, N, self.heads, d).transpose(1, 2)
        v = self.v(x).view(B, N, self.heads, d).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d)              # (B, H, N, N)
        y = att.softmax(dim=-1) @ v                                 # (B, H, N, d)
        return self.out(y.transpose(1, 2).reshape(B, N, C))


class HandBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = HandAttention(dim, heads)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class HandViT(nn.Module):
    def __init__(self, img=32, patch=8, dim=32, depth=4, heads=4, classes=10):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, patch, patch)
        self.pos = nn.Parameter(torch.randn(1, (img // patch) ** 2, dim) * 0.02)
        self.layers = nn.ModuleList(HandBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):                                          # (B, 3, H, W)
        x = self.embed(x).flatten(2).transpose(1, 2) + self.pos     # (B, N, C)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x).mean(dim=1))                  # (B, classes)


VARIANTS = {
    "timm_cls": timm_cls,
    "timm_avgpool": timm_avgpool,
    "timm_reg_qknorm_ls": timm_registers_qknorm_layerscale,
    "timm_swiglu": timm_swiglu,
    "torchvision": torchvision_vit,
    "hand": HandViT,
}


# Tensor-parallel test models: heads and hidden widths divide by 4.
def tp_timm():
    return timm.models.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4,
                                         mlp_ratio=2, num_classes=10, qkv_bias=True)


def tp_torchvision():
    return torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4,
                                                hidden_dim=32, mlp_dim=64, num_classes=10)


def tp_hand():
    return HandViT(depth=2, heads=4)


def tp_swiglu():
    return timm.models.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4,
                                         mlp_layer=SwiGLU, act_layer=nn.SiLU, mlp_ratio=4, qk_norm=True,
                                         num_classes=10)


def tp_timm_avgpool():
    """Average pooling (no class token), a register token and layer scale: 2D tests' second timm shape."""
    return timm.models.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4,
                                         class_token=False, global_pool="avg", reg_tokens=1, init_values=0.1,
                                         num_classes=8)


VARIANTS.update(tp_timm=tp_timm, tp_torchvision=tp_torchvision, tp_hand=tp_hand, tp_swiglu=tp_swiglu,
                tp_timm_avgpool=tp_timm_avgpool)
