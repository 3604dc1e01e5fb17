"""Helpers shared by the benchmark scripts in this folder: spawning ranks, timing, phases, tables.

The scripts run as ``python benchmarks/bench_x.py``, so this folder is on ``sys.path`` and they import
these with ``from common import ...``; the rank processes that ``launch`` spawns re-import the script
(as ``__mp_main__``) with the same ``sys.path``, so the import works there too.

Terms:
  rotation   -- every configuration is timed in the same run: warm-up steps of each, then rounds of
                ``block`` steps of each, the order rotated every round, each step after a barrier, so
                load from other processes hits all of them alike (``rotate``).
  slowest    -- a distributed step takes as long as its slowest rank: per step, the max over ranks.
  phase      -- where a step's time goes, read from torch.profiler ``record_function`` ranges: the
                executor's ``autosplit::<action>`` (``1F3``, ``0I2``, ``0W2``), ``autosplit::[...]``
                (a transfer group posted, or the step's last sends waited) and ``autosplit::wait ...``
                (a receive waited inside a compute), torch pipelining's ``PP:<action>``, and the
                benchmarks' own ``bench::optimizer``.  Times are exclusive: a range nested in another
                counts in its own category, not its parent's (``profiled_steps``, ``phase_totals``).
"""
from __future__ import annotations

