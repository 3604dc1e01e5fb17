"""The published datacenter runs' models as torch modules: an LLM's (or BERT's) blocks are a ViT's blocks
over tokens, built at the row's shape on the meta device for autosplit to trace, plan and price.

Terms (rows: cost_model/datacenter_rows.py):
  block    -- pre-norm transformer block: norm, attention (q, k, v, o projections; ``kv_heads`` < ``heads``
              is grouped-query attention, run by scaled_dot_product_attention with ``enable_gqa``; causal
              for the LLMs, bidirectional for BERT), residual add, norm, MLP (SwiGLU: silu(gate) * up,
              then down; else GELU between up and down), residual add.  Llama-style rows (SwiGLU) use
              RMSNorm and no biases; GELU rows (GPT, MPT, BERT) LayerNorm and biases.  Rotary and learned
              position embeddings are left out (one small pointwise op per block or one add per step).
  head     -- final norm and the vocab projection, on every token (LLMs) or on the first ``head_tokens``
              positions only (BERT's masked-LM head runs on the masked positions; which ones does not
              change the work).
  input    -- one microbatch of token ids, (micro_batch, seq_len) int64, on the meta device.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """One transformer block of a row's shape (see *block*)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, gated: bool, causal: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.gated, self.causal = gated, causal
        bias = not gated
        norm = nn.RMSNorm if gated else nn.LayerNorm
        self.norm1, self.norm2 = norm(hidden), norm(hidden)
        self.q = nn.Linear(hidden, hidden, bias=bias)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.o = nn.Linear(hidden, hidden, bias=bias)
        self.up = nn.Linear(hidden, ffn, bias=bias)
        self.gate = nn.Linear(hidden, ffn, bias=bias) if gated else None
        self.down = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x):
        B, N, C = x.shape
        y = self.norm1(x)
        q = self.q(y).view(B, N, self.heads, self.head_dim).transpose(1, 2)         # (B, H, N, d)
        k = self.k(y).view(B, N, self.kv_heads, self.head_dim).transpose(1, 2)      # (B, Hkv, N, d)
        v = self.v(y).view(B, N, self.kv_heads, self.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                           enable_gqa=self.kv_heads != self.heads)  # (B, H, N, d)
        x = x + self.o(a.transpose(1, 2).reshape(B, N, C))
        y = self.norm2(x)
        m = F.silu(self.gate(y)) * self.up(y) if self.gated else F.gelu(self.up(y))  # (B, N, ffn)
        return x + self.down(m)


class RowModel(nn.Module):
    """Token embedding, ``layers`` blocks, final norm and vocab head (see *head*)."""

    def __init__(self, row):
        super().__init__()
        self.head_tokens = row.head_tokens if row.head_tokens < row.seq_len else None   # the shape is the row's
        self.embed = nn.Embedding(row.vocab, row.hidden)
        self.blocks = nn.ModuleList(Block(row.hidden, row.heads, row.kv_heads, row.ffn_hidden, row.gated,
                                          row.causal) for _ in range(row.layers))
        self.norm = (nn.RMSNorm if row.gated else nn.LayerNorm)(row.hidden)
        self.head = nn.Linear(row.hidden, row.vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)                                  # (B, N, C)
        for block in self.blocks:
            x = block(x)
        if self.head_tokens is not None:
            x = x[:, :self.head_tokens]                      # (B, P, C): the masked positions
        return self.head(self.norm(x))                       # (B, N or P, vocab)


def build(row) -> tuple[nn.Module, torch.Tensor]:
    """(the row's model on the meta device, one microbatch of token ids on the meta device)."""
    with torch.device("meta"):
        model = RowModel(row)
    return model, torch.zeros(row.micro_batch, row.seq_len, dtype=torch.long, device="meta")
