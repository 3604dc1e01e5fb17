"""The search on 64 H100 in 8 nodes of 8: does it keep tensor parallelism inside a node, and why.

Cases: ViT-H/14 (timm ``vit_huge_patch14_224``, global batch 1024) and a ViT-22B-like model (timm
VisionTransformer, patch 14, width 6144, depth 48, 48 heads, global batch 512), built on the meta device.
Profile: the built-in ``h100`` (cost_model/device.py: kernel model, NVLink with NVLink SHARP all-reduce,
400 Gb/s per GPU between nodes, 8 GPUs per node; fitted by bench_gpu_tables.py and bench_nccl_tables.py),
80 GiB per device, float32 (the search prices the model's own dtype).

Printed per case: the search's top ten with each candidate's compute, exposed tp / pp / dp communication
and memory (``SearchResult.table``), the tp sizes of the top five, and, for comparison, the first choice
with tp doubled across two nodes (dp halved), compiled and priced by ``plan.predicted_step()``.

Run:  python benchmarks/bench_search_topology.py [--only NAME]
"""
from __future__ import annotations

import argparse

import timm
import torch

import autosplit

CASES = {   # name: (model factory, global batch)
    "vit_h14": (lambda: timm.create_model("vit_huge_patch14_224"), 1024),
    "vit_22b": (lambda: timm.models.VisionTransformer(img_size=224, patch_size=14, embed_dim=6144, depth=48,
                                                      num_heads=48, mlp_ratio=4), 512),
}
WORLD = 64


def run(name: str) -> str:
    factory, batch = CASES[name]
    with torch.device("meta"):
        model = factory()
    x = torch.empty(1, 3, 224, 224, device="meta")
    result = autosplit.search(model, WORLD, x, global_batch=batch, device="h100", memory_budget="80GiB", top=10)
    ranked = list(result)
    lines = [f"## {name}: {WORLD} x H100 (8 per node), global batch {batch}", "", "```", result.table(), "```"]
    top_tp = [c.mesh[1] for c in ranked[:5]]
    lines.append(f"tp of the top five: {top_tp}; inside one node: {all(t <= 8 for t in top_tp)}")
    best = ranked[0]
    pp, tp, dp = best.mesh
    if tp > 1 and dp % 2 == 0:       # the same configuration with tp doubled across two nodes, dp halved
        mesh = (pp, 2 * tp, dp // 2)
        opts = {k: v for k, v in best.options.items() if k in _COMPILE_OPTIONS}
        micro = batch // dp * 2 // opts.get("num_microbatches", 1)
        plan = autosplit.compile(model, mesh=mesh, example_input=torch.empty(micro, 3, 224, 224, device="meta"),
                                 device="h100", **opts)
        p = plan.predicted_step()
        where = f"tp groups across {2 * tp // 8} nodes" if 2 * tp > 8 else "tp groups still inside a node"
        lines.append(f"the best with tp={2 * tp} instead (mesh {mesh}, {where}): "
                     f"{p.total * 1e3:.1f} ms ({p.total / best.step_time:.2f}x), tp comm {p.tp_comm * 1e3:.1f} ms "
                     f"vs {best.parts['tp_comm'] * 1e3:.1f} ms")
    return "\n".join(lines)


_COMPILE_OPTIONS = ("tp_mode", "schedule", "chunks_per_rank", "num_microbatches", "sequence_parallel", "recompute",
                    "dp_shard")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", choices=sorted(CASES), default=None)
    args = p.parse_args()
    for name in [args.only] if args.only else CASES:
        print(run(name), flush=True)


if __name__ == "__main__":
    main()
