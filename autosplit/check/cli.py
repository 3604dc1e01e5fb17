"""``python -m autosplit check``: the command line of the three parts (see autosplit/check/__init__.py).

Flags:
  --parts numerics,profile,prediction  which parts to run (default all three, in that order)
  --quick            the quick configurations, 1 s of kernel timing, 3 timed steps (under 2 minutes on 8 GPUs)
  --out DIR          where ``check.json`` (every part's record), ``profile.json`` (the profile part's file)
                     and the prediction's Chrome traces go (default ``autosplit-check``)
  numerics:   --configs A,B (exactly these configurations), --steps, --tolerance
  profile:    --seconds (the kernels' timed seconds)
  prediction: --model NAME, --mesh PP,TP,DP, --batch B[,B...] (global batches), --image-size, --timed-steps,
              --max-ratio, and every plan option of ``autosplit plan`` (``--num-microbatches``,
              ``--schedule``, ``--autocast``, ``--device``, ...); ``--device`` unset: the profile part's
              file when that part ran, else parallelize's default.
Exit status: 0 when every part passed, 1 when one failed, 2 for bad flags.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

PARTS = ("numerics", "profile", "prediction")
DEFAULT_OUT = "autosplit-check"


def _parts(text: str) -> tuple[str, ...]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated choice of {', '.join(PARTS)}")
    return tuple(p for p in PARTS if p in names)          # always in the order the parts run


def _ints(text: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 16,32") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every batch must be a positive number of rows")
    return values


def add_check_parser(sub) -> None:
    """The ``check`` subcommand's parser (flags in the module docstring)."""
    from autosplit.cli_options import add_plan_options
    p = sub.add_parser("check", help="under torchrun: check numerics, measure the profile, time a plan against "
                                     "its prediction", description="Under torchrun (or alone, as one rank): train a tiny ViT in every "
                                     "configuration the world allows against plain PyTorch, measure this world's "
                                     "profile, and time a plan beside plan.predicted_step(); each part ends in a "
                                     "PASS or FAIL line, and DIR/check.json holds the records.")
    p.add_argument("--parts", type=_parts, default=PARTS, help="comma-separated parts to run (default: "
                                                              f"{','.join(PARTS)})")
    p.add_argument("--quick", action="store_true", help="fewer configurations, shorter timings (under 2 minutes "
                                                        "on 8 GPUs)")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for check.json, profile.json and the traces "
                                                      "(default %(default)s)")
    g = p.add_argument_group("numerics")
    g.add_argument("--configs", type=lambda t: [s.strip() for s in t.split(",") if s.strip()], default=None,
                   help="exactly these configurations (autosplit/check/configs.py), comma-separated")
    g.add_argument("--steps", type=int, default=3, help="SGD steps per configuration (default %(default)s)")
    g.add_argument("--tolerance", type=float, default=None,
                   help="max absolute loss and parameter difference (default 1e-5 on CPU, 1e-4 on CUDA)")
    g = p.add_argument_group("profile")
    g.add_argument("--seconds", type=float, default=None,
                   help="seconds of timed kernel repeats (default 5, 1 with --quick)")
    g = p.add_argument_group("prediction")
    g.add_argument("--model", default=None, help="timm model name or package.module:factory (default: the "
                                                 "check's tiny ViT)")
    g.add_argument("--mesh", default="1,1,-1", help="PP,TP,DP or pp=..,cp=..,tp=..,dp=..; dp may be -1 "
                                                         "(default %(default)s)")
    g.add_argument("--batch", "--global-batch", dest="batch", type=_ints, default=None,
                   help="global batch rows per step (all replicas), or several comma-separated: one case each "
                        "(default 8 rows a microbatch)")
    g.add_argument("--image-size", type=int, default=None, help="input height/width (default: the model's)")
    g.add_argument("--timed-steps", type=int, default=None, help="timed steps per case (default 5, 3 with --quick)")
    g.add_argument("--max-ratio", type=float, default=2.0,
                   help="pass when measured/predicted lies in [1/R, R] (default %(default)s)")
    add_plan_options(p)
    p.set_defaults(device=None)          # unset: the profile part's file, else parallelize's default


