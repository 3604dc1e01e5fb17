"""``python -m autosplit profile --out profile.json [--seconds S]`` / ``--ranks N [--threads T]``: measure a profile.

Under torchrun (``torchrun --nnodes 2 --nproc-per-node 8 -m autosplit profile --out profile.json``) every
rank measures together (job.py *in a job*: the device's kernels, the collectives of every group size and
node span, ``gpus_per_node``, the intra-node link, the network) and rank 0 prints and writes the file.  Run
alone it measures this one device (job.py *alone*).  The file is what ``device="profile.json"`` reads in
``autosplit.compile``, ``parallelize``, ``search`` and ``--device`` of ``autosplit plan`` / ``search``.

With ``--ranks N`` (no torchrun) it starts a local world of N gloo processes on this CPU
(measure_profile.py *spawn*, with ``--threads`` torch threads each) and caches the profile for that
layout, which ``parallelize`` without ``device=`` and ``search --device measured`` read; ``--out``
then also writes it as a file.  This replaces ``python -m autosplit.profiling.measure_profile --ranks N``
(kept for one release, with a warning).
"""
from __future__ import annotations

import os
import sys

from autosplit.errors import AutosplitError

DEFAULT_SECONDS = 5.0


def add_profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure this device (and, under torchrun, the network) into a profile file",
                       description="Measure this device's kernels (under torchrun also every rank's collectives "
                                   "and the network) and write the profile file that --device FILE.json and "
                                   "device='FILE.json' read.")
    p.add_argument("--out", default=None, help="the profile file to write, e.g. profile.json (needed "
                                                "without --ranks)")
    p.add_argument("--seconds", type=float, default=DEFAULT_SECONDS,
                   help="seconds of timed repeats for the device's kernels (default %(default)s; not with --ranks)")
    p.add_argument("--ranks", type=int, default=None,
                   help="no torchrun: start this many gloo processes on this CPU, measure them and cache the "
                        "profile for that layout (what parallelize without device= and search --device measured "
                        "read)")
    p.add_argument("--threads", type=int, default=1, help="with --ranks: torch threads per process (default 1)")


def _gbs(x: float) -> str:
    return f"{x / 1e9:.4g} GB/s"


def describe(profile) -> str:
    """The fitted numbers of a measured profile, a few lines."""
    peaks = ", ".join(f"{str(k).removeprefix('torch.')} {v / 1e12:.4g}" for k, v in profile.peak_flops.items())
    lines = [profile.name,
             f"  peak TFLOP/s: {peaks}; memory {_gbs(profile.mem_bandwidth)}",
             f"  GEMM efficiency {profile.gemm_efficiency:.3f}, half-rate dimension {profile.gemm_half_dim:.0f}; "
             f"attention {profile.attention_efficiency:.3f} of a GEMM; memory-bound kernels "
             f"{profile.bandwidth_efficiency:.3f} of the bandwidth; {profile.op_overhead * 1e6:.2f} us per kernel",
             f"  gpus_per_node {profile.gpus_per_node}; link {_gbs(profile.link_bandwidth)}, "
             f"{profile.link_latency * 1e6:.1f} us"
             + (f"; all-reduce {_gbs(profile.allreduce_bandwidth)}" if profile.allreduce_bandwidth else "")
             + (f"; network {_gbs(profile.network_bandwidth)}, {profile.network_latency * 1e6:.1f} us"
                if profile.network_bandwidth else "")]
    if profile.comm:
        lines.append(f"  collectives measured: {', '.join(sorted(profile.comm))}")
    return "\n".join(lines)


def _argument_error(args) -> str | None:
    """What is wrong with the flags, before anything is measured; None: nothing."""
    if args.ranks is None:
        if args.out is None:
            return "--out FILE.json is needed (or --ranks N: measure a local CPU world and cache it)"
        if not args.seconds > 0:
            return f"--seconds {args.seconds}: expected a positive number of seconds"
        return None
    if args.ranks < 1:
        return f"--ranks {args.ranks}: expected a positive number of processes"
    if args.threads < 1:
        return f"--threads {args.threads}: expected a positive number of threads per process"
    if args.seconds != DEFAULT_SECONDS:
        return "--seconds applies to the measurement under torchrun or alone, not to --ranks"
    return None


def run_profile(args) -> int:
    """Measure, write ``args.out`` (rank 0) and print the summary and the path (rank 0); with ``--ranks``
    the local world's measurement (measure_profile.py ``run_local``)."""
    error = _argument_error(args)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.ranks is not None:
        from autosplit.profiling.measure_profile import run_local
        return run_local(args.ranks, args.threads, args.out)
    from autosplit.profiling.job import measure_profile
    try:
        profile = measure_profile(args.out, seconds=args.seconds)
    except AutosplitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print(describe(profile))
        print(f"wrote {os.path.abspath(args.out)}")
    return 0
