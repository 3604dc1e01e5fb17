"""The compute the CPU profile measurements run when they need "a stage's pass" that is no model's.

Terms:
  encoder stack -- pre-norm transformer encoder layers (``nn.TransformerEncoderLayer``: width 192, 6 heads,
                   MLP 768, GELU, no dropout) on (4, 65, 192) tokens: a CPU benchmark ViT stage's op mix
                   (attention, softmax, layer norms, reshapes, GEMMs; many small ops, whose per-op costs
                   are what sharing a core and idling move most) and size, 1.77 MB of weights per layer.
Seeded (0) inside ``torch.random.fork_rng``: the caller's random stream is left as it was.
"""
from __future__ import annotations

import torch
from torch import nn


def encoder_stack(device, layers: int):
    """(module, input (B, N, C)) of an encoder stack of ``layers`` layers on ``device``, in training mode."""
    with torch.random.fork_rng(devices=[]):
        # the CPU generator only, drawn on the CPU: torch.manual_seed would reseed every device's
        # generators (on a GPU host, the ones the caller's training draws from) outside the fork
        torch.default_generator.manual_seed(0)
        net = nn.Sequential(*[nn.TransformerEncoderLayer(192, 6, 768, dropout=0.0, activation="gelu",
                                                         batch_first=True, norm_first=True)
                              for _ in range(layers)]).to(device).train()
        x = torch.randn(4, 65, 192).to(device)             # (B, N, C): 4 images of 65 tokens
    return net, x


def train_pass(net, x) -> None:
    """One forward and backward (gradients accumulate, as over a step's microbatches)."""
    net(x).sum().backward()
