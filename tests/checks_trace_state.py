"""A ViT-like model whose attention caches a tensor on itself in forward, and the checks run on a pool
(tests/test_trace_state.py): planning must leave no state of its trace in the model or the stages."""
from __future__ import annotations

import copy

import torch
from torch import nn

import autosplit
from tests.dist_checks import batches, reference_training, train_steps


class RelPosBias(nn.Module):
    """A learned relative-position bias whose (N, N) index table is built lazily on the first forward
    and kept on ``self`` with the N it was built for (refreshed when N changes), as Swin / BEiT-style
    code does.  Branching on N keeps torch.fx out: the model lists it as a leaf."""

    def __init__(self, heads: int, max_tokens: int):
        super().__init__()
        self.max_tokens = max_tokens
        self.table = nn.Parameter(torch.randn(2 * max_tokens - 1, heads) * 0.02)
        self._cache = None
        self._cache_n = None

    def forward(self, attn: torch.Tensor) -> torch.Tensor:   # attn: (B, heads, N, N)
        n = attn.shape[-1]
        if self._cache_n != n:
            pos = torch.arange(n, device=attn.device)
            self._cache = pos[:, None] - pos[None, :] + self.max_tokens - 1
            self._cache_n = n
        return attn + self.table[self._cache].permute(2, 0, 1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, max_tokens: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.rel = RelPosBias(heads, max_tokens)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = self.rel((q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, max_tokens: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, max_tokens)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class CachingViT(nn.Module):
    """32x32 images, 8x8 patches: 16 tokens and a class token."""

    def __init__(self, dim: int = 32, heads: int = 4, depth: int = 4, classes: int = 7):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 8, 8)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, 17, dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(dim, heads, 17) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


LEAVES = [RelPosBias]


def module_state(model: nn.Module) -> dict:
    """Every module's attributes: path -> {name: a comparable description} (tensors by device, dtype,
    shape and values; parameters and buffers too; submodules by identity)."""
    def describe(value):
        if isinstance(value, torch.Tensor):
            data = None if value.device.type == "meta" else value.detach().cpu().clone()
            return ("tensor", id(value), value.device.type, value.dtype, tuple(value.shape), data)
        if isinstance(value, dict):
            return ("dict", {k: describe(v) for k, v in value.items()})
        if isinstance(value, nn.Module):
            return ("module", id(value))
        if isinstance(value, (int, float, str, bool, type(None), tuple)):
            return ("plain", value)
        return ("object", id(value))
    return {path: {k: describe(v) for k, v in vars(m).items()} for path, m in model.named_modules()}


def same_state(a: dict, b: dict) -> list[str]:
    """The differences between two ``module_state``s, as readable lines (empty: the same)."""
    out = []
    for path in sorted(set(a) | set(b)):
        x, y = a.get(path, {}), b.get(path, {})
        for k in sorted(set(x) | set(y)):
            if not _equal(x.get(k), y.get(k)):
                out.append(f"{path or '<root>'}.{k}: {_short(x.get(k))} -> {_short(y.get(k))}")
    return out


def _equal(x, y) -> bool:
    if type(x) is not type(y):
        return False
    if isinstance(x, tuple) and x and x[0] == "tensor":
        return x[:5] == y[:5] and (x[5] is None) == (y[5] is None) and (x[5] is None or torch.equal(x[5], y[5]))
    if isinstance(x, tuple) and x and x[0] == "dict":
        return set(x[1]) == set(y[1]) and all(_equal(x[1][k], y[1][k]) for k in x[1])
    return x == y


def _short(d) -> str:
    if isinstance(d, tuple) and d and d[0] == "tensor":
        return f"tensor on {d[2]} {d[4]}"
    return "absent" if d is None else repr(d)[:60]


def meta_attributes(modules) -> list[str]:
    """Every meta tensor an attribute of a module under ``modules`` holds (parameters and buffers too)."""
    out = []
    for i, root in enumerate(modules):
        for path, m in root.named_modules():
            for k, v in vars(m).items():
                values = v.items() if k in ("_parameters", "_buffers") else [(k, v)]
                for name, t in values:
                    if isinstance(t, torch.Tensor) and t.device.type == "meta":
                        out.append(f"stage module {i}: {path or '<root>'}.{name}")
    return out


def trains_like_one_device(mesh, microbatches: int = 2, batch: int = 8, steps: int = 2, lr: float = 0.1):
    """``steps`` SGD steps at ``mesh`` vs one device, and the stage modules' and model's state after."""
    torch.manual_seed(0)
    model = CachingViT()
    xs, ys = batches(steps, batch)
    ref_losses, ref_state = reference_training(model, xs, ys, lr)
    before = module_state(model)
    pm = autosplit.parallelize(model, mesh=mesh, num_microbatches=microbatches, leaf_modules=LEAVES, device="h100",
                               example_input=xs[0, : batch // mesh[2] // microbatches])
    changed = same_state(before, module_state(model))
    metas = meta_attributes(pm.planner.raw_modules)
    losses = train_steps(pm, torch.optim.SGD(pm.parameters(), lr=lr), xs, ys, slice(None))
    state = pm.full_state_dict()
    pm.close()
    return {"loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "param_diff": max((state[k] - ref_state[k]).abs().max().item() for k in ref_state),
            "changed": changed, "metas": metas}
