"""Benchmark the planner: stage balance against torchtitan's cut, and planning cost of huge models.

  a. balance   -- timm vit_base_patch16_224, microbatch 8 at 224 px, pp = 2, 3, 4, 5, 6, 8, cost model h100:
                  max/mean predicted stage time of autosplit's cut and of torchtitan's cut (embedding
                  and head each count as a layer; n/a where that rule has no cut), and the ratio of their
                  bottleneck stage times (torchtitan / autosplit = predicted pipeline speed-up, since a
                  pipeline's steady-state step time is proportional to its slowest stage).
  b. planning  -- ViT-H/14 at pp = 8 and a ViT-22B-like model at pp = 16, built on the meta device: wall
                  time of ``autosplit.compile`` and peak RSS, each case in a fresh Python process, and a
                  check that no parameter or buffer left the meta device.
  c. report    -- a markdown section between ``<!-- bench_plan:start -->`` and ``<!-- bench_plan:end -->``
                  of the output file; the rest of the file is left as it is.

Run from the repository root:  python benchmarks/bench_plan.py            (writes docs/benchmarks.md)
                               python benchmarks/bench_plan.py --quick    (smaller sweep, print only)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from common import cpu_name, write_section

START = "<!-- bench_plan:start -->"
END = "<!-- bench_plan:end -->"
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = "docs/benchmarks.md"

BALANCE_MODEL = "vit_base_patch16_224"
BALANCE_PPS = (2, 3, 4, 5, 6, 8)
QUICK_PPS = (2, 4, 5)
LAYER_DETAIL_PPS = (4, 5)
MICROBATCH = 8
IMAGE = 224
DEVICE_MODEL = "h100"

# name -> (description, pp); the child process builds the model from the name
PLANNING_CASES = {
    "vit_huge_patch14_224": ("timm vit_huge_patch14_224 (ViT-H/14)", 8),
    "vit_22b_like": ("VisionTransformer(patch 14, dim 6144, depth 48, heads 48, mlp 4) (ViT-22B-like)", 16),
}


# ----------------------------------------------------------------------------------------- helpers

def _example(batch: int = MICROBATCH):
    import torch
    return torch.empty(batch, 3, IMAGE, IMAGE, device="meta")


def _build(name: str):
    import timm
    import torch
    with torch.device("meta"):
        if name == "vit_22b_like":
            return timm.models.VisionTransformer(img_size=224, patch_size=14, embed_dim=6144, depth=48,
                                                 num_heads=48, mlp_ratio=4, num_classes=1000)
        return timm.create_model(name, pretrained=False)


def _rss_now_kib() -> int:
    """Current resident set size (VmRSS) in KiB; 0 where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _peak_rss_kib() -> int:
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak   # bytes on macOS, KiB on Linux


def _num(x, digits: int = 3) -> str:
    """A figure, or "n/a" where the baseline has no cut."""
    return "n/a" if x is None else f"{x:.{digits}f}"


# ------------------------------------------------------------------------------------ a. balance

def run_balance(pps) -> dict:
    import autosplit
    model = _build(BALANCE_MODEL)
    n_blocks = len(model.blocks)       # for the stage tables' caption
    rows, details = [], {}
    for pp in pps:
        t0 = time.perf_counter()
        plan = autosplit.compile(model, mesh=(pp, 1, 1), example_input=_example(), schedule="1f1b",
                                 chunks_per_rank=1, num_microbatches=None, device=DEVICE_MODEL)
        seconds = time.perf_counter() - t0
        ours_ratio, equal_ratio = plan.balance()       # the baseline: torchtitan's cut, or None
        ours = [s.time for s in plan.stages]
        equal = list(plan.equal_layer_times or [])
        row = {"pp": pp, "ours_balance": ours_ratio, "equal_balance": equal_ratio,
               "ours_max_ms": max(ours) * 1e3, "equal_max_ms": max(equal) * 1e3 if equal else None,
               "speedup": max(equal) / max(ours) if equal else None, "plan_s": seconds}
        rows.append(row)
        versus = (f"torchtitan's cut {equal_ratio:.3f}; bottleneck {row['ours_max_ms']:.3f} vs "
                  f"{row['equal_max_ms']:.3f} ms -> x{row['speedup']:.3f}" if equal else "torchtitan's cut n/a")
        print(f"pp={pp}: max/mean autosplit {ours_ratio:.3f}, {versus} (planned in {seconds:.2f} s)", flush=True)
        if pp in LAYER_DETAIL_PPS and equal:
            details[pp] = [{"stage": s.index, "layers": s.layers, "params": s.n_params, "ms": s.time * 1e3,
                            "memory": s.memory_bytes, "torchtitan_ms": equal[s.index] * 1e3} for s in plan.stages]
            for d in details[pp]:
                print(f"   stage {d['stage']}: {d['layers']}  ({d['ms']:.3f} ms; torchtitan's cut: "
                      f"{d['torchtitan_ms']:.3f} ms)")
    return {"rows": rows, "details": details, "n_blocks": n_blocks}


