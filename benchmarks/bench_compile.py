"""Benchmark ``compile_stages=True`` (every stage module through torch.compile) against eager stages, on CPU.

Two gloo ranks (one thread each), two configurations taken from the other benchmarks, each built twice
from the same initial weights, eager and compiled, and all four timed side by side in one run:

  pp  -- bench_pipeline.py's autosplit 1f1b: timm VisionTransformer(img_size=32, patch_size=4,
         embed_dim=192, depth=12, num_heads=3, num_classes=10), batch 64 in 8 microbatches,
         ``autosplit.parallelize(model, mesh=(2, 1, 1), num_microbatches=8, schedule="1f1b")``.
  tp  -- bench_tp.py's autosplit tp=2: the same ViT with num_heads=6, batch 64,
         ``autosplit.parallelize(model, mesh=(1, 2, 1), num_microbatches=1, schedule="1f1b")``.
  *_compiled -- the same with ``compile_stages={"backend": "inductor"}`` (``--backend``, ``--mode``): each
         rank's stage modules go through ``torch.compile``, which traces and compiles them in the first step.

The model, batch, mesh and microbatch count are read from bench_pipeline.py and bench_tp.py, so the rows
stay theirs.  Inductor's on-disk caches start empty (``TORCHINDUCTOR_CACHE_DIR`` is a temporary folder,
``bench_compile_inductor``, emptied at the start, unless ``--warm-cache``), so the compile time is a first run's.

Timing: ``common.rotate`` (warm-up steps of each configuration, the compiled ones compiling in their first,
then one step of each per round, the order rotated every round, each step after a barrier); a step is the
slowest rank's forward + backward of all microbatches + ``opt.step()`` + ``opt.zero_grad()`` (SGD, fp32).
Compile time: the growth of ``pm.compile_seconds`` (torch's own timers: dynamo's trace, inductor's forward
compile and the backward compiled at its first run) over the configuration's warm-up, on the slowest rank;
``pm.compile_seconds`` is the module's own (the growth of the process's timers over its steps).  Also
per rank: dynamo's graph breaks (``compiled_stages.graph_breaks()``, expected 0) and graphs compiled.  The
eager and compiled losses of the warm-up steps (the first checks the forward, the next ones the gradients
and the update) must agree within 1e-4, or the script prints the section, writes nothing and exits 1.

Run from the repository root:  python benchmarks/bench_compile.py             (writes docs/benchmarks.md)
                               python benchmarks/bench_compile.py --steps 5   (quicker, print only)
"""
from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import bench_pipeline
import bench_tp
from common import finish, machine_lines, md_table, paired_ratio, rotate, slowest, spawn_ranks, step_stats, train_step

START, END = "<!-- bench_compile:start -->", "<!-- bench_compile:end -->"
REPO = Path(__file__).resolve().parent.parent
CACHE = Path(tempfile.gettempdir()) / "bench_compile_inductor"     # TORCHINDUCTOR_CACHE_DIR, emptied every run
WORLD, LR, LOSS_TOL = 2, 0.01, 1e-4
# setup: (ViT keyword arguments, batch, mesh, microbatches, where it comes from)
SETUPS = {
    "pp": (bench_pipeline.VIT, bench_pipeline.BATCH, (WORLD, 1, 1), bench_pipeline.MICROBATCHES,
           "bench_pipeline.py's autosplit 1f1b"),
    "tp": (bench_tp.VIT, bench_tp.BATCH, (1, WORLD, 1), 1, "bench_tp.py's autosplit tp=2"),
}
CONFIGS = ("pp_eager", "pp_compiled", "tp_eager", "tp_compiled")
LABELS = {"pp": "pp=2, 1f1b, {m} microbatches (mesh (2, 1, 1))", "tp": "tp=2, 1 microbatch (mesh (1, 2, 1))"}


def label(setup: str) -> str:
    return LABELS[setup].format(m=SETUPS[setup][3])


