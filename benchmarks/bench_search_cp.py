"""The strategy search with the cp axis (issue 52, "costed and searched"): ViT-H/14 on 64 H100 with a small
global batch, at 1024x1024 (5,330 tokens) and at 224x224 (257 tokens).  The search should choose a cp layout
at 1024 and none at 224.

    nice python benchmarks/bench_search_cp.py [--images 1024,224] [--world 64] [--global-batch 16]
                                             [--memory-budget 80GiB] [--top 8] [--without-cp] [--json out.json]

Per image size: the search's table (mesh with cp, predicted step in ms with its parts, memory of the
fullest rank), its time (wall and CPU seconds of this process: the machine may be shared) and phases,
and the fastest candidate with cp and without (from the table, or "not in the top N").  ``--without-cp``
also runs the search without cp layouts (``search(..., context_parallel=False)``: the search before the
cp axis) and prints its first choice, so the gain of cp is the difference of the two first choices.

The model is built on the meta device (autosplit/model_spec.py ``build_model``); the profile is the
H100 datasheet one (8 GPUs per node), training under bf16 autocast with AdamW.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import autosplit
from autosplit.model_spec import build_model

MODEL = "vit_huge_patch14_224"


def run(image: int, world: int, batch: int, budget, top: int, context: bool = True) -> dict:
    model = build_model(MODEL, img_size=image)
    x = torch.empty(1, 3, image, image, device="meta")
    wall, cpu = time.perf_counter(), time.process_time()
    result = autosplit.search(model, world, x, global_batch=batch, device="h100", memory_budget=budget, top=top,
                              autocast=torch.bfloat16, context_parallel=context)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    with_cp = next((c for c in result if c.mesh.cp > 1), None)
    without = next((c for c in result if c.mesh.cp == 1), None)
    tokens = (image // 14) ** 2 + 1
    return {"image": image, "tokens": tokens, "world": world, "global_batch": batch, "context_parallel": context,
            "wall_s": wall, "cpu_s": cpu, "phases": result.phases, "priced": result.evaluated,
            "pruned": result.pruned, "rejected": len(result.rejected),
            "best": _row(result[0]) if result else None, "best_cp": _row(with_cp), "best_without_cp": _row(without),
            "table": result.table()}


def _row(c) -> dict | None:
    if c is None:
        return None
    return {"label": c.label, "mesh": {"pp": c.mesh.pp, "cp": c.mesh.cp, "tp": c.mesh.tp, "dp": c.mesh.dp},
            "step_ms": c.step_time * 1e3, "memory_GiB": c.memory / 2**30,
            "parts_ms": {k: v * 1e3 for k, v in c.parts.items()}}


def _say(c: dict | None, top: int) -> str:
    if c is None:
        return f"not in the top {top}"
    return f"{c['label']}: {c['step_ms']:.1f} ms, {c['memory_GiB']:.1f} GiB per rank"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", default="1024,224")
    p.add_argument("--world", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--memory-budget", default="80GiB")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--without-cp", action="store_true", help="also search without cp layouts, for comparison")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    for image in (int(s) for s in args.images.split(",")):
        runs = [True, False] if args.without_cp else [True]
        for context in runs:
            r = run(image, args.world, args.global_batch, args.memory_budget, args.top, context)
            rows.append(r)
            print(f"== {MODEL} at {image}x{image} ({r['tokens']} tokens), {args.world} H100, global batch "
                  f"{args.global_batch}, bf16 autocast, budget {args.memory_budget}"
                  f"{'' if context else ', without cp layouts'}")
            print(r["table"])
            print(f"search: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU; first choice "
                  f"{_say(r['best'], args.top)}")
            if context:
                print(f"  fastest with cp:    {_say(r['best_cp'], args.top)}")
                print(f"  fastest without cp: {_say(r['best_without_cp'], args.top)}")
            print(flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "table"} for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
