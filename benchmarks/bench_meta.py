"""Per-rank memory of starting from a meta-device model against building the whole model on every rank.

A ViT-L/16-sized model (timm VisionTransformer(img_size=224, patch_size=16, embed_dim=1024, depth=24,
num_heads=16): 304 M parameters, 1.22 GB in float32) is parallelized on 4 gloo CPU ranks, mesh (2, 2, 1):
  full -- today's way: every rank builds the model with real weights (``torch.manual_seed(0)``), then
          ``parallelize``;
  meta -- the model is built under ``torch.device("meta")`` and ``parallelize(..., seed=0,
          init_fn=timm_init)`` allocates and initializes only the rank's shards.
Each mode runs in fresh processes (peak RSS only grows).  Per rank: RSS after importing torch, timm and
autosplit (the baseline), peak RSS (``ru_maxrss``) after ``parallelize``, the peak above the baseline,
and the bytes of the tensors the rank holds for training (its stages' tp shards).  With ``--save DIR``
the meta mode also times ``save_checkpoint`` and ``load_checkpoint`` and reports the peak after them.

    python benchmarks/bench_meta.py            # rewrites its section of docs/benchmarks.md
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import tempfile
import time
import traceback
from pathlib import Path

from common import launch, write_section

MESH = (2, 2, 1)
START, END = "<!-- bench_meta:start -->", "<!-- bench_meta:end -->"


def timm_init(name, t):
    """timm's ViT init scheme as an init_fn (the README's)."""
    from timm.layers import trunc_normal_
    from torch import nn
    if name in ("cls_token", "reg_token"):
        nn.init.normal_(t, std=1e-6)
    elif t.dim() == 4:
        nn.init.kaiming_uniform_(t, a=math.sqrt(5))
    elif name == "pos_embed" or t.dim() == 2:
        trunc_normal_(t, std=.02)
    elif name.endswith("bias"):
        nn.init.zeros_(t)
    else:
        nn.init.ones_(t)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024      # KiB on Linux


def _worker(rank, port, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(math.prod(MESH)), OMP_NUM_THREADS="1")
    try:
        import timm
        import torch
        import autosplit
        torch.set_num_threads(1)
        base = _rss_mb()

        def build():
            return timm.models.VisionTransformer(img_size=224, patch_size=16, embed_dim=1024, depth=24,
                                                 num_heads=16)
        t0 = time.perf_counter()
        if args["mode"] == "meta":
            with torch.device("meta"):
                model = build()
            extra = {"seed": 0, "init_fn": timm_init}
        else:
            torch.manual_seed(0)
            model = build()
            extra = {}
        n_params = sum(p.numel() for p in model.parameters())
        pm = autosplit.parallelize(model, mesh=MESH, num_microbatches=2, device="h100",
                                   example_input=torch.empty(1, 3, 224, 224), **extra)
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for m in pm.raw_modules for t in list(m.parameters()) + list(m.buffers())}
        out = {"baseline_mb": base, "peak_mb": _peak_mb(), "seconds": time.perf_counter() - t0,
               "held_mb": sum(held.values()) / 2**20, "n_params": n_params,
               "largest_param_mb": max(p.numel() * p.element_size() for p in model.parameters()) / 2**20}
        out["above_baseline_mb"] = out["peak_mb"] - base
        if args.get("save"):
            opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
            t0 = time.perf_counter()
            pm.save_checkpoint(args["save"])
            out["save_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            pm.load_checkpoint(args["save"])
            out["load_s"] = time.perf_counter() - t0
            out["peak_after_ckpt_mb"] = _peak_mb()
            del opt
        results.put((rank, out))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def _table(rows: dict) -> str:
    lines = ["| mode | rank | RSS after imports (MB) | peak RSS (MB) | peak above imports (MB) | tensors held (MB) | parallelize (s) |",
             "|---|---|---|---|---|---|---|"]
    for mode, ranks in rows.items():
        for r, x in enumerate(ranks):
            lines.append(f"| {mode} | {r} | {x['baseline_mb']:.0f} | {x['peak_mb']:.0f} | {x['above_baseline_mb']:.0f} "
                         f"| {x['held_mb']:.0f} | {x['seconds']:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", nargs="+", default=["meta", "full"])
    ap.add_argument("--no-save", action="store_true", help="skip timing save/load of a checkpoint (meta mode)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"))
    a = ap.parse_args(argv)
    load_before = os.getloadavg()[0]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in a.modes:
            save = os.path.join(tmp, "ckpt") if mode == "meta" and not a.no_save else None
            rows[mode] = launch(_worker, math.prod(MESH), {"mode": mode, "save": save}, timeout=1800)
            print(json.dumps({mode: rows[mode]}))
    import torch
    full = rows.get("full", [{}])[0]
    meta = rows.get("meta", [{}])[0]
    notes = [f"ViT-L/16-sized model, {meta.get('n_params', full.get('n_params', 0)) / 1e6:.0f} M parameters "
             f"({meta.get('n_params', full.get('n_params', 0)) * 4 / 2**30:.2f} GiB float32), mesh {MESH} on 4 gloo "
             f"CPU ranks; torch {torch.__version__}, {os.cpu_count()} cores, load average {load_before:.1f} before "
             f"(other agents' jobs share this machine; memory figures do not depend on load, times do)."]
    notes.append(f"Largest single parameter: {(meta or full)['largest_param_mb']:.0f} MB (an MLP weight); the meta "
                 f"mode computes each tensor at full shape on the CPU, one module at a time, and keeps its slice.")
    if "save_s" in meta:
        notes.append(f"Meta mode, rank 0: save_checkpoint (model only) {meta['save_s']:.1f} s, load_checkpoint "
                     f"{meta['load_s']:.1f} s, peak RSS after both {meta['peak_after_ckpt_mb']:.0f} MB.")
    section = "\n".join([START, "## Models bigger than one device: meta start vs full build (`benchmarks/bench_meta.py`)",
                         "", *notes, "", _table(rows), "", "Command: `python benchmarks/bench_meta.py`", END]) + "\n"
    print(section)
    write_section(Path(a.out), section, START, END)


if __name__ == "__main__":
    main()
