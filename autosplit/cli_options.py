"""Command-line flags for every ``PlanOptions`` field, and the PlanOptions a parsed command line gives.

Terms: see options.py (the options).  Each flag's ``dest`` is the option's field name, so
``plan_options(args)`` reads them back by name and ``tests/test_compile.py`` checks that every field
has a flag.  A deprecated spelling of a flag (``--checkpoint``, ``--microbatches``) is an alias of the
new one that prints a warning line (autosplit/deprecated.py).  Flags take text; the converters below
turn it into the option's value:
  --autocast bf16|fp16          torch.bfloat16 / torch.float16
  --dp-shard off|stage|layer|auto   False / "stage" / "layer" / "auto" (the cost model chooses)
  --stage-bounds 3,7            [3, 7] (another plan's ``plan.bounds``)
  --leaf-modules A,B            ["A", "B"] (class names or package.module.ClassName)
  --concrete-args JSON          a JSON object, e.g. '{"attn_mask": null}'
  --device NAME|FILE.json       a profile name, or a profile file (python -m autosplit profile --out FILE.json)
  --max-tp N|node|none          the search's max_tp: N, "node" or None
"""
from __future__ import annotations

import argparse
import json

import torch

from autosplit.cost_model.profile_file import is_path
from autosplit.cost_model.profiles import NAMES
from autosplit.deprecated import DeprecatedFlag
from autosplit.options import CP_ATTENTION, TP_2D_FORMS, TP_MODES, PlanOptions
from autosplit.schedule import SCHEDULES

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
DP_SHARD = {"off": False, "stage": "stage", "layer": "layer", "auto": "auto"}


