"""Command line: ``autosplit plan MODEL --mesh PP,TP,DP --microbatch N --out DIR`` (or ``python -m autosplit``).

``--microbatch N`` (also ``--batch N``) is the rows of one microbatch.  Every ``autosplit.compile`` option
is a flag (autosplit/cli_options.py: ``--tp-mode``, ``--schedule``, ``--num-microbatches``,
``--memory-budget``, ``--autocast``, ``--recompute``, ``--dp-shard``, ...); ``autosplit plan --help``
lists them.  ``autosplit search MODEL --world N --global-batch B`` ranks configurations (cli_search.py).

``autosplit export CKPT_DIR model.pt`` turns a sharded checkpoint (``pm.save_checkpoint``)
into a plain state dict that ``model.load_state_dict`` of the unchanged model accepts.

``autosplit profile --out profile.json [--seconds S]`` measures this device (under torchrun: every rank's
devices and the network between them) into a profile file that ``--device profile.json`` and
``device="profile.json"`` read; ``autosplit profile --ranks N`` measures a local CPU world of N gloo
processes and caches it (autosplit/profiling/cli.py).

MODEL is a timm model name (``vit_base_patch16_224``) or ``package.module:factory`` (a callable that
returns an nn.Module).  The model is built on the meta device, so planning a 22B-parameter model
allocates no weights.  The plan's summary is printed and the readable dump written to DIR; the last
line printed is the path of DIR/report.html, the page to open in a browser.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import autosplit
from autosplit.cli_options import add_plan_options, plan_options
from autosplit.check.cli import add_check_parser, run_check
from autosplit.cli_search import add_search_parser, run_search
from autosplit.cost_model.profiles import get_profile
from autosplit.errors import AutosplitError
from autosplit.inputs import default_input_shape
from autosplit.model_spec import build_model
from autosplit.profiling.cli import add_profile_parser, run_profile
from autosplit.report.dump import dump_plan


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autosplit", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="compile a plan, print its stage table and dump it",
                          description="Plan MODEL offline (built on the meta device) and print plan.summary().")
    plan.add_argument("model", help="timm model name (e.g. vit_base_patch16_224) or package.module:factory")
    plan.add_argument("--mesh", default="2,1,1", help="PP,TP,DP: pipeline stages, tensor-parallel ranks, "
                                                       "data-parallel replicas (default %(default)s); or named "
                                                       "sizes with a context-parallel axis: pp=1,cp=2,tp=2,dp=1")
    # --batch: the contract's spelling, kept without a warning; --microbatch names the idea as search's
    # --global-batch names its own (rows per microbatch here, samples per optimizer step there)
    plan.add_argument("--microbatch", "--batch", dest="microbatch", type=int, default=8,
                      help="rows per microbatch, the example input's batch size (default %(default)s; --batch: "
                           "the same)")
    plan.add_argument("--image-size", type=int, default=None, help="input height/width (default: the model's)")
    plan.add_argument("--out", default=None, help="directory for the dump (default: print only)")
    add_plan_options(plan)
    add_search_parser(sub)
    export = sub.add_parser("export", help="write a sharded checkpoint's model as a plain state_dict file",
                            description="Turn a directory written by pm.save_checkpoint into a torch.save'd "
                                        "state dict of the unchanged model.")
    export.add_argument("checkpoint", help="the directory given to pm.save_checkpoint")
    export.add_argument("out", help="the file to write (torch.save of the state dict)")
    add_profile_parser(sub)
    add_check_parser(sub)
    return p


def _export(args) -> int:
    from autosplit.runtime.state.checkpoint_files import export_state_dict
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
        if args.command == "profile":
            return run_profile(args)
        if args.command == "check":
            return run_check(args)
        start = time.perf_counter()
        profile = get_profile(args.device)          # measured once for "cpu", then reused for the report
        model = build_model(args.model, args.image_size)
        x = torch.empty(args.microbatch, *default_input_shape(model, args.image_size), device="meta")
        plan = autosplit.compile(model, mesh=args.mesh, example_input=x, options=plan_options(args, device=profile))
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
