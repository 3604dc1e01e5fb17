"""Tiny ViT-family models with BatchNorm inside their blocks, written after timm's XCiT and LeViT.

Terms:
  LPI         -- XCiT's local patch interaction: tokens (B, N, C) viewed as an image (B, C, H, W), a
                 depthwise 3x3 conv, GELU, BatchNorm2d, a depthwise 3x3 conv, back to tokens.
  XCA         -- XCiT's cross-covariance attention: heads attend over channels (a d x d map per head),
                 q and k L2-normalized over tokens, a learned temperature per head.
  LinearNorm  -- LeViT's Linear without bias followed by BatchNorm1d over every token of the batch
                 (the (B, N, C) output flattened to (B*N, C)).

Kept small (32 px images, width 32, depth 2, 4 heads: tp=2 divides every width) so multi-process tests
stay fast on two CPU cores.  Every BatchNorm is in training mode, so each forward normalizes with its
own batch's statistics and updates the running statistics.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ConvNorm(nn.Sequential):
    """Conv2d (no bias) then BatchNorm2d: the stems of both models."""

    def __init__(self, cin, cout, kernel, stride, padding=0):
        super().__init__(nn.Conv2d(cin, cout, kernel, stride, padding, bias=False), nn.BatchNorm2d(cout))


# ---- XCiT-like -----------------------------------------------------------------------------------
class XCA(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.temperature = nn.Parameter(torch.ones(heads, 1, 1))
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):                                                          # (B, N, C)
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 4, 1)
        q, k, v = qkv.unbind(0)                                                    # (B, H, d, N)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        attn = ((q @ k.transpose(-2, -1)) * self.temperature).softmax(dim=-1)     # (B, H, d, d)
        y = (attn @ v).permute(0, 3, 1, 2).reshape(B, N, C)
        return self.proj(y)


class LPI(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.conv1 = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.bn = nn.BatchNorm2d(dim)
        self.conv2 = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)

    def forward(self, x, H: int, W: int):                                          # (B, N, C)
        B, N, C = x.shape
        x = x.permute(0, 2, 1).reshape(B, C, H, W)                                 # (B, C, H, W)
        x = self.conv2(self.bn(F.gelu(self.conv1(x))))
        return x.reshape(B, C, N).permute(0, 2, 1)                                 # (B, N, C)


class XCiTBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = XCA(dim, heads)
        self.local_mp = LPI(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x, H: int, W: int):
        x = x + self.attn(self.norm1(x))
        x = x + self.local_mp(self.norm3(x), H, W)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class XCiTLike(nn.Module):
    def __init__(self, img=32, dim=32, depth=2, heads=4, classes=10):
        super().__init__()
        self.stem = nn.Sequential(ConvNorm(3, dim // 2, 4, 4), nn.GELU(), ConvNorm(dim // 2, dim, 2, 2))
        self.blocks = nn.ModuleList(XCiTBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):                                                          # (B, 3, 32, 32)
        x = self.stem(x)                                                           # (B, C, 4, 4)
        H, W = x.shape[2], x.shape[3]
        x = x.flatten(2).transpose(1, 2)                                           # (B, N, C)
        for block in self.blocks:
            x = block(x, H, W)
        return self.head(self.norm(x).mean(dim=1))                                 # (B, classes)


# ---- LeViT-like ----------------------------------------------------------------------------------
class LinearNorm(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.linear = nn.Linear(cin, cout, bias=False)
        self.bn = nn.BatchNorm1d(cout)

    def forward(self, x):                                                          # (B, N, Cin)
        x = self.linear(x)                                                         # (B, N, Cout)
        return self.bn(x.flatten(0, 1)).reshape_as(x)


class LeViTAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = LinearNorm(dim, 3 * dim)
        self.proj = LinearNorm(dim, dim)

    def forward(self, x):                                                          # (B, N, C)
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        attn = (q @ k.transpose(-2, -1) * (C // self.heads) ** -0.5).softmax(dim=-1)   # (B, H, N, N)
        y = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(F.hardswish(y))


class LeViTMlp(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.ln1, self.ln2 = LinearNorm(dim, 2 * dim), LinearNorm(2 * dim, dim)

    def forward(self, x):
        return self.ln2(F.hardswish(self.ln1(x)))


class LeViTBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attn, self.mlp = LeViTAttention(dim, heads), LeViTMlp(dim)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class LeViTLike(nn.Module):
    def __init__(self, dim=32, depth=2, heads=4, classes=10):
        super().__init__()
        self.stem = nn.Sequential(ConvNorm(3, dim // 2, 4, 4, 0), nn.Hardswish(), ConvNorm(dim // 2, dim, 2, 2))
        self.blocks = nn.Sequential(*(LeViTBlock(dim, heads) for _ in range(depth)))
        self.head_bn = nn.BatchNorm1d(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):                                                          # (B, 3, 32, 32)
        x = self.stem(x).flatten(2).transpose(1, 2)                                # (B, N, C)
        x = self.blocks(x)
        return self.head(self.head_bn(x.mean(dim=1)))                              # (B, classes)


BN_VARIANTS = {"xcit": XCiTLike, "levit": LeViTLike}