def _ints(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 3,7") from None


def _names(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object {{\"name\": value}}")
    return value


class DeviceChoices(tuple):
    """``--device``'s choices: the profile names (what ``--help`` and the flag's ``choices`` list), and
    ``in`` also admits a profile file's path."""

    def __contains__(self, value) -> bool:
        return (isinstance(value, str) and tuple.__contains__(self, value.lower())) or is_path(value)


def device_arg(text: str, extra: tuple = ()) -> str:
    """``--device``: a profile name (or one of ``extra``), or a profile file's path (ending in .json); the
    file itself is read, and its errors reported, by cost_model.get_profile."""
    if text.lower() in NAMES + extra or is_path(text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: expected a profile name ({', '.join(NAMES + extra)}) or a "
                                     f"profile file ending in .json (python -m autosplit profile --out FILE.json)")


def max_tp_arg(text: str):
    """``--max-tp``: "node", "none" (None) or a positive number, as ``autosplit.search``'s ``max_tp``."""
    if text in ("node", "none"):
        return None if text == "none" else text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive number, 'node' or 'none'")
    return int(text)


def add_plan_options(parser: argparse.ArgumentParser) -> None:
    """Add one flag per PlanOptions field (defaults: PlanOptions' own), each with help text."""
    d = PlanOptions()
    g = parser.add_argument_group("plan options (autosplit.options.PlanOptions)")
    g.add_argument("--tp-mode", dest="tp_mode", default=d.tp_mode, choices=TP_MODES,
                   help="tensor-parallel layout: 1d (Megatron) or 2d (SUMMA/Optimus, tp = q*q; default %(default)s)")
    g.add_argument("--schedule", dest="schedule", default=d.schedule, choices=SCHEDULES,
                   help="pipeline schedule (default %(default)s)")
    g.add_argument("--chunks-per-rank", dest="chunks_per_rank", type=int, default=d.chunks_per_rank,
                   help="model chunks per pipeline rank (>= 2 for interleaved, 2 for zb-v; default %(default)s)")
    g.add_argument("--num-microbatches", "--microbatches", dest="num_microbatches", type=int,
                   default=d.num_microbatches, action=DeprecatedFlag,
                   deprecated={"--microbatches": "--num-microbatches"},
                   help="microbatches per step (default 2 * pp; --microbatches: deprecated)")
    g.add_argument("--device", dest="device", default=d.device, type=device_arg, choices=DeviceChoices(NAMES),
                   metavar="NAME|FILE.json",
                   help=f"cost-model profile: {', '.join(NAMES)} or a profile file (default %(default)s; cpu is "
                        f"measured on this machine; a file: python -m autosplit profile --out FILE.json)")
    g.add_argument("--memory-budget", dest="memory_budget", default=d.memory_budget,
                   help="bytes per stage the cut must respect, e.g. 8GiB, 512MiB, 1.5GB (default: no limit)")
    g.add_argument("--leaf-modules", dest="leaf_modules", type=_names, default=d.leaf_modules,
                   help="comma-separated module classes not to trace into: class names found in the model, "
                        "or package.module.ClassName")
    g.add_argument("--concrete-args", dest="concrete_args", type=_json_object, default=d.concrete_args,
                   help="JSON object of values for forward parameters after the input, e.g. '{\"attn_mask\": null}'")
    g.add_argument("--stage-bounds", dest="stage_bounds", type=_ints, default=d.stage_bounds,
                   help="reuse a cut: the last segment of each stage, comma-separated (another plan's plan.bounds)")
    g.add_argument("--sequence-parallel", dest="sequence_parallel", action="store_true",
                   help="with --tp-mode 1d and tp > 1: also split the tokens between tensor-parallel regions")
    g.add_argument("--autocast", dest="autocast", choices=sorted(AUTOCAST), default=None,
                   help="plan for torch.autocast in bf16 or fp16 (default: off, float32)")
    g.add_argument("--recompute", "--checkpoint", dest="recompute", choices=["stage", "block"], default=d.recompute,
                   action=DeprecatedFlag, deprecated={"--checkpoint": "--recompute"},
                   help="plan for activation recomputation per stage or per block (default: off; --checkpoint: "
                        "deprecated)")
    g.add_argument("--tp-2d-form", dest="tp_2d_form", default=d.tp_2d_form, choices=TP_2D_FORMS,
                   help="with --tp-mode 2d: how linears multiply their blocks (default: the cost model's choice)")
    g.add_argument("--tp-depth", dest="tp_depth", type=int, default=d.tp_depth,
                   help="with --tp-mode 2.5d: d in tp = q * q * d (the grid's layers)")
    g.add_argument("--tp-overlap-chunks", dest="tp_overlap_chunks", type=int, default=d.tp_overlap_chunks,
                   help="with tp > 1: row chunks per run of row-wise ops around a forward all-reduce, so that "
                        "one chunk's all-reduce overlaps another's compute (default %(default)s: off)")
    g.add_argument("--cp-attention", dest="cp_attention", default=d.cp_attention, choices=CP_ATTENTION,
                   help="with a cp mesh axis: how attention gets the tokens it needs (keys and values all-gathered, "
                        "or an all-to-all to heads: Ulysses; default: the cost model's choice per attention)")
    g.add_argument("--dp-shard", dest="dp_shard", choices=sorted(DP_SHARD), default="off",
                   help="shard parameters, gradients and optimizer state over dp with FSDP2: per stage, per "
                        "layer, or auto (stage where it fits --memory-budget, else layer; default off)")


def plan_options(args: argparse.Namespace, **overrides) -> PlanOptions:
    """The PlanOptions of a command line parsed with ``add_plan_options``.

    Args:
        args: the parsed arguments.
        overrides: fields to set instead (e.g. ``device=`` a profile measured once).
    """
    values = {name: getattr(args, name) for name in PlanOptions.names()}
    values["autocast"] = AUTOCAST.get(args.autocast)
    values["dp_shard"] = DP_SHARD[args.dp_shard]
    values["leaf_modules"] = tuple(values["leaf_modules"])
    values.update(overrides)
    return PlanOptions(**values)