def _argument_error(args) -> str | None:
    """What is wrong with the flags, before any rank joins the world; None: nothing."""
    from autosplit.check.configs import BY_NAME
    from autosplit.errors import AutosplitError
    from autosplit.mesh import MeshShape
    unknown = [n for n in args.configs or [] if n not in BY_NAME]
    if unknown:
        return f"--configs: unknown {', '.join(unknown)}; the check knows {', '.join(BY_NAME)}"
    if args.steps < 1 or (args.timed_steps is not None and args.timed_steps < 1):
        return "--steps and --timed-steps take a positive number of steps"
    if args.seconds is not None and not args.seconds > 0:
        return f"--seconds {args.seconds}: expected a positive number of seconds"
    if not args.max_ratio >= 1:
        return f"--max-ratio {args.max_ratio}: expected a ratio >= 1"
    if "prediction" in args.parts:
        try:
            MeshShape.parse(args.mesh, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        except AutosplitError as exc:
            return f"--mesh {args.mesh}: {exc}"
    return None


def _run_part(cw, part: str, fn):
    """A part's record; an error that escapes the part is its FAIL record, and the next part still runs."""
    from autosplit.check.job import one_line, release_open_modules
    from autosplit.check.record import make_record
    try:
        return fn()
    except Exception as exc:
        release_open_modules()
        record = make_record(part, False, f"rank {cw.rank}: {one_line(exc)}")
        print(record["line"], file=sys.stderr, flush=True)
        return record


def run_check(args) -> int:
    """Run the parts ``args`` names on this rank (every rank of the job runs this)."""
    from autosplit.check.job import join_world
    from autosplit.check.numerics import run_numerics
    from autosplit.check.prediction import run_prediction
    from autosplit.check.profile_part import run_profile_part
    from autosplit.check.record import write_records
    from autosplit.cli_options import plan_options
    error = _argument_error(args)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    cw = join_world()
    cw.say(f"autosplit check: {cw.size} rank{'s' if cw.size > 1 else ''}, {cw.backend} on {cw.device_name}, torch "
           f"{cw.describe()['torch']}; parts: {', '.join(args.parts)}{' (quick)' if args.quick else ''}")
    records = []
    try:
        if "numerics" in args.parts:
            records.append(_run_part(cw, "numerics", lambda: run_numerics(
                cw, quick=args.quick, names=args.configs, steps=args.steps, tolerance=args.tolerance)))
        if "profile" in args.parts:
            records.append(_run_part(cw, "profile", lambda: run_profile_part(cw, args.out, args.quick, args.seconds)))
        if "prediction" in args.parts:
            profiled = next((r.get("path") for r in records if r["part"] == "profile" and r["passed"]), None)
            options = plan_options(args, device=args.device or profiled)
            steps = args.timed_steps or (3 if args.quick else 5)
            records.append(_run_part(cw, "prediction", lambda: run_prediction(
                cw, args.model, args.mesh, args.batch, options, args.image_size, steps=steps,
                warmup=1 if args.quick else 2, directory=args.out, max_ratio=args.max_ratio)))
    finally:
        passed = len(records) == len(args.parts) and all(r["passed"] for r in records)
        if cw.rank == 0:
            path = write_records(args.out, {**cw.describe(), "seconds": time.perf_counter() - start}, records)
            print(f"wrote {path.resolve()}")
            print(f"check: {'PASS' if passed else 'FAIL'} "
                  + ", ".join(f"{r['part']} {'PASS' if r['passed'] else 'FAIL'}" for r in records)
                  + f" ({time.perf_counter() - start:.1f} s)", flush=True)
        cw.close()
    return 0 if passed else 1
