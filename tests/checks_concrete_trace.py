"""Models whose forward branches on shapes, and the rank function training one, for
tests/test_concrete_trace.py (see autosplit/trace_concrete.py).

Terms:
  ShapeNet  -- a small windowed ViT whose every module decides something from a shape, as timm's
               GPSA, TinyVitBlock and LocallyGroupedAttn do: a resolution assert on the height
               (``assert x.shape[2] == self.img_size[0]``), padding to a window multiple (``if W % ws:
               x = F.pad(...)``), a position table cached on the module and rebuilt when the token count
               changes, with ``int(N ** 0.5)``.  torch.fx alone refuses each of them.
  reference -- single-device SGD training of the same model on the same batches.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import autosplit

IMAGE, CLASSES, STEPS, BATCH, MICROBATCHES, LR = 12, 10, 3, 8, 2, 0.1


class PatchEmbed(nn.Module):
    def __init__(self, dim: int, img_size=(IMAGE, IMAGE), patch: int = 2):
        super().__init__()
        self.img_size = img_size
        self.proj = nn.Conv2d(3, dim, patch, patch)

    def forward(self, x):                               # (B, 3, H, W)
        assert x.shape[2] == self.img_size[0], f"input height {x.shape[2]}, expected {self.img_size[0]}"
        return self.proj(x).permute(0, 2, 3, 1)         # (B, H, W, C)


class WindowAttention(nn.Module):
    """Multi-head attention inside ws x ws windows of the token grid, padded to a window multiple."""

    def __init__(self, dim: int, heads: int, ws: int):
        super().__init__()
        self.heads, self.ws = heads, ws
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):                               # (B, H, W, C)
        B, H, W, C = x.shape
        ws = self.ws
        if W % ws or H % ws:
            x = F.pad(x, (0, 0, 0, (ws - W % ws) % ws, 0, (ws - H % ws) % ws))
        Hp, Wp = x.shape[1], x.shape[2]
        nh, nw = Hp // ws, Wp // ws
        x = x.reshape(B, nh, ws, nw, ws, C).transpose(2, 3).reshape(B * nh * nw, ws * ws, C)
        n = x.shape[1]
        qkv = self.qkv(x).reshape(B * nh * nw, n, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B * nh * nw, n, C)
        x = self.proj(x)
        x = x.reshape(B, nh, nw, ws, ws, C).transpose(2, 3).reshape(B, Hp, Wp, C)
        return x[:, :H, :W, :]


class CachedBiasMlp(nn.Module):
    """An MLP plus a position table built from the token count, cached on the module and rebuilt when
    that count changes (convit's GPSA keeps its rel_indices so)."""

    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.scale = nn.Parameter(torch.full((dim,), 0.1))
        self.table, self.table_n = None, 0

    def forward(self, x):                               # (B, H, W, C)
        B, H, W, C = x.shape
        N = H * W
        if self.table is None or self.table_n != N:
            side = int(N ** 0.5)
            pos = torch.arange(N, dtype=x.dtype, device=x.device)
            self.table = (pos / (side * side) - 0.5).reshape(H, W, 1)       # (H, W, 1)
            self.table_n = N
        return self.fc2(F.gelu(self.fc1(x))) + self.table * self.scale


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, ws: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads, ws)
        self.mlp = CachedBiasMlp(dim)

    def forward(self, x):                               # (B, H, W, C)
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ShapeNet(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2, ws: int = 4, depth: int = 2):
        super().__init__()
        self.patch_embed = PatchEmbed(dim)
        self.blocks = nn.Sequential(*[Block(dim, heads, ws) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x):                               # (B, 3, IMAGE, W)
        x = self.blocks(self.patch_embed(x))
        return self.head(self.norm(x).mean((1, 2)))


def build() -> ShapeNet:
    torch.manual_seed(0)
    return ShapeNet()


def batches():
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(STEPS, BATCH, 3, IMAGE, IMAGE, generator=g)      # (steps, B, 3, H, W)
    ys = torch.randint(0, CLASSES, (STEPS, BATCH), generator=g)
    return xs, ys


def _reference(model, xs, ys):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in zip(xs, ys):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def train_shape_net(mesh) -> dict:
    """ShapeNet trained on ``mesh`` against its single-device reference (every rank computes it)."""
    model = build()
    xs, ys = batches()
    ref_losses, ref_state = _reference(model, xs, ys)
    pm = autosplit.parallelize(model, mesh=mesh, loss_fn=nn.CrossEntropyLoss(), num_microbatches=MICROBATCHES,
                               example_input=xs[0, : BATCH // MICROBATCHES])
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    losses = []
    with pm:
        for x, y in zip(xs, ys):
            losses.append(pm.step(x, y))
            opt.step()
            opt.zero_grad()
        state = pm.full_state_dict()
        sharded = sorted(pm.plan.tp_plan.sharded) if pm.plan.tp_plan is not None else []
    diffs = {k: (state[k].float() - ref_state[k].float()).abs().max().item() for k in ref_state}
    return {"loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)), "param_diff": max(diffs.values()),
            "keys_equal": set(state) == set(ref_state), "sharded": sharded}
