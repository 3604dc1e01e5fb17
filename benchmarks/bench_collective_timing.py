"""What one gloo all-reduce costs as a training step meets it, not back to back (issue 14's comm fits).

The profile's comm fits (autosplit/profiling/comm_bench.py) time each collective in a loop of calls back
to back.  Inside a step every collective follows compute, and on this CPU that changes its price.  Two
gloo ranks, one thread each, all-reduce one tensor (default: 400 KB, a microbatch-8 activation of the
width-192 ViT) after each of these, ``--calls`` times each, and report the median and mean seconds of
the call (launch to the end of its wait) per rank:

  back to back  -- nothing between calls (what the comm fits time);
  after compute -- ``--gemms`` small GEMMs on both ranks first (the same count on each, as tensor-
                   parallel ranks do the same work): the peer may arrive later than this rank;
  this rank only -- the GEMMs on rank 0 alone, rank 1 posts at once: rank 0's time has no peer lateness;
  after a sleep -- both ranks sleep ``--sleep-ms`` first, as a pipeline rank idles in a receive wait.

Prints a table; writes nothing.  Run from the repository root:
python benchmarks/bench_collective_timing.py [--kbytes 400] [--gemms 5 20] [--sleep-ms 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

from common import md_table, spawn_ranks


def _rank(rank: int, args: dict) -> dict:
    import torch
    import torch.distributed as dist
    x = torch.ones(args["kbytes"] * 1024 // 4)
    a, w = torch.randn(520, 192), torch.randn(192, 192)          # (tokens, C) @ (C, C)
    t0 = time.perf_counter()
    for _ in range(50):
        a @ w
    gemm_ms = (time.perf_counter() - t0) / 50 * 1e3
    cases = [("back to back", (), 0, 0.0)]
    for n in args["gemms"]:
        cases += [(f"after {n} GEMMs on both ranks", (0, 1), n, 0.0), (f"after {n} GEMMs on this rank only", (0,), n, 0.0)]
    cases.append((f"after {args['sleep_ms']:g} ms asleep on both ranks", (0, 1), 0, args["sleep_ms"] / 1e3))
    out = {"gemm_ms": gemm_ms, "rows": []}
    for label, who, gemms, sleep in cases:
        times = []
        for _ in range(args["calls"] + 10):                      # the first 10 are a warm-up
            if rank in who:
                for _ in range(gemms):
                    a @ w
                if sleep:
                    time.sleep(sleep)
            t0 = time.perf_counter()
            dist.all_reduce(x, async_op=True).wait()
            times.append(time.perf_counter() - t0)
        times = times[10:]
        out["rows"].append((label, statistics.median(times) * 1e3, statistics.mean(times) * 1e3))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kbytes", type=int, default=400)
    ap.add_argument("--gemms", type=int, nargs="+", default=[5, 20])
    ap.add_argument("--sleep-ms", type=float, default=2.0)
    ap.add_argument("--calls", type=int, default=70)
    args = ap.parse_args()
    per_rank = spawn_ranks(_rank, 2, vars(args), timeout=900)
    print(f"all-reduce of {args.kbytes} KB on 2 gloo ranks; one GEMM (520x192 @ 192x192) "
          f"{per_rank[0]['gemm_ms']:.2f} / {per_rank[1]['gemm_ms']:.2f} ms on rank 0 / 1\n")
    rows = [[label] + [f"{v:.3f}" for r in per_rank for v in r["rows"][k][1:]]
            for k, (label, *_) in enumerate(per_rank[0]["rows"])]
    print("\n".join(md_table(["before each call", "rank 0 median ms", "rank 0 mean", "rank 1 median", "rank 1 mean"],
                             rows)))

if __name__ == "__main__":
    main()
