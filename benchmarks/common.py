"""Helpers shared by the benchmark scripts in this folder.

The scripts run as ``python benchmarks/bench_x.py``, so this folder is on ``sys.path`` and they import
these with ``from common import ...``; the rank processes that ``launch`` spawns re-import the script
(as ``__mp_main__``) with the same ``sys.path``, so the import works there too.
"""
from __future__ import annotations

import platform
import re
import socket
import statistics
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
