"""``python -m autosplit profile --out profile.json [--seconds S]``: measure a profile file.

Under torchrun (``torchrun --nnodes 2 --nproc-per-node 8 -m autosplit profile --out profile.json``) every
rank measures together (job.py *in a job*: the device's kernels, the collectives of every group size and
node span, ``gpus_per_node``, the intra-node link, the network) and rank 0 prints and writes the file.  Run
alone it measures this one device (job.py *alone*).  The file is what ``device="profile.json"`` reads in
``autosplit.compile``, ``parallelize``, ``search`` and ``--device`` of ``autosplit plan`` / ``search``.
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
    p.add_argument("--out", required=True, help="the profile file to write, e.g. profile.json")
    p.add_argument("--seconds", type=float, default=DEFAULT_SECONDS,
                   help="seconds of timed repeats for the device's kernels (default %(default)s)")


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


def run_profile(args) -> int:
    """Measure, write ``args.out`` (rank 0) and print the summary and the path (rank 0)."""
    from autosplit.profiling.job import measure_profile
    if not args.seconds > 0:
        print(f"error: --seconds {args.seconds}: expected a positive number of seconds", file=sys.stderr)
        return 2
    try:
        profile = measure_profile(args.out, seconds=args.seconds)
    except AutosplitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print(describe(profile))
        print(f"wrote {os.path.abspath(args.out)}")
    return 0
