"""The numerics part's model and data: a tiny timm ViT and a few seeded batches.

Terms:
  tiny ViT -- timm's VisionTransformer at 32 x 32 pixels, patch 8 (16 tokens + a class token), width 32,
              depth 4, 4 heads, MLP ratio 2, 10 classes: every layer a real ViT has (patch embedding,
              class token, position embedding, attention, MLP, LayerNorm, head), small enough that a
              configuration trains in seconds on a CPU.  4 heads and a hidden width of 64 divide by
              every tp the configurations use (2 and 4; 2D's 2 x 2 grid).
  batches  -- ``steps`` global batches of ``batch`` images (3, 32, 32) and labels in [0, 10), from
              torch's generator seeded with ``seed``: the same values on every rank.
"""
from __future__ import annotations

import torch

IMAGE = (3, 32, 32)
CLASSES = 10


def tiny_vit() -> torch.nn.Module:
    """The tiny ViT (see the module docstring); its parameters come from torch's global generator."""
    import timm
    return timm.models.VisionTransformer(img_size=IMAGE[1], patch_size=8, embed_dim=32, depth=4, num_heads=4,
                                         mlp_ratio=2, num_classes=CLASSES)


def batches(steps: int, batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (steps, batch, 3, 32, 32), labels (steps, batch)), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(steps, batch, *IMAGE, generator=g)
    ys = torch.randint(0, CLASSES, (steps, batch), generator=g)
    return xs, ys
