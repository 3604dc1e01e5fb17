"""Plan a timm ViT offline: built on the meta device (no weights, no GPU, no process group).

    python examples/plan_vit.py vit_base_patch16_224 --mesh 4,1,1 --batch 8 --out plan_vit_b
"""
import argparse
import os
import time

import timm
import torch

import autosplit
from autosplit.schedule import SCHEDULES

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("model", help="timm model name, e.g. vit_tiny_patch16_224 (see timm.list_models('vit*'))")
p.add_argument("--mesh", default="2,1,1", help="PP,TP,DP")
p.add_argument("--batch", type=int, default=8, help="microbatch size")
p.add_argument("--image-size", type=int, default=None, help="default: the model's own")
p.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
p.add_argument("--chunks-per-rank", type=int, default=1)
p.add_argument("--microbatches", type=int, default=None, help="default: 2 * pp")
p.add_argument("--device", default="h100", help="cost model profile: h100, h200, a100 or cpu")
p.add_argument("--out", default="plan_out", help="directory for the dump")
args = p.parse_args()

start = time.perf_counter()
with torch.device("meta"):
    kwargs = {"img_size": args.image_size} if args.image_size else {}
    model = timm.create_model(args.model, pretrained=False, **kwargs)
_, h, w = model.pretrained_cfg["input_size"]
size = (args.image_size, args.image_size) if args.image_size else (h, w)
x = torch.empty(args.batch, 3, *size, device="meta")
plan = autosplit.compile(model, mesh=tuple(int(s) for s in args.mesh.split(",")), example_input=x,
                         schedule=args.schedule, chunks_per_rank=args.chunks_per_rank,
                         num_microbatches=args.microbatches, device=args.device)
print(plan.summary())
print(f"planned {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params in "
      f"{time.perf_counter() - start:.2f} s")
files = plan.dump(args.out)
print(f"wrote {len(files)} files to {args.out}: " + ", ".join(sorted({f.split('/')[-1] for f in files})[:8]))
print(f"report: {os.path.abspath(os.path.join(args.out, 'report.html'))}")