import argparse
import functools
import os
import platform
import re
import socket
import statistics
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker, world: int, args, timeout: float) -> list[dict]:
    """Spawn ``world`` processes running ``worker(rank, port, args, results)`` and return their results
    in rank order; wait at most ``timeout`` seconds for each result; raise if any rank reported an error."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(r, port, args, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < world:
            rank, res = results.get(timeout=timeout)
            got[rank] = res
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = {r: v["error"] for r, v in got.items() if "error" in v}
    if errors:
        raise RuntimeError("\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items())))
    return [got[r] for r in range(world)]


def spawn_ranks(run_rank, world: int, args, timeout: float) -> list[dict]:
    """``launch`` of ``run_rank(rank, args) -> dict`` on ``world`` gloo ranks, one thread each; a rank's
    exception comes back as its ``error`` (and ``launch`` raises it)."""
    return launch(functools.partial(_rank_main, run_rank, world), world, args, timeout)


def _rank_main(run_rank, world: int, rank: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
        out = run_rank(rank, args)
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, out))
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent
        import traceback
        results.put((rank, {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}))


def rotate(steps: dict, configs: list[str], warmup: int, n: int, block: int = 1, probe=None) -> dict:
    """Time ``n`` steps of each configuration (see *rotation*); ``steps[name]()`` runs one step and
    returns its loss.  ``probe()``, if given, returns a dict of counters read before and after each
    timed step.  Returns {"first": {name: warm-up losses}, "times": {name: [s]}, "cpu": {name: [s]},
    "probe": {name: [{counter: after - before}]}}."""
    import torch.distributed as dist
    out: dict = {"first": {}, "times": {}, "cpu": {}, "probe": {}}

    def timed(name, record=True):
        dist.barrier()
        before = probe() if probe else {}
        c, t = time.process_time(), time.perf_counter()
        loss = steps[name]()
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        if record:
            out["times"].setdefault(name, []).append(wall)
            out["cpu"].setdefault(name, []).append(cpu)
            if probe:
                after = probe()
                out["probe"].setdefault(name, []).append({k: after[k] - before.get(k, 0.0) for k in after})
        return loss

    for name in configs:
        out["first"][name] = [timed(name, record=False) for _ in range(warmup)]
    for r in range(-(-n // block)):
        k = r % len(configs)
        for name in configs[k:] + configs[:k]:
            for _ in range(min(block, n - r * block)):
                timed(name)
    return out


def train_step(forward_backward, opt):
    """A step: ``forward_backward()`` (returns the loss), then ``opt.step()`` and ``opt.zero_grad()`` inside a
    ``bench::optimizer`` profiler range; returns the loss."""
    from torch.profiler import record_function

    def step():
        loss = forward_backward()
        with record_function("bench::optimizer"):
            opt.step()
            opt.zero_grad()
        return loss
    return step


def slowest(per_rank: list[dict], key: str, name: str, rank0_only: bool = False) -> list[float]:
    """Per step, the slowest rank's ``per_rank[r][key][name]`` (rank 0's alone for single-rank runs)."""
    if rank0_only:
        return list(per_rank[0][key][name])
    return [max(ts) for ts in zip(*(r[key][name] for r in per_rank))]


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median of the per-round ratios a[k] / b[k] (both timed in the same round)."""
    return statistics.median(x / y for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------- phases

_ACTION = re.compile(r"^(?:autosplit::|PP:)(\d+)([FBIW])(\d+)$")
_RANGE_PREFIXES = ("autosplit::", "PP:", "bench::")


def profiled_steps(step, n: int) -> list[dict]:
    """Run ``n`` steps, each after a barrier, each under its own ``torch.profiler.profile``; per step
    {"total": s, "ranges": [(name, start s, end s)]} of the *phase* ranges (the profiler's own cost
    is inside the steps: compare phases, not these totals, with the timed steps)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    steps = []
    for _ in range(n):
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            step()
            total = time.perf_counter() - t
        ranges = sorted((e.name, e.time_range.start / 1e6, e.time_range.end / 1e6) for e in prof.events()
                        if e.name.startswith(_RANGE_PREFIXES))
        steps.append({"total": total, "ranges": sorted(ranges, key=lambda r: (r[1], -r[2]))})
    return steps


def exclusive(ranges: list[tuple]) -> list[tuple[str, float]]:
    """(name, exclusive seconds) of each range: its length minus the ranges nested directly in it."""
    out, stack = [], []            # stack: [name, end, length, nested]
    for name, start, end in ranges + [("", float("inf"), float("inf"))]:
        while stack and stack[-1][1] <= start:
            top = stack.pop()
            out.append((top[0], top[2] - top[3]))
            if stack:
                stack[-1][3] += top[2]
        stack.append([name, end, end - start, 0.0])
    return out


def category(name: str) -> str:
    """The phase of a range: F / B / I / W (a compute), wait, transfers, optimizer."""
    m = _ACTION.match(name)
    if m:
        return m.group(2)
    if name.startswith("autosplit::wait"):
        return "wait"
    if name.startswith("bench::"):
        return name.split("::", 1)[1]
    return "transfers"          # autosplit::[group], PP:<stage>SEND_F<mb> / RECV_*, ...


def phase_totals(step_ranges: dict) -> dict[str, float]:
    """Seconds per category of one profiled step, plus *other*: the step minus all ranges."""
    totals: dict[str, float] = {}
    for name, secs in exclusive(step_ranges["ranges"]):
        totals[category(name)] = totals.get(category(name), 0.0) + secs
    totals["other"] = step_ranges["total"] - sum(totals.values())
    return totals


def action_times(steps: list[dict]) -> dict[tuple[int, str], float]:
    """Median exclusive seconds of one action per (stage, kind) over the profiled steps."""
    got: dict[tuple[int, str], list[float]] = {}
    for st in steps:
        for name, secs in exclusive(st["ranges"]):
            m = _ACTION.match(name)
            if m:
                got.setdefault((int(m.group(1)), m.group(2)), []).append(secs)
    return {k: statistics.median(v) for k, v in sorted(got.items())}


# ---------------------------------------------------------------------------------------- tables

def md_table(header: list[str], rows: list[list]) -> list[str]:
    """A markdown table: the first column left-aligned, the others right-aligned."""
    return ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1),
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


def machine_lines(command: str, total_s: float, load: tuple[float, float], *packages: str) -> list[str]:
    """The date / machine / reproduce / load bullet lines every section starts with."""
    import datetime
    import importlib

    import torch
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    versions = "".join(f", {p} {importlib.import_module(p).__version__}" for p in packages)
    return [f"- Date: {now}",
            f"- Machine: {os.cpu_count()} CPUs ({cpu_name()}), Python {platform.python_version()}, "
            f"torch {torch.__version__}{versions}",
            f"- Reproduce (repository root): `{command}` ({total_s:.0f} s here); 1-minute load average "
            f"{load[0]:.2f} just before, {load[1]:.2f} just after (about 2 of it is this benchmark's own "
            f"ranks; more means other processes shared the CPUs, which shows as p90 outliers)"]


def finish(section: str, args, defaults: bool, repo: Path, start: str, end: str) -> None:
    """Print the section and write it into ``args.out`` (or docs/benchmarks.md when run with defaults)."""
    print(section)
    out = args.out or ("docs/benchmarks.md" if defaults else None)
    if out:
        write_section(repo / out, section, start, end)
        print(f"wrote {out}")


def step_stats(xs: list[float]) -> dict:
    """Median, 10th and 90th percentile (inclusive method) and count of ``xs``."""
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) > 1 else [xs[0]] * 9
    return {"median": statistics.median(xs), "p10": q[0], "p90": q[-1], "n": len(xs)}


def profile_steps(step, n: int, *reports: tuple[str, int]) -> str:
    """cProfile ``n`` calls of ``step()``, each after a ``dist.barrier()`` (not profiled); returns the
    pstats report for each ``(sort key, lines)`` in ``reports``, one after the other."""
    import cProfile
    import io
    import pstats
    import torch.distributed as dist
    prof = cProfile.Profile()
    for _ in range(n):
        dist.barrier()
        prof.enable()
        step()
        prof.disable()
    buf = io.StringIO()
    for key, lines in reports:
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(lines)
    return buf.getvalue()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_section(path: Path, section: str, start: str, end: str) -> None:
    """Replace the section of ``path`` between the markers ``start`` and ``end`` with ``section`` (or
    append it); every other byte stays as it was.  The file is re-read right before writing because
    other benchmark scripts write their own sections."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end) + r"\n?", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def step_args() -> argparse.Namespace:
    """--steps, --warmup and --no-write, the flags of the benchmarks that time steps and write a section."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    return ap.parse_args()


def mode_rows(per_rank: list[dict], modes: tuple[str, ...]) -> list[str]:
    """Markdown rows of the slowest rank's step times per ``tp_mode`` (ms), relative to the first."""
    stats = {m: step_stats(slowest(per_rank, "times", m)) for m in modes}
    base = stats[modes[0]]["median"]
    return [f"| tp_mode=\"{m}\" | {s['median'] * 1e3:.0f} | {s['p10'] * 1e3:.0f} | {s['p90'] * 1e3:.0f} | "
            f"{s['median'] / base:.3f} |" for m, s in stats.items()]


def tp_mode_steps(model_fn, mesh, modes: tuple[str, ...], args, batch: int, lr: float) -> dict:
    """One rank's interleaved step times of ``model_fn()`` parallelized with each ``tp_mode`` (SGD, one
    microbatch of ``batch`` 32 px images, the same seeds for every mode)."""
    import torch

    import autosplit
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)
    steps = {}
    for mode in modes:
        torch.manual_seed(0)
        pm = autosplit.parallelize(model_fn(), mesh=mesh, num_microbatches=1, tp_mode=mode, example_input=x)
        steps[mode] = train_step(lambda pm=pm: pm.step(x, y), torch.optim.SGD(pm.parameters(), lr=lr))
    return rotate(steps, list(steps), args.warmup, args.steps)