def settings(args) -> dict:
    """``compile_stages``' dict: torch.compile's keyword arguments."""
    return {"backend": args.backend, **({"mode": args.mode} if args.mode else {})}


# ------------------------------------------------------------------------------------- worker

def tracked(step, pm, calls: list):
    """``step`` with, per call, its wall time and what dynamo did meanwhile on this rank: compile seconds
    (torch's timers), graph breaks and graphs compiled, and ``pm.compile_seconds`` after it."""
    import torch._dynamo

    from autosplit.runtime.pipeline.compiled_stages import compile_seconds, graph_breaks

    def graphs():
        return torch._dynamo.utils.counters["stats"]["unique_graphs"]

    def run():
        c, b, g, t = compile_seconds(), graph_breaks(), graphs(), time.perf_counter()
        loss = step()
        calls.append({"wall": time.perf_counter() - t, "compile": compile_seconds() - c,
                      "breaks": graph_breaks() - b, "graphs": graphs() - g, "pm": pm.compile_seconds})
        return loss
    return run


def run_rank(rank: int, args) -> dict:
    import torch
    from timm.models import VisionTransformer

    import autosplit
    from autosplit.runtime.pipeline.compiled_stages import graph_breaks
    steps, pms, out = {}, [], {"rank": rank, "calls": {}}
    for setup, (vit, batch, mesh, microbatches, _) in SETUPS.items():
        torch.manual_seed(0)
        base = VisionTransformer(**vit)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(batch, 3, vit["img_size"], vit["img_size"], generator=gen)
        y = torch.randint(0, vit["num_classes"], (batch,), generator=gen)
        for compiled in (False, True):
            name = f"{setup}_{'compiled' if compiled else 'eager'}"
            pm = autosplit.parallelize(copy.deepcopy(base), mesh=mesh, loss_fn=torch.nn.CrossEntropyLoss(),
                                       num_microbatches=microbatches, schedule="1f1b",
                                       example_input=x[:batch // microbatches],
                                       compile_stages=settings(args) if compiled else False)
            step = train_step(lambda pm=pm, x=x, y=y: pm.step(x, y), torch.optim.SGD(pm.parameters(), lr=LR))
            steps[name] = tracked(step, pm, out["calls"].setdefault(name, []))
            pms.append(pm)
    configs = [c for c in CONFIGS if c in args.configs]
    if rank == 0:
        print(f"built; warm-up and {args.steps} timed rounds of {', '.join(configs)}", flush=True)

    def probe():        # seconds this rank waited in tp collectives (both the eager and the traceable ops count)
        from autosplit.runtime.parallel.tp_collectives import EXPOSED
        return {"input_grad": EXPOSED["input_grad"], "other": sum(EXPOSED.values()) - EXPOSED["input_grad"]}
    out.update(rotate(steps, configs, args.warmup, args.steps, probe=probe))
    out["graph_breaks"] = graph_breaks()
    out["break_reasons"] = sorted(torch._dynamo.utils.counters["graph_break"])
    for pm in pms:                  # every rank closes them in the same order
        pm.close()
    return out


# ------------------------------------------------------------------------------------- driver

def compile_time(per_rank: list[dict], name: str, warmup: int) -> list[float]:
    """Per rank: the compile seconds ``name``'s warm-up steps added (the growth of its pm.compile_seconds)."""
    return [sum(c["compile"] for c in r["calls"][name][:warmup]) for r in per_rank]


def checks(per_rank: list[dict]) -> list[tuple[str, str, str, bool]]:
    """(what, value, target, passed): eager and compiled warm-up losses, graph breaks."""
    first, rows = per_rank[0]["first"], []
    for setup in SETUPS:
        eager, compiled = first.get(f"{setup}_eager"), first.get(f"{setup}_compiled")
        if eager and compiled:
            for i, (a, b) in enumerate(zip(eager, compiled)):
                rows.append((f"{label(setup)}: loss of step {i + 1}, compiled - eager",
                             f"{abs(a - b):.1e} ({b:.6f} vs {a:.6f})", f"<= {LOSS_TOL:g}", abs(a - b) <= LOSS_TOL))
    breaks = [r["graph_breaks"] for r in per_rank]
    rows.append(("dynamo graph breaks, rank 0 / rank 1", " / ".join(map(str, breaks)), "0", not any(breaks)))
    return rows


def render(per_rank: list[dict], args, command: str, total_s: float) -> str:
    names = [c for c in CONFIGS if c in per_rank[0]["times"]]
    st = {n: step_stats(slowest(per_rank, "times", n)) for n in names}
    lines = [START, "## Compiled stages (compile_stages=True) vs eager (`benchmarks/bench_compile.py`)", "",
             *machine_lines(command, total_s, args.load, "timm"),
             *(f"- {setup}: {src}, timm `VisionTransformer({', '.join(f'{k}={v}' for k, v in vit.items())})`, fp32, "
               f"SGD lr={LR}, cross-entropy, batch {batch} in {m} microbatch{'es' if m > 1 else ''}; "
               f"`autosplit.parallelize(model, mesh={mesh}, num_microbatches={m}, schedule=\"1f1b\")`; "
               f"{WORLD} gloo ranks, 1 thread each."
               for setup, (vit, batch, mesh, m, src) in SETUPS.items()),
             f"- Compiled: the same with `compile_stages={settings(args)!r}`; each configuration is built from the "
             f"same initial weights, eager and compiled. Inductor's caches "
             + ("as they were (`--warm-cache`)." if args.warm_cache else
                "empty at the start (`TORCHINDUCTOR_CACHE_DIR` a folder emptied first): a first run's compile."),
             f"- Step = forward + backward of all microbatches + `opt.step()` + `opt.zero_grad()`, after a barrier; "
             f"time of the slowest rank. {args.warmup} warm-up steps per configuration (the compiled ones compile in "
             f"their first), then {args.steps} timed steps each, one of each per round (order rotated every round). "
             "*compiled / eager*: median of the per-round ratios. *Compile time*: what the configuration's warm-up "
             "added to `pm.compile_seconds` (torch's timers: dynamo's trace, inductor's forward compile, the backward "
             "compiled at its first run), slowest rank.", ""]
    rows = []
    for setup in SETUPS:
        e, c = f"{setup}_eager", f"{setup}_compiled"
        if e in st and c in st:
            ratio = paired_ratio(slowest(per_rank, "times", c), slowest(per_rank, "times", e))
            rows.append([label(setup), f"{st[e]['median'] * 1e3:.0f}", f"{st[c]['median'] * 1e3:.0f}",
                         f"{ratio:.3f}", f"{max(compile_time(per_rank, c, args.warmup)):.1f}"])
    lines += md_table(["config", "eager median ms", "compiled median ms", "compiled/eager", "compile time s"], rows)
    detail = []
    for n in names:
        setup, compiled = n.split("_")
        calls = [r["calls"][n] for r in per_rank]
        timed_compile = max(sum(x["compile"] for x in cs[args.warmup:]) for cs in calls)
        cpu = statistics.median(slowest(per_rank, "cpu", n))
        detail.append([f"{label(setup)}, {compiled}", f"{st[n]['p10'] * 1e3:.0f}", f"{st[n]['p90'] * 1e3:.0f}",
                       f"{cpu * 1e3:.0f}", st[n]["n"], f"{max(cs[0]['wall'] for cs in calls):.1f}",
                       " / ".join(f"{t:.1f}" for t in compile_time(per_rank, n, args.warmup)),
                       " / ".join(f"{cs[args.warmup - 1]['pm']:.1f}" for cs in calls),
                       " / ".join(str(sum(x["graphs"] for x in cs)) for cs in calls),
                       " / ".join(str(sum(x["breaks"] for x in cs)) for cs in calls),
                       f"{timed_compile:.1f}",
                       " / ".join(" + ".join(f"{statistics.median(e[k] for e in r['probe'][n]) * 1e3:.0f}"
                                             for k in ("input_grad", "other")) for r in per_rank)])
    lines += ["", "Per configuration (rank 0 / rank 1 where two values): step p10 / p90 (ms), median CPU time of the "
              "busiest rank per step (ms; less sensitive to other load, blind to waiting), the first step's wall "
              "time (slowest rank, s; the compile is inside it), compile seconds of the warm-up, `pm.compile_seconds` "
              "after the warm-up (the module's own: it must equal the warm-up's compile seconds), "
              "graphs dynamo compiled, graph breaks, compile seconds during the timed steps (0: no recompile), median "
              "exposed wait in tensor-parallel collectives per timed step (`tp_collectives.EXPOSED`, ms): the entries' "
              "input-gradient all-reduces (the ones the backward overlaps with the weight-gradient GEMMs) + all "
              "others.", "",
              *md_table(["configuration", "p10 ms", "p90 ms", "CPU ms", "steps", "first step s", "compile s",
                         "pm.compile_seconds", "graphs", "graph breaks", "compile s, timed steps", "tp wait ms, input grads + other"], detail)]
    reasons = sorted({b for r in per_rank for b in r["break_reasons"]})
    lines += ["", "Dynamo graph breaks per rank (`autosplit.runtime.pipeline.compiled_stages.graph_breaks()`, expected 0): "
              + ", ".join(f"rank {r['rank']}: {r['graph_breaks']}" for r in per_rank)
              + (f" (reasons: {'; '.join(reasons)})" if reasons else "") + ".", ""]
    lines += md_table(["check", "value", "target"],
                      [[what, value + (" (ok)" if ok else " (**FAILED**)"), target]
                       for what, value, target, ok in checks(per_rank)])
    return "\n".join(lines + ["", END]) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=15, help="timed steps per configuration (default 15)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per configuration (default 3)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--mode", default=None, help="torch.compile mode (default: torch's default)")
    p.add_argument("--warm-cache", action="store_true",
                   help="keep inductor's on-disk caches (default: TORCHINDUCTOR_CACHE_DIR an emptied folder, a cold compile)")
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for the ranks")
    p.add_argument("--out", default=None, help="markdown file to update (default docs/benchmarks.md when run with "
                                               "the default options, else print only)")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if set(args.configs) - set(CONFIGS):
        p.error(f"unknown configurations: {sorted(set(args.configs) - set(CONFIGS))}")
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (the compiled configurations compile in their first step)")
    os.environ.setdefault("AUTOSPLIT_TIMEOUT", "600")   # a rank waits while its peer compiles; the ranks inherit it
    if not args.warm_cache:     # emptied here, not after the run: inductor's compile workers outlive the ranks
        shutil.rmtree(CACHE, ignore_errors=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(CACHE)
    t0, load = time.perf_counter(), os.getloadavg()[0]
    per_rank = spawn_ranks(run_rank, WORLD, args, args.timeout)
    args.load = (load, os.getloadavg()[0])
    command = " ".join(["python benchmarks/bench_compile.py", *(argv if argv is not None else sys.argv[1:])])
    section = render(per_rank, args, command, time.perf_counter() - t0)
    failed = [c for c in checks(per_rank) if not c[3]]
    print("raw step times (s), slowest rank, in order:", {n: [round(t, 3) for t in slowest(per_rank, "times", n)]
                                                          for n in per_rank[0]["times"]})
    print("warm-up losses:", per_rank[0]["first"])
    if failed:
        print(section)
        print("FAILED, docs not written:\n" + "\n".join(f"  {what}: {value} (target {target})"
                                                        for what, value, target, _ in failed), file=sys.stderr)
        return 1
    finish(section, args, (args.steps, args.warmup, args.configs, settings(args), args.warm_cache)
           == (15, 3, list(CONFIGS), {"backend": "inductor"}, False), REPO, START, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
