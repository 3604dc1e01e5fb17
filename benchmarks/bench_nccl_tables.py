"""The collective model against published nccl-tests all-reduce rows: fit, then predicted vs published.

Terms:
  rows      -- ``../shared/reference/gpu-tables/nccl_busbw.csv``: in-place all_reduce bus bandwidth of 8 GPUs in
               one node (A100, H100, H200; Azure) and 16 GPUs in two nodes (H100 over RoCE at OCI and EFA at
               AWS, 400 Gb/s per GPU; A100 over EFA at AWS, 50 Gb/s per GPU).
  bus time  -- nccl-tests' convention: time = nbytes * 2 (n - 1) / n / busbw.
  predicted -- ``cost_model.comm.all_reduce_time(nbytes, n, profile, nodes)`` (the span model, comm.py).
  fit       -- per GPU, least squares on log(predicted / published) over 1 MiB - 8 GiB: from the one-node
               rows the intra-node link latency and all-reduce bus bandwidth (A100: no NVLink SHARP, so its
               ring link bandwidth), then from the two-node rows the network's per-GPU bandwidth and
               latency with the intra-node numbers held.  ``--check`` prints the built-in profiles
               (cost_model/device.py, which hold these fits) against every row instead of fitting.
  error     -- predicted time / published time - 1.

Run:  python benchmarks/bench_nccl_tables.py            (fit, then the built-ins against the rows)
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import re
import statistics
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from autosplit.cost_model.comm import all_reduce_time
from autosplit.cost_model.device import A100, H100, H200

TABLE = Path(__file__).resolve().parent.parent.parent / "shared" / "reference" / "gpu-tables" / "nccl_busbw.csv"
LOW, HIGH = 2 ** 20, 2 ** 33
BUILTIN = {"H100": H100, "H200": H200, "A100": A100}
STATED: dict = {}              # GPU -> the rows' stated network bytes/s per GPU (400 Gb/s -> 50e9)


def load() -> dict:
    """(gpu profile name, n, nodes, network) -> [(nbytes, published seconds), ...]."""
    groups: dict = {}
    for r in csv.DictReader(TABLE.open()):
        gpu = next(k for k in BUILTIN if r["gpu"].startswith(k))
        n, nodes = int(r["gpus"]), int(r["nodes"])
        net = "" if nodes == 1 else ("RoCE" if "RoCE" in r["interconnect"] else "EFA")
        stated = re.search(r"(\d+) Gb/s per GPU", r["interconnect"])
        STATED[gpu] = float(stated.group(1)) * 1e9 / 8 if stated else STATED.get(gpu, 0.0)
        b, busbw = int(r["message_bytes"]), float(r["busbw_GBps"]) * 1e9
        if busbw > 0:
            groups.setdefault((gpu, n, nodes, net), []).append((b, b * 2 * (n - 1) / n / busbw))
    return groups


def errors(profile, n, nodes, samples, low=LOW, high=HIGH) -> list[float]:
    return [all_reduce_time(b, n, profile, nodes) / t - 1 for b, t in samples if low <= b <= high]


def fit(groups) -> dict:
    """Per GPU the fitted profile (see *fit*)."""
    fitted = {}
    for gpu, base in BUILTIN.items():
        base = dataclasses.replace(base, gpus_per_node=8)
        one = [s for (g, n, k, _), v in groups.items() if g == gpu and k == 1 for s in v]
        if one:
            nvls = gpu != "A100"
            field = "allreduce_bandwidth" if nvls else "link_bandwidth"

            def res(th, field=field):
                p = dataclasses.replace(base, link_latency=math.exp(th[0]), **{field: math.exp(th[1])})
                return np.log1p(errors(p, 8, 1, one))
            th = least_squares(res, [math.log(2e-6), math.log(300e9)]).x
            base = dataclasses.replace(base, link_latency=math.exp(th[0]), **{field: math.exp(th[1])})
        two = [s for (g, n, k, _), v in groups.items() if g == gpu and k == 2 for s in v]
        if two:      # from the stated per-GPU rate; where the node's links are the bottleneck it stays there
            def res2(th):
                p = dataclasses.replace(base, network_latency=math.exp(th[0]), network_bandwidth=math.exp(th[1]))
                return np.log1p(errors(p, 16, 2, two))
            th = least_squares(res2, [math.log(20e-6), math.log(STATED[gpu])], x_scale=[1.0, 0.1]).x
            base = dataclasses.replace(base, network_latency=math.exp(th[0]), network_bandwidth=math.exp(th[1]))
        fitted[gpu] = base
    return fitted


def table(groups, profiles, title: str) -> list[str]:
    lines = [f"### {title}", "",
             "| GPU | GPUs x nodes | network | rows (1 MiB-8 GiB) | median abs error | worst | worst at |",
             "|---|---|---|---|---|---|---|"]
    for (gpu, n, nodes, net), samples in sorted(groups.items()):
        errs = errors(profiles[gpu], n, nodes, samples)
        if not errs:
            continue
        sizes = [b for b, _ in samples if LOW <= b <= HIGH]
        worst = max(range(len(errs)), key=lambda i: abs(errs[i]))
        lines.append(f"| {gpu} | {n // nodes} x {nodes} | {net or 'NVLink'} | {len(errs)} | "
                     f"{statistics.median(abs(e) for e in errs):.1%} | {errs[worst]:+.1%} | {sizes[worst] / 2**20:g} MiB |")
    return lines + [""]


def describe(p) -> str:
    return (f"{p.name}: link {p.link_bandwidth / 1e9:.0f} GB/s, all-reduce (NVLS) "
            f"{(p.allreduce_bandwidth or p.link_bandwidth) / 1e9:.0f} GB/s, link latency {p.link_latency * 1e6:.2f} us, "
            f"network {p.network_bandwidth / 1e9:.1f} GB/s per GPU, network latency {p.network_latency * 1e6:.1f} us")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only the built-in profiles against the rows")
    args = ap.parse_args(argv)
    groups = load()
    if not args.check:
        fitted = fit(groups)
        print("fitted:")
        for p in fitted.values():
            print("  " + describe(p))
        print("\n".join(table(groups, fitted, "Fitted profiles against the rows")))
    print("\n".join(table(groups, BUILTIN, "Built-in profiles (cost_model/device.py) against the rows")))
    for p in BUILTIN.values():
        print("  " + describe(p))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