# ------------------------------------------------------------------------- b. planning cost (child)

def child(name: str, profile: bool) -> dict:
    """Run in a fresh interpreter: build on meta, compile, report time, RSS and where things live."""
    import torch

    import autosplit
    t_import = time.perf_counter()
    model = _build(name)
    build_s = time.perf_counter() - t_import
    n_params = sum(p.numel() for p in model.parameters())
    rss_before, peak_before = _rss_now_kib(), _peak_rss_kib()
    pp = PLANNING_CASES[name][1]
    kwargs = dict(mesh=(pp, 1, 1), example_input=_example(), schedule="1f1b", chunks_per_rank=1,
                  num_microbatches=None, device=DEVICE_MODEL)
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    plan = autosplit.compile(model, **kwargs)
    compile_s = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
    peak_after, rss_after = _peak_rss_kib(), _rss_now_kib()

    tensors = list(model.parameters()) + list(model.buffers())
    for gm in plan.modules:
        tensors += list(gm.parameters()) + list(gm.buffers())
    not_meta = sum(1 for t in tensors if t.device.type != "meta")
    ours, equal = plan.balance()
    result = {
        "name": name, "pp": pp, "n_params": n_params, "build_s": build_s, "compile_s": compile_s,
        "rss_before_mib": rss_before / 1024, "peak_before_mib": peak_before / 1024,
        "rss_after_mib": rss_after / 1024, "peak_after_mib": peak_after / 1024,
        "tensors_checked": len(tensors), "not_meta": not_meta,
        "stage_params": sum(s.n_params for s in plan.stages), "n_stages": plan.n_stages,
        "n_nodes": len(plan.graph.graph.nodes), "ours_balance": ours, "equal_balance": equal,
        "max_stage_memory_gib": max(s.memory_bytes for s in plan.stages) / 2**30,
        "layers": [s.layers for s in plan.stages], "torch": torch.__version__,
    }
    if prof is not None:
        import io
        import pstats
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(10)
        result["profile"] = buf.getvalue()
    return result


def run_planning(names, profile: bool) -> list[dict]:
    results = []
    for name in names:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name] + (["--profile"] if profile else [])
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        total = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"planning case {name} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        res["process_s"] = total
        results.append(res)
        print(f"{name} pp={res['pp']}: {res['n_params'] / 1e9:.2f} B params, compile {res['compile_s']:.2f} s, "
              f"RSS before {res['rss_before_mib']:.0f} MiB, peak after {res['peak_after_mib']:.0f} MiB, "
              f"{res['not_meta']} of {res['tensors_checked']} tensors off meta", flush=True)
        if "profile" in res:
            print(res["profile"])
    return results


# ---------------------------------------------------------------------------------- c. markdown

