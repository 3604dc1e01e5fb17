"""Strategy search time and peak memory: ViT-B/16 on 8, ViT-H/14 on 64, a ViT-22B-like model on 1024
devices (H100 profile, 80 GiB per device).  Each model is built on the meta device.

    python benchmarks/bench_search.py [--only NAME] [--autocast bf16|fp16] [--no-cp] [--max-tp N|node|none]

Prints, per case: wall seconds, CPU seconds of this process (the machine is shared; CPU time is what
the search itself costs), the search's phases (``SearchResult.phases``: trace, tensor-parallel
rewrites, compute floors, group costs, pricing, enumeration; wall seconds), peak traced Python memory
(tracemalloc, ``--traced``) and max RSS, and the first choice.  The times come from a run without
tracemalloc (which slows allocation-heavy Python several times); the traced peak from a second run of
the same search.  Each case runs in its own process (``--only``), so max RSS is that case's.
"""
from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
import tracemalloc

import timm
import torch

import autosplit
from autosplit.cli_options import max_tp_arg

CASES = {   # name: (model factory, world, global batch)
    "vit_b16@8": (lambda: timm.create_model("vit_base_patch16_224"), 8, 256),
    "vit_h14@64": (lambda: timm.create_model("vit_huge_patch14_224"), 64, 1024),
    "vit_22b@1024": (lambda: timm.models.VisionTransformer(img_size=224, patch_size=14, embed_dim=6144, depth=48,
                                                           num_heads=48, mlp_ratio=4), 1024, 4096),
}


def run(name: str, traced: bool = False, autocast=None, context_parallel: bool = True, max_tp="node") -> dict:
    factory, world, batch = CASES[name]
    with torch.device("meta"):
        model = factory()
    x = torch.empty(1, 3, 224, 224, device="meta")
    search = lambda: autosplit.search(model, world, x, global_batch=batch, device="h100", memory_budget="80GiB",
                                      top=5, autocast=autocast, context_parallel=context_parallel,
                                      max_tp=max_tp)
    wall, cpu = time.perf_counter(), time.process_time()
    result = search()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peak = None
    if traced:
        tracemalloc.start()
        search()
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    phases = getattr(result, "phases", {})
    return {"case": name, "wall_s": wall, "cpu_s": cpu, **{f"{k.replace(' ', '_')}_s": v for k, v in phases.items()},
            "peak_traced_MiB": peak, "max_rss_MiB": rss,
            "priced": result.evaluated, "pruned": result.pruned, "rejected": len(result.rejected),
            "best": result[0].label if result else None,
            "best_ms": result[0].step_time * 1e3 if result else None, "table": result.table()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", choices=sorted(CASES), default=None)
    p.add_argument("--traced", action="store_true", help="also the peak traced Python memory (a second search)")
    p.add_argument("--autocast", choices=("bf16", "fp16"), default=None, help="search for training under autocast")
    p.add_argument("--no-cp", action="store_true", help="without the cp layouts (context_parallel=False)")
    p.add_argument("--max-tp", type=max_tp_arg, default="node",
                   help="search's max_tp: node (default), a number or none")
    args = p.parse_args()
    if args.only is None:           # one process per case: max RSS is the case's own
        for name in CASES:
            subprocess.run([sys.executable, __file__, "--only", name, "--max-tp", str(args.max_tp).lower()] +
                           (["--traced"] if args.traced else []) + (["--no-cp"] if args.no_cp else []) +
                           (["--autocast", args.autocast] if args.autocast else []), check=False)
        return
    r = run(args.only, args.traced, {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.autocast],
            not args.no_cp, args.max_tp)
    print(r.pop("table"))
    print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    main()
