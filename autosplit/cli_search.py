"""``python -m autosplit search MODEL --world 64 --global-batch 512 --device h100 --memory-budget 80GiB [--top N]
[--autocast bf16|fp16] [--optimizer adamw|adam|sgd|sgd_momentum] [--max-tp N|node|none]``.

``--autocast`` ranks the configurations for training under ``torch.autocast`` in that dtype (every
candidate priced with the dtypes autocast gives); ``--optimizer`` names the optimizer whose step is priced;
``--max-tp`` caps the tensor-parallel degree (default: one node's GPUs; ``search``'s ``max_tp``).

Prints the strategy search's ranked table (mesh and options, predicted step time with its parts,
memory of the fullest rank) and how many configurations were rejected, by reason.  MODEL as for
``plan`` (a timm name or ``package.module:factory``, built on the meta device).

``--device measured`` plans with this machine's measured profile for ``--world`` ranks on it with
``OMP_NUM_THREADS`` threads each (default 1; the one ``python -m autosplit profile --ranks N --threads T``
cached); ``--fit`` then rescales it to the model
(cost_model/model_fit.py: runs the model's forward and backward at microbatch 2 and 8 here, on random
values, so it costs what those passes cost on this CPU).  ``--device profile.json`` plans with a profile
file (``python -m autosplit profile --out profile.json``).

``--batch`` and ``--memory`` are the deprecated spellings of ``--global-batch`` and ``--memory-budget`` (a
warning line names the new one; autosplit/deprecated.py).
"""
from __future__ import annotations

import os
import sys

import torch

from autosplit.cli_options import AUTOCAST as AUTOCAST_NAMES
from autosplit.cli_options import DeviceChoices, device_arg, max_tp_arg
from autosplit.cost_model.optimizer_step import NAMES as OPTIMIZERS
from autosplit.cost_model.profile_file import is_path
from autosplit.cost_model.profiles import NAMES, get_profile
from autosplit.deprecated import DeprecatedFlag
from autosplit.errors import AutosplitError
from autosplit.inputs import default_input_shape

MEASURED = "measured"


def _profile(args, model, x):
    """The profile ``--device`` (and ``--fit``) name, and how to say it in the header."""
    if is_path(args.device):                     # a profile file: what it says, named in the header
        profile = get_profile(args.device)
        if args.fit:
            from autosplit.cost_model import fit_to_model
            profile, _ = fit_to_model(profile, model, x)
        return profile, f"{profile.name} (from {args.device})"
    if args.device != MEASURED:
        if args.fit:
            raise AutosplitError(f"--fit rescales a measured profile; --device {args.device} is a datasheet one "
                                 f"(use --device measured)")
        return args.device, args.device
    from autosplit.cost_model import fit_to_model, profile_cache
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))   # what each rank runs with (torchrun's default: 1)
    torch.set_num_threads(threads)                            # the fit times the model as a rank runs it
    key = profile_cache.machine_key("cpu", args.world)
    profile = profile_cache.load(key)
    if profile is None:
        raise AutosplitError(f"no measured profile for {args.world} ranks x {key['threads']} threads on this machine "
                             f"in {profile_cache.cache_dir()}: run python -m autosplit profile --ranks {args.world} "
                             f"--threads {key['threads']}")
    if args.fit:
        profile, _ = fit_to_model(profile, model, x)
    return profile, profile.name


def add_search_parser(sub) -> None:
    p = sub.add_parser("search", help="rank every parallel configuration by predicted step time")
    p.add_argument("model", help="timm model name or package.module:factory")
    p.add_argument("--world", type=int, required=True, help="number of devices")
    p.add_argument("--global-batch", "--batch", dest="global_batch", type=int, required=True, action=DeprecatedFlag,
                   deprecated={"--batch": "--global-batch"},
                   help="samples per optimizer step over all replicas (--batch: deprecated)")
    p.add_argument("--device", default="h100", type=lambda text: device_arg(text, (MEASURED,)),
                   choices=DeviceChoices((*NAMES, MEASURED)), metavar="NAME|FILE.json",
                   help=f"cost-model profile: {', '.join(NAMES)}, a profile file (python -m autosplit profile "
                        f"--out FILE.json) or 'measured': this machine's cached measured profile (default h100)")
    p.add_argument("--fit", action="store_true", help="with --device measured or a file: fit the profile to the model "
                                                        "(runs it at microbatch 2 and 8 on this CPU)")
    p.add_argument("--memory-budget", "--memory", dest="memory_budget", default=None, action=DeprecatedFlag,
                   deprecated={"--memory": "--memory-budget"},
                   help="memory budget per device, e.g. 80GiB (default: none; --memory: deprecated)")
    p.add_argument("--top", type=int, default=10, help="configurations to show (default 10)")
    p.add_argument("--image-size", type=int, default=None, help="input height/width (default: the model's)")
    p.add_argument("--autocast", choices=sorted(AUTOCAST_NAMES), default=None,
                   help="rank for training under torch.autocast in bf16 or fp16 (default: off, float32)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="the optimizer whose step is priced (default adamw)")
    p.add_argument("--max-tp", type=max_tp_arg, default="node", metavar="N|node|none",
                   help="largest tensor-parallel degree tried: node (default: the device's GPUs per node), a "
                        "number, or none (every divisor of --world)")


def run_search(args, build_model) -> int:
    """``build_model(spec, image_size)``: __main__'s model builder (passed in: no import cycle)."""
    from autosplit.strategy import search
    try:
        model = build_model(args.model, args.image_size)
        # one row: the search and the fit read only the per-sample shape and dtype (the search takes the
        # fewest rows a microbatch may have, BatchNorm's, from the model's traced graph)
        x = torch.empty(1, *default_input_shape(model, args.image_size), device="meta")
        profile, described = _profile(args, model, x)
        ranked = search(model, args.world, x, global_batch=args.global_batch, device=profile,
                        memory_budget=args.memory_budget, top=args.top,
                        autocast=AUTOCAST_NAMES.get(args.autocast), optimizer=args.optimizer,
                        max_tp=args.max_tp)
    except AutosplitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"autosplit search: {args.model} on {args.world} devices, global batch {args.global_batch}, device "
          f"model {described}, memory budget {args.memory_budget or 'none'}, "
          f"{'autocast ' + args.autocast if args.autocast else 'float32'}, optimizer {args.optimizer}")
    print(ranked.table())
    return 0
