"""Functions run on every rank of a test pool for tests/test_zero_bubble.py, and the models they share.

``SharedWeightViT`` uses weights twice: one ``nn.Linear`` module called twice per block, and one
parameter passed to ``F.linear`` twice, so a split backward defers two gradients for one weight per
microbatch; they must add up (and add to the other microbatches'), never overwrite.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autosplit.runtime.parallel.data_parallel import GradBuckets
from autosplit.weight_grad import DEFERRED
from tests.dist_checks import train_matches_single_device
from tests.models import VARIANTS


class SharedBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)                           # called twice (a reused module)
        self.w = nn.Parameter(torch.randn(dim, dim) * dim ** -0.5)  # passed to F.linear twice

    def forward(self, x):                                        # (B, N, C)
        x = x + self.mix(F.gelu(self.mix(self.ln1(x))))
        h = self.ln2(x)
        return x + F.linear(torch.tanh(F.linear(h, self.w)), self.w)


class SharedWeightViT(nn.Module):
    def __init__(self, img: int = 32, patch: int = 8, dim: int = 32, depth: int = 4, classes: int = 10):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, patch, patch)
        self.blocks = nn.ModuleList(SharedBlock(dim) for _ in range(depth))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):                                        # (B, 3, H, W)
        x = self.embed(x).flatten(2).transpose(1, 2)             # (B, N, C)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


VARIANTS.setdefault("shared_weight", SharedWeightViT)


def train_with_deferral(name: str, mesh, schedule: str, microbatches: int, **kw) -> dict:
    """``train_matches_single_device``, also counting the weight gradients the split GEMMs deferred (so
    a pass that split nothing cannot pass), those run while a tp backward collective was in flight,
    and the dp buckets that launched before the step's end (arming at the last W keeps the overlap);
    ``deferring``: the stages whose weight gradients were queued (the split ones)."""
    counted = {"deferred": 0, "early": [], "deferring": set()}
    run, overlapped = DEFERRED.run, DEFERRED.overlapped

    def counting_run(key):
        counted["deferred"] += len(DEFERRED.pending.get(key, []))
        if DEFERRED.pending.get(key) and len(key) == 2 and isinstance(key[0], int):   # (stage, microbatch)
            counted["deferring"].add(key[0])
        run(key)

    DEFERRED.run = counting_run
    original_finish = GradBuckets.finish

    def finish(self):
        original_finish(self)
        counted["early"].append(self.launched_early)

    GradBuckets.finish = finish
    try:
        chunks = 2 if schedule == "zb-v" else 1
        # a fixed device profile: the same cut on every run (a CPU profile measured under load can
        # move a cut so far that a rank holds no parameters at pp=4)
        kw.setdefault("device", "h100")
        result = train_matches_single_device(name, mesh, schedule, chunks, microbatches=microbatches, **kw)
    finally:
        DEFERRED.run = run
        GradBuckets.finish = original_finish
    # weight gradients computed while a tp backward collective was in flight
    return {**result, **counted, "overlapped": DEFERRED.overlapped - overlapped}

