"""What splitting the backward costs: one pipeline stage's F + B (fused) against F + I + W (split).

One stage of the pipeline benchmark's model, built alone: timm ``VisionTransformer(img_size=32,
patch_size=4, embed_dim=192, depth=6, num_heads=3)``, microbatch 8, one process, one thread.  Every
linear and the patch-embedding conv of the split copy are autosplit's ``SplitLinear`` / ``SplitConv``
(what the split_backward pass puts in a stage graph); I runs the backward with the weight gradients
deferred, W runs them (autosplit/weight_grad.py).  A step is 8 microbatches; the two models alternate
step by step; medians of the timed steps, per microbatch.  Page faults: the process's minor faults per
step (``getrusage``), the cost autosplit/host_memory.py removes.

    python benchmarks/bench_split_backward.py                            # with autosplit's malloc settings
    AUTOSPLIT_HOST_MALLOC=0 python benchmarks/bench_split_backward.py    # glibc's defaults
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time

import timm
import torch
from torch import nn

from autosplit.passes.split_backward import _module_split
from autosplit.host_memory import keep_freed_host_memory
from autosplit.weight_grad import DEFERRED

MICROBATCHES, MB = 8, 8


def build(split: bool) -> nn.Module:
    torch.manual_seed(0)
    model = timm.models.VisionTransformer(img_size=32, patch_size=4, embed_dim=192, depth=6, num_heads=3,
                                          num_classes=10)
    if split:       # the split_backward pass's own choice of stand-in for each module (None: kept fused)
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                stand_in = _module_split(child)
                if stand_in is not None:
                    setattr(parent, name, stand_in)
    return model


def step(model: nn.Module, x, y, split: bool) -> tuple[float, float, float]:
    """Seconds of F, B (or I), W summed over the microbatches."""
    f = b = w = 0.0
    for i in range(MICROBATCHES):
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        if split:
            with DEFERRED.collecting((0, i)):
                loss.backward()
        else:
            loss.backward()
        t2 = time.perf_counter()
        if split:
            DEFERRED.run((0, i))
        t3 = time.perf_counter()
        f, b, w = f + t1 - t0, b + t2 - t1, w + t3 - t2
    return f, b, w


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    applied = keep_freed_host_memory()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(MB, 3, 32, 32, generator=g), torch.randint(0, 10, (MB,), generator=g)
    models = {"fused": build(False), "split": build(True)}
    times: dict = {k: [] for k in models}
    faults: dict = {k: [] for k in models}
    for s in range(args.steps + args.warmup):
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = step(model, x, y, split=name == "split")
            if s >= args.warmup:
                times[name].append(t)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(f"malloc: {'autosplit host_memory settings' if applied else 'defaults'}; ms per microbatch, "
          f"medians of {args.steps} steps")
    total = {}
    for name, rows in times.items():
        f, b, w = (statistics.median(r[k] for r in rows) * 1e3 / MICROBATCHES for k in range(3))
        total[name] = f + b + w
        print(f"{name:5s}  F {f:6.2f}  {'I' if name == 'split' else 'B'} {b:6.2f}  W {w:6.2f}  "
              f"total {total[name]:6.2f}  page faults per step {statistics.median(faults[name]):,.0f}")
    print(f"split / fused: {total['split'] / total['fused']:.3f}")


if __name__ == "__main__":
    main()
