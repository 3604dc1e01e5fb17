"""Per-rank memory of a meta-built model under ``dp_shard`` (FSDP2 over dp) against plain dp, on CPU (gloo).

A ViT-L-wide model (timm VisionTransformer(img_size=32, patch_size=4, embed_dim=1024, depth=8,
num_heads=16, num_classes=10): 100.9 M parameters, 404 MB in float32) is built under
``torch.device("meta")`` and parallelized on mesh (1, 1, 4) with ``seed=0, init_fn=timm_init``, then
trained one AdamW step (4 images a replica, 2 microbatches).  Each mode runs in fresh processes.  Per
rank, after the step:
  rss         -- resident memory (``/proc/self/statm``), MB;
  live        -- bytes of the distinct storages of every plain tensor the garbage collector can reach
                 (a DTensor's local shard is one), MB: what Python keeps alive, wherever it is held;
  shards      -- bytes of the parameters the rank trains (``pm.parameters()``: local shards under
                 dp_shard), MB;
  optimizer   -- bytes of the optimizer's state, MB.
Without dp_shard every rank holds the whole model; with it, live should be shards + optimizer + a
little (the issue's defect: the whole unsharded stage stayed alive beside the shards).

    python benchmarks/bench_shard_memory.py                 # modes: off stage layer
    PYTHONPATH=DIR python benchmarks/bench_shard_memory.py  # another autosplit (e.g. an older wheel's)
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import traceback

from bench_meta import timm_init          # the README's init_fn
from common import launch

MESH = (1, 1, 4)


def _mb(n: int) -> float:
    return n / 2**20


def _live_bytes() -> int:
    """Distinct storages of the plain tensors the garbage collector tracks (DTensors hold a plain local one)."""
    import torch
    seen = {}
    for obj in gc.get_objects():
        if type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter:
            if obj.device.type == "meta":
                continue
            s = obj.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _worker(rank, port, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(math.prod(MESH)), OMP_NUM_THREADS="1")
    try:
        import timm
        import torch
        import autosplit
        from autosplit.runtime.parallel.fsdp import local_part
        torch.set_num_threads(1)
        with torch.device("meta"):
            model = timm.models.VisionTransformer(img_size=32, patch_size=4, embed_dim=1024, depth=8,
                                                  num_heads=16, num_classes=10)
        shard = args["mode"] if args["mode"] != "off" else False
        pm = autosplit.parallelize(model, mesh=MESH, loss_fn=torch.nn.CrossEntropyLoss(), num_microbatches=2,
                                   example_input=torch.empty(2, 3, 32, 32), seed=0, init_fn=timm_init,
                                   dp_shard=shard)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        torch.manual_seed(rank)
        pm.step(torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        gc.collect()
        nbytes = lambda t: local_part(t).numel() * local_part(t).element_size()   # noqa: E731
        optimizer = sum(nbytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        results.put((rank, {"rss": _mb(rss), "live": _mb(_live_bytes()),
                            "shards": _mb(sum(nbytes(p) for p in pm.parameters())), "optimizer": _mb(optimizer)}))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", nargs="+", default=["off", "stage", "layer"])
    a = ap.parse_args(argv)
    import autosplit
    print(f"autosplit from {os.path.dirname(autosplit.__file__)}")
    print("| dp_shard | rank | RSS after a step (MB) | live tensors (MB) | trained shards (MB) | optimizer (MB) |")
    print("|---|---|---:|---:|---:|---:|")
    for mode in a.modes:
        for r, x in enumerate(launch(_worker, math.prod(MESH), {"mode": mode}, timeout=1200)):
            print(f"| {mode} | {r} | {x['rss']:.0f} | {x['live']:.0f} | {x['shards']:.0f} | {x['optimizer']:.0f} |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
