"""Command line: ``python -m autosplit plan MODEL --mesh PP,TP,DP --batch N --out DIR``.

``python -m autosplit export CKPT_DIR model.pt`` turns a sharded checkpoint (``pm.save_checkpoint``)
into a plain state dict that ``model.load_state_dict`` of the unchanged model accepts.

MODEL is a timm model name (``vit_base_patch16_224``) or ``package.module:factory`` (a callable that
returns an nn.Module).  The model is built on the meta device, so planning a 22B-parameter model
allocates no weights.  The plan's summary is printed and the readable dump written to DIR; the last
line printed is the path of DIR/report.html, the page to open in a browser.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import torch

import autosplit
from autosplit.cli_search import add_search_parser, run_search
from autosplit.compiler import LINEAR_2D_FORMS, TP_MODES
from autosplit.cost_model.profiles import NAMES, get_profile
from autosplit.schedule import SCHEDULES
from autosplit.dump import dump_plan
from autosplit.errors import AutosplitError
from autosplit.inputs import default_input_shape


def build_model(spec: str, img_size: int | None = None) -> torch.nn.Module:
    """A model on the meta device from a timm name or 'package.module:factory'."""
    with torch.device("meta"):
        if ":" in spec:
            module_name, _, factory = spec.partition(":")
            return getattr(importlib.import_module(module_name), factory)()
        import timm
        if spec not in timm.list_models():
            raise AutosplitError(f"unknown model {spec!r}: not a timm model name (see timm.list_models('vit*')) "
                                 f"and not of the form 'package.module:factory'")
        kwargs = {"img_size": img_size} if img_size else {}
        return timm.create_model(spec, pretrained=False, **kwargs)


_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m autosplit", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="compile a plan and dump it")
    plan.add_argument("model", help="timm model name or package.module:factory")
    plan.add_argument("--mesh", default="2,1,1", help="PP,TP,DP (default 2,1,1)")
    plan.add_argument("--batch", type=int, default=8, help="microbatch size (default 8)")
    plan.add_argument("--image-size", type=int, default=None, help="input height/width (default: the model's)")
    plan.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule (default 1f1b)")
    plan.add_argument("--chunks-per-rank", type=int, default=1,
                      help="model chunks per pipeline rank (>= 2 for the interleaved schedule; default 1)")
    plan.add_argument("--microbatches", type=int, default=None, help="microbatches per step (default 2 * pp)")
    plan.add_argument("--tp-mode", default="1d", choices=TP_MODES,
                      help="tensor-parallel layout: 1d (Megatron) or 2d (SUMMA/Optimus, tp = q*q; default 1d)")
    plan.add_argument("--tp-2d-form", default="auto", choices=("auto",) + LINEAR_2D_FORMS,
                      help="with --tp-mode 2d: how linears multiply their blocks (default: cost model's choice)")
    plan.add_argument("--sequence-parallel", action="store_true",
                      help="with --tp-mode 1d and tp > 1: also split the tokens between tensor-parallel regions")
    plan.add_argument("--device", default="h100", choices=NAMES,
                      help="cost-model profile (default h100; cpu is measured on this machine)")
    plan.add_argument("--autocast", choices=sorted(_AUTOCAST), default=None, help="plan for torch.autocast")
    plan.add_argument("--checkpoint", choices=["stage", "block"], default=None,
                      help="plan for activation recomputation per stage or per block")
    plan.add_argument("--memory-budget", default=None, help="bytes per stage, e.g. 8GiB")
    plan.add_argument("--out", default=None, help="directory for the dump (default: print only)")
    add_search_parser(sub)
    export = sub.add_parser("export", help="write a sharded checkpoint's model as a plain state_dict file")
    export.add_argument("checkpoint", help="the directory given to pm.save_checkpoint")
    export.add_argument("out", help="the file to write (torch.save of the state dict)")
    return p


def _export(args) -> int:
    from autosplit.runtime.checkpoint_files import export_state_dict
    state = export_state_dict(args.checkpoint, args.out)
    n = sum(t.numel() for t in state.values())
    print(f"wrote {len(state)} tensors ({n:,} elements) to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "export":
            return _export(args)
        if args.command == "search":
            return run_search(args, build_model)
        start = time.perf_counter()
        profile = get_profile(args.device)          # measured once for "cpu", then reused for the report
        model = build_model(args.model, args.image_size)
        x = torch.empty(args.batch, *default_input_shape(model, args.image_size), device="meta")
        plan = autosplit.compile(model, mesh=args.mesh, example_input=x, schedule=args.schedule,
                                 chunks_per_rank=args.chunks_per_rank, num_microbatches=args.microbatches,
                                 device=profile, autocast=_AUTOCAST.get(args.autocast),
                                 checkpoint=args.checkpoint, memory_budget=args.memory_budget,
                                 tp_mode=args.tp_mode, sequence_parallel=args.sequence_parallel,
                                 tp_2d_form=args.tp_2d_form)
        print(plan.summary())
        print(f"planned in {time.perf_counter() - start:.2f} s")
        if args.out:
            files = dump_plan(plan, args.out, profile=profile)   # report.html uses the same profile
            print(f"wrote {len(files)} files to {args.out}")
            print(f"report: {os.path.abspath(os.path.join(args.out, 'report.html'))}")
    except AutosplitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
