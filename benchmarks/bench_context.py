"""Context parallelism at long sequences: per-rank activation bytes planned on the meta device, beside the
closed form, and the predicted H100 step, for cp = 1, 2, 4, 8 (issue 52).

    python benchmarks/bench_context.py [--models vit_large_patch16_224,samvit_huge_patch16] [--image 1024]
                                       [--cp 1,2,4,8] [--batch 1] [--json out.json]

Terms:
  planned   -- ``sum(stage.activation_bytes)`` of ``autosplit.compile(model, mesh={"cp": c})`` on the meta
               device, bf16 autocast, one microbatch of ``--batch`` images: what one rank keeps for backward.
  closed form -- A / cp + K: A the bytes saved at cp = 1 minus K1, spread over the tokens; K the keys and
               values each rank gathers whole and the attention saves for backward (2 x B x N x C x 2 bytes
               per attention layer, the same on every rank whatever cp: a global block's N tokens, a
               windowed block's padded window tokens); K1 those at cp = 1.  Departures from it are the
               ops cp does not split (the patch embedding, the head, a windowed block's padding).
  step      -- ``plan.predicted_step(device="h100")``: compute, exposed cp communication (the key
               gathers, their gradients' reduce-scatters), optimizer; one rank of cp.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from torch.distributed.tensor import Shard

import autosplit
from autosplit.model_spec import build_model


def key_bytes(plan) -> float:
    """Bytes of the keys and values a rank holds for backward: one per key copy of the plan, whole where
    it was gathered, 1/cp where cp splits it on another dim (windows that lie inside a rank's tokens)."""
    total = 0.0
    for n in plan.graph.graph.nodes:
        if n.meta.get("key_copy_of") and isinstance(n.meta.get("val"), torch.Tensor):
            split = isinstance(n.meta.get("spec", {}).get("cp"), Shard)
            total += n.meta["val"].numel() * 2 / (plan.mesh.cp if split else 1)   # bf16 under autocast
    return total


def row(name: str, image: int, cp: int, batch: int, attention: str = "auto") -> dict:
    model = build_model(name, img_size=image)
    x = torch.empty(batch, 3, image, image, device="meta")
    start = time.perf_counter()
    plan = autosplit.compile(model, mesh={"cp": cp}, example_input=x, device="h100", autocast=torch.bfloat16,
                             num_microbatches=1, cp_attention=attention)
    code = "".join(str(m.code) for m in plan.stage_modules(0, 0))
    step = plan.predicted_step(device="h100")
    return {"model": name, "image": image, "cp": cp, "batch": batch, "attention": attention,
            "lowering": f"{code.count('all_to_all(')} all-to-alls, {code.count('all_gather(')} all-gathers",
            "activation_bytes": sum(s.activation_bytes for s in plan.stages),
            "key_bytes": key_bytes(plan) if cp > 1 else None,
            "param_bytes": sum(s.param_bytes for s in plan.stages),
            "step_ms": step.total * 1e3, "compute_ms": step.compute * 1e3, "cp_comm_ms": step.tp_comm * 1e3,
            "plan_s": time.perf_counter() - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="vit_large_patch16_224,samvit_huge_patch16")
    p.add_argument("--image", type=int, default=1024)
    p.add_argument("--cp", default="1,2,4,8")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--attention", default="auto", help="cp_attention: auto, gather, all_to_all, or a comma list")
    args = p.parse_args()
    rows = []
    for name in args.models.split(","):
        base = None
        for cp, attention in ((int(c), a) for c in args.cp.split(",") for a in args.attention.split(",")):
            if cp == 1 and base is not None:
                continue
            r = row(name, args.image, cp, args.batch, attention)
            if base is None:
                base = r
            # closed form (module docstring): the keys held whole are the same bytes at cp = 1, where they
            # are part of the tokens' activations; the rest divides by cp
            k = r["key_bytes"] or 0.0
            r["closed_form_bytes"] = (base["activation_bytes"] - k) / cp + k
            rows.append(r)
            print(f"{name} {args.image}px cp={cp} {attention} ({r['lowering']}): planned {r['activation_bytes'] / 2**30:.2f} GiB per rank "
                  f"(closed form {r['closed_form_bytes'] / 2**30:.2f}; keys gathered whole {k / 2**30:.2f}), "
                  f"params {r['param_bytes'] / 2**20:.0f} MiB, predicted H100 step {r['step_ms']:.1f} ms "
                  f"(compute {r['compute_ms']:.1f}, exposed cp comm {r['cp_comm_ms']:.1f}); planned in {r['plan_s']:.1f} s",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
