"""Sharded data parallelism (``dp_shard``, FSDP2 over dp) against replicated dp, on CPU (gloo).

memory -- a ViT-B-sized model (timm VisionTransformer(img_size=32, patch_size=4, embed_dim=768,
          depth=12, num_heads=12, num_classes=10): 85.2 M parameters, ViT-B/16's blocks on 64 tokens)
          on mesh (1, 1, dp) for dp = 1, 2, 4: one AdamW step, then each rank counts the bytes of its
          parameters, gradients and optimizer state (local shards: ``to_local()``), beside the cost
          model's per-rank prediction (cost_model/sharding.py ``dp_cost(...).state_bytes``, from the
          plan's parameter bytes).  Replicated, per stage and per layer.
time   -- a smaller ViT (embed_dim=192, depth=12, 5.5 M parameters) on mesh (1, 1, dp): replicated,
          dp_shard="stage" and dp_shard="layer" built side by side in one world, timed by ``common.rotate``
          (``--block`` steps of each in turn, the order rotated every round, each after a barrier); a step's
          time is the slowest rank's (forward + backward of 4 microbatches, the dp collectives, AdamW step).

    python benchmarks/bench_fsdp.py memory --dp 1 2 4
    python benchmarks/bench_fsdp.py time --dp 2 --rounds 5 --block 3
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from common import rotate, slowest, spawn_ranks, step_stats, train_step

MODES = {"replicated": False, "stage": "stage", "layer": "layer"}


def _model(width: int):
    import timm
    return timm.models.VisionTransformer(img_size=32, patch_size=4, embed_dim=width, depth=12,
                                         num_heads=width // 64, num_classes=10)


def _state_bytes(pm, opt) -> dict:
    from autosplit.runtime.parallel.fsdp import local_part

    def nbytes(t):
        t = local_part(t)
        return t.numel() * t.element_size()
    params = list(pm.parameters())
    optimizer = sum(nbytes(v) for p in params for v in opt.state[p].values() if hasattr(v, "numel"))
    return {"param": sum(nbytes(p) for p in params), "grad": sum(nbytes(p.grad) for p in params
                                                                  if p.grad is not None), "optimizer": optimizer}


def _build(mode, dp, width, microbatches, batch):
    import torch
    import autosplit
    torch.manual_seed(0)
    model = _model(width)
    return autosplit.parallelize(model, mesh=(1, 1, dp), num_microbatches=microbatches, dp_shard=MODES[mode],
                                 example_input=torch.randn(batch // dp // microbatches, 3, 32, 32), device="cpu")


def run_rank(rank, args) -> dict:
    import torch

    from autosplit.cost_model.sharding import dp_cost
    dp, batch, m = args["dp"], args["batch"], 4
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)
    rows = slice(rank * batch // dp, (rank + 1) * batch // dp)
    if args["what"] == "memory":
        out = {}
        for mode in args["modes"]:
            pm = _build(mode, dp, 768, m, batch)
            opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
            pm.step(x[rows], y[rows])
            opt.step()
            stage = pm.plan.stages[0]
            predicted = dp_cost(stage.param_bytes, 0, dp, m, pm.plan.dp_shard, "cpu").state_bytes
            out[mode] = {**_state_bytes(pm, opt), "predicted": predicted, "plan_memory": stage.memory_bytes,
                         "n_params": stage.n_params}
            del pm, opt
        return out
    steps = {}
    for mode in args["modes"]:
        pm = _build(mode, dp, args["width"], m, batch)
        steps[mode] = train_step(lambda pm=pm: pm.step(x[rows], y[rows]), torch.optim.AdamW(pm.parameters(), lr=1e-4))
    return rotate(steps, list(steps), args["block"], args["rounds"] * args["block"], args["block"])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["memory", "time"])
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--width", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=int, default=3)
    a = ap.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", file=sys.stderr)
    for dp in a.dp:
        args = {"what": a.what, "dp": dp, "modes": [m for m in a.modes if dp > 1 or m == "replicated"],
                "batch": a.batch, "width": a.width, "rounds": a.rounds, "block": a.block}
        res = spawn_ranks(run_rank, dp, args, timeout=1800)
        if a.what == "time":                # the slowest rank's steps
            res = [{k: step_stats(slowest(res, "times", k)) for k in args["modes"]}] * dp
        print(json.dumps({"dp": dp, "what": a.what, "rank0": res[0],
                          "ranks_equal": all(r == res[0] for r in res) if a.what == "memory" else None}))
    print(f"load average after: {os.getloadavg()[0]:.1f}", file=sys.stderr)


if __name__ == "__main__":
    main()