def _bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def render(balance: dict, planning: list[dict], command: str, total_s: float) -> str:
    import timm
    import torch
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [START, "## Planner: stage balance and planning cost (`benchmarks/bench_plan.py`)", "",
           f"- Date: {now}",
           f"- Machine: {os.cpu_count()} CPUs ({cpu_name()}), Python {platform.python_version()}, "
           f"torch {torch.__version__}, timm {timm.__version__}",
           f"- Reproduce (repository root): `{command}` ({total_s:.0f} s here)",
           "- All times below are the cost model's predictions for an H100 (`device=\"h100\"`), per "
           "microbatch (forward + backward + boundary send/receive), not measurements; the models are "
           "built on the meta device and hold float32 parameters.", ""]
    if balance:
        out += ["### Stage balance: ViT-B/16 (`vit_base_patch16_224`), microbatch 8 x 3 x 224 x 224, 1F1B", "",
                "*max/mean* is the slowest stage's predicted time over the mean (1.000 is perfect). The "
                "baseline is *torchtitan's cut* (`generate_llm_fqn_per_model_part`): the embedding and the "
                "head each count as one layer, L + 2 units split evenly, earlier stages taking the "
                "remainder; n/a where that rule has no cut. *Speed-up* is the baseline's bottleneck / "
                "autosplit's: the predicted gain in pipeline throughput.", "",
                "| pp | autosplit max/mean | torchtitan max/mean | autosplit bottleneck (ms) "
                "| torchtitan bottleneck (ms) | speed-up | plan time (s) |",
                "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in balance["rows"]:
            out.append(f"| {r['pp']} | {r['ours_balance']:.3f} | {_num(r['equal_balance'])} | {r['ours_max_ms']:.3f} "
                       f"| {_num(r['equal_max_ms'])} | {_num(r['speedup'])} | {r['plan_s']:.2f} |")
        out.append("")
        for pp, stages in sorted(balance["details"].items()):
            out += [f"Stages at pp = {pp} ({balance['n_blocks']} blocks; autosplit may cut a block between its "
                    f"attention and MLP halves):", "",
                    "| stage | autosplit layers | params | predicted ms | memory | torchtitan's cut ms |",
                    "|---:|---|---:|---:|---:|---:|"]
            for d in stages:
                out.append(f"| {d['stage']} | {d['layers']} | {d['params'] / 1e6:.1f} M | {d['ms']:.3f} "
                           f"| {_bytes(d['memory'])} | {d['torchtitan_ms']:.3f} |")
            out.append("")
    if planning:
        out += ["### Planning cost of large models (meta device, microbatch 8, 1F1B)", "",
                "Each case runs in a fresh Python process. *RSS before* is the resident set after importing "
                "torch/timm/autosplit and building the model on meta; *peak RSS* is `ru_maxrss` after "
                "`autosplit.compile`; *increment* is their difference, an upper bound of what planning added "
                "(the import peak may already exceed the resident set). *Off meta* counts parameters and buffers (of the model and of every "
                "stage GraphModule) that are not on the meta device: 0 means nothing was materialized.", "",
                "| model | params | pp | compile (s) | RSS before (MiB) | peak RSS (MiB) | increment (MiB) "
                "| off meta | max/mean (autosplit / torchtitan) |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in planning:
            desc = PLANNING_CASES[r["name"]][0]
            inc = r["peak_after_mib"] - r["rss_before_mib"]
            out.append(f"| {desc} | {r['n_params'] / 1e9:.2f} B | {r['pp']} | {r['compile_s']:.2f} "
                       f"| {r['rss_before_mib']:.0f} | {r['peak_after_mib']:.0f} | {inc:.0f} "
                       f"| {r['not_meta']} / {r['tensors_checked']} "
                       f"| {r['ours_balance']:.3f} / {_num(r['equal_balance'])} |")
        out.append("")
        for r in planning:
            out.append(f"- `{r['name']}`: {r['n_nodes']} graph nodes, stages hold {r['stage_params'] / 1e9:.2f} B "
                       f"parameters in all (model: {r['n_params'] / 1e9:.2f} B), largest predicted stage memory "
                       f"{r['max_stage_memory_gib']:.1f} GiB; stage 0: {r['layers'][0]}.")
        out.append("")
    out.append(END)
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------ main

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None,
                   help=f"markdown file to update (default {DEFAULT_OUT}; with --quick, print only unless given)")
    p.add_argument("--quick", action="store_true",
                   help=f"pp in {QUICK_PPS} only and ViT-H only (skips the ViT-22B-like case)")
    p.add_argument("--profile", action="store_true",
                   help="print a cProfile (top 10 by cumulative time) of each large-model compile")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:
        print(json.dumps(child(args.child, args.profile)))
        return 0

    t0 = time.perf_counter()
    balance = run_balance(QUICK_PPS if args.quick else BALANCE_PPS)
    names = ["vit_huge_patch14_224"] if args.quick else list(PLANNING_CASES)
    planning = run_planning(names, args.profile)
    total = time.perf_counter() - t0

    command = "python benchmarks/bench_plan.py" + (" --quick" if args.quick else "")
    section = render(balance, planning, command, total)
    path = Path(args.out) if args.out else (None if args.quick else REPO / DEFAULT_OUT)
    if path is not None:
        write_section(path, section, START, END)
        print(f"wrote the bench_plan section of {path} ({total:.0f} s in all)")
    else:
        print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
