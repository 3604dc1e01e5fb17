"""``python -m autosplit search MODEL --world 64 --batch 512 --device h100 --memory 80GiB [--top N]``.

Prints the strategy search's ranked table (mesh and options, predicted step time with its parts,
memory of the fullest rank) and how many configurations were rejected, by reason.  MODEL as for
``plan`` (a timm name or ``package.module:factory``, built on the meta device).
"""
from __future__ import annotations

import sys

import torch

from autosplit.cost_model.profiles import NAMES
from autosplit.errors import AutosplitError
from autosplit.inputs import default_input_shape


def add_search_parser(sub) -> None:
    p = sub.add_parser("search", help="rank every parallel configuration by predicted step time")
    p.add_argument("model", help="timm model name or package.module:factory")
    p.add_argument("--world", type=int, required=True, help="number of devices")
    p.add_argument("--batch", type=int, required=True, help="global batch: samples per optimizer step")
    p.add_argument("--device", default="h100", choices=NAMES, help="cost-model profile (default h100)")
    p.add_argument("--memory", default=None, help="memory budget per device, e.g. 80GiB (default: none)")
    p.add_argument("--top", type=int, default=10, help="configurations to show (default 10)")
    p.add_argument("--image-size", type=int, default=None, help="input height/width (default: the model's)")


def run_search(args, build_model) -> int:
    """``build_model(spec, image_size)``: __main__'s model builder (passed in: no import cycle)."""
    from autosplit.strategy import search
    try:
        model = build_model(args.model, args.image_size)
        x = torch.empty(1, *default_input_shape(model, args.image_size), device="meta")
        ranked = search(model, args.world, x, global_batch=args.batch, device=args.device,
                        memory_budget=args.memory, top=args.top)
    except AutosplitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"autosplit search: {args.model} on {args.world} devices, global batch {args.batch}, device model "
          f"{args.device}, memory budget {args.memory or 'none'}")
    print(ranked.table())
    return 0
