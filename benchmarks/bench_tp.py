"""Benchmark autosplit's 1D tensor parallelism against DTensor's ``parallelize_module``, side by side, on CPU.

Two gloo ranks (one thread each) train timm's VisionTransformer(img_size=32, patch_size=4,
embed_dim=192, depth=12, num_heads=6, num_classes=10) on a batch of 64, SGD, fp32, cross-entropy:

  dtensor  -- ``init_device_mesh("cpu", (2,))`` and ``parallelize_module`` on every block:
              ``ColwiseParallel`` for ``attn.qkv`` and ``mlp.fc1``, ``RowwiseParallel`` for ``attn.proj``
              and ``mlp.fc2`` (Megatron's plan, written the way DTensor's tutorials write it).
  ours     -- ``autosplit.parallelize(model, mesh=(1, 2, 1), num_microbatches=1, schedule="1f1b")``
              and ``pm.step(x, y)``: the backward all-reduce of each column-parallel entry's input
              gradient runs while the weight-gradient GEMMs compute (issue 11).
  ours_fused -- the same with ``tp_collectives.OVERLAP_BACKWARD = False`` at build time: the fused
              backward, each all-reduce waited at once (the "before").  For both, the seconds per
              step the main thread waited in tp collectives (``tp_collectives.EXPOSED``) are recorded:
              the exposed communication.
  single   -- the whole model in one process on one thread (rank 0; the other rank waits in a barrier).

What a careful DTensor user has to add for timm's attention (done here before parallelizing):
  * timm's fused ``qkv`` weight is laid out (3, heads, head_dim) along its output rows.  A contiguous
    column split would give rank 0 all of q and half of k.  The rows (and bias entries) are permuted
    so that rank r's contiguous block is [q of its heads, k of its heads, v of its heads].
  * timm's ``Attention.forward`` reshapes with ``self.num_heads`` and ``self.attn_dim`` (global
    sizes); each block gets the local ones (heads / tp, attn_dim / tp).
The script checks, before timing, that the DTensor model's loss on the first batch equals the
single-device model's loss (|diff| <= 1e-5), so a wrong reordering cannot go unnoticed.  Every
configuration starts from the same weights and trains on the same batch, so the losses of the first
steps must agree across configurations (step 1 checks the forward, step 2 the gradients and update).

Timing: 3 warm-up steps of each, then the timed steps interleaved in blocks (``--block`` steps of one
configuration, then of the next; the order rotates each round) so that machine noise hits all of
them.  Each step starts after a barrier; a step's time is the slowest rank's time for
forward + backward + ``opt.step()`` + ``opt.zero_grad()``.

autosplit's side is tried once per run; if ``parallelize`` fails (e.g. a release without tensor
parallelism), the error is recorded and the section reports DTensor's numbers alone.
``--probe`` only tries a tiny ``parallelize`` with mesh (1, 2, 1) on 2 ranks and exits 0 if it works.
``--profile`` adds a cProfile of autosplit's steps on each rank (printed, not written).

Run from the repository root:  python benchmarks/bench_tp.py             (writes docs/benchmarks.md)
                               python benchmarks/bench_tp.py --steps 5   (quicker, print only)
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from common import cpu_name, launch, profile_steps, step_stats, write_section

START = "<!-- bench_tp:start -->"
END = "<!-- bench_tp:end -->"
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = "docs/benchmarks.md"

WORLD = 2
TP = 2
BATCH = 64
LR = 0.01
VIT = dict(img_size=32, patch_size=4, embed_dim=192, depth=12, num_heads=6, num_classes=10)
CHECK_TOL = 1e-5

CONFIGS = ("ours", "ours_fused", "dtensor", "single")
LABELS = {
    "ours": "autosplit tp=2 (mesh (1, 2, 1))",
    "ours_fused": "autosplit tp=2, backward not overlapped",
    "dtensor": "DTensor parallelize_module, tp=2",
    "single": "single device (1 rank, 1 thread)",
}


def build_model():
    from timm.models import VisionTransformer
    return VisionTransformer(**VIT)


# ------------------------------------------------------------------------------ DTensor side

def qkv_head_order(heads: int, head_dim: int, tp: int):
    """Row permutation of a fused (3 * heads * head_dim)-row qkv weight: new row j takes old row idx[j].

    Old rows are indexed (s, h, d) with s in {q, k, v}; new rows are (r, s, h_local, d), so a contiguous
    split into ``tp`` blocks gives rank r the q, k and v rows of heads r*heads/tp .. (r+1)*heads/tp - 1.
    """
    import torch
    local = heads // tp
    return torch.arange(3 * heads * head_dim).view(3, tp, local, head_dim).permute(1, 0, 2, 3).reshape(-1)


def dtensor_model(base, mesh):
    """A copy of ``base`` tensor-parallelized with DTensor (qkv reordered, local head counts set)."""
    import torch
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    model = copy.deepcopy(base)
    tp = mesh.size()
    for block in model.blocks:
        attn = block.attn
        assert attn.num_heads % tp == 0 and attn.gate is None
        idx = qkv_head_order(attn.num_heads, attn.head_dim, tp)
        with torch.no_grad():
            attn.qkv.weight.copy_(attn.qkv.weight[idx])
            if attn.qkv.bias is not None:
                attn.qkv.bias.copy_(attn.qkv.bias[idx])
        attn.num_heads //= tp                   # Attention.forward reshapes with these: make them local
        attn.attn_dim //= tp
        parallelize_module(block, mesh, {
            "attn.qkv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "mlp.fc1": ColwiseParallel(),
            "mlp.fc2": RowwiseParallel(),
        })
    return model


# ------------------------------------------------------------------------------------- worker

def worker(rank: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    try:
        results.put((rank, (probe_rank if args.probe else run_rank)(rank, args)))
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent
        import traceback
        results.put((rank, {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}))


def _init(rank: int):
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))


def _agree(ok: bool) -> bool:
    """True when every rank says ok (so no rank goes on alone into collectives the others skip)."""
    import torch
    import torch.distributed as dist
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def probe_rank(rank: int, args) -> dict:
    """Try a tiny autosplit tensor-parallel step; report whether it worked."""
    import torch
    import torch.distributed as dist
    _init(rank)
    import autosplit
    from timm.models import VisionTransformer
    torch.manual_seed(0)
    model = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=4)
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 4, (4,))
    with torch.no_grad():
        out = {"rank": rank, "reference": float(torch.nn.functional.cross_entropy(model(x), y))}
    try:
        pm = autosplit.parallelize(model, mesh=(1, TP, 1), loss_fn=torch.nn.CrossEntropyLoss(),
                                   num_microbatches=1, schedule="1f1b", example_input=x)
        opt = torch.optim.SGD(pm.parameters(), lr=LR)
        out["loss"] = pm.step(x, y)
        opt.step()
        opt.zero_grad()
    except Exception as exc:  # noqa: BLE001
        out["unavailable"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    dist.destroy_process_group()
    return out


def run_rank(rank: int, args) -> dict:
    import torch
    import torch.distributed as dist
    _init(rank)
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    base = build_model()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 3, 32, 32, generator=gen)
    y = torch.randint(0, VIT["num_classes"], (BATCH,), generator=gen)
    loss_fn = torch.nn.CrossEntropyLoss()
    out: dict = {"rank": rank, "losses": {}, "times": {}, "setup_s": {}}

    with torch.no_grad():
        reference = float(loss_fn(base(x), y))
    out["reference_loss"] = reference

    steps: dict = {}

    # DTensor ------------------------------------------------------------------------------------
    t0 = time.perf_counter()
    mesh = init_device_mesh("cpu", (TP,))
    dt_model = dtensor_model(base, mesh)
    dt_opt = torch.optim.SGD(dt_model.parameters(), lr=LR)
    out["setup_s"]["dtensor"] = time.perf_counter() - t0
    with torch.no_grad():
        dt_loss = float(loss_fn(dt_model(x), y))
    out["dtensor_check"] = {"dtensor": dt_loss, "single": reference, "abs_diff": abs(dt_loss - reference)}
    # the plan without the reordering, to show what it gets wrong
    if args.check_naive:
        naive = copy.deepcopy(base)
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        for block in naive.blocks:
            block.attn.num_heads //= TP
            block.attn.attn_dim //= TP
            parallelize_module(block, mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                             "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})
        with torch.no_grad():
            out["naive_loss"] = float(loss_fn(naive(x), y))
        del naive

    def plain_step(model, opt):
        """A step of ``model`` the plain way: loss, backward, ``opt.step()``, ``opt.zero_grad()``."""
        def step():
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return float(loss.detach())
        return step
    steps["dtensor"] = plain_step(dt_model, dt_opt)

    # autosplit ----------------------------------------------------------------------------------
    ours_error = None
    t0 = time.perf_counter()
    try:
        import autosplit
        pm = autosplit.parallelize(copy.deepcopy(base), mesh=(1, TP, 1), loss_fn=torch.nn.CrossEntropyLoss(),
                                   num_microbatches=1, schedule="1f1b", example_input=x)
        ours_opt = torch.optim.SGD(pm.parameters(), lr=LR)
    except Exception as exc:  # noqa: BLE001 - recorded, the benchmark goes on with DTensor alone
        ours_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    if not _agree(ours_error is None):
        ours_error = ours_error or "autosplit.parallelize failed on another rank"
    if ours_error is None:
        out["setup_s"]["ours"] = time.perf_counter() - t0
        out["ours_local_params"] = sum(p.numel() for p in pm.parameters())

        from autosplit.runtime import tp_collectives
        tp_collectives.OVERLAP_BACKWARD = False          # the "before": fused backward
        pm_fused = autosplit.parallelize(copy.deepcopy(base), mesh=(1, TP, 1), loss_fn=torch.nn.CrossEntropyLoss(),
                                         num_microbatches=1, schedule="1f1b", example_input=x)
        tp_collectives.OVERLAP_BACKWARD = True
        fused_opt = torch.optim.SGD(pm_fused.parameters(), lr=LR)

        def ours_step(pm=pm, opt=ours_opt):
            loss = pm.step(x, y)
            opt.step()
            opt.zero_grad()
            return float(loss)
        steps["ours"] = ours_step
        steps["ours_fused"] = lambda: ours_step(pm_fused, fused_opt)
    out["ours_error"] = ours_error
    out["dtensor_local_params"] = sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                                      for p in dt_model.parameters())

    # single device ------------------------------------------------------------------------------
    single = copy.deepcopy(base)
    out["single_params"] = sum(p.numel() for p in single.parameters())
    s_opt = torch.optim.SGD(single.parameters(), lr=LR)

    steps["single"] = plain_step(single, s_opt) if rank == 0 else (lambda: None)   # rank 1 only waits

    configs = [c for c in CONFIGS if c in steps and c in args.configs]

    exposed = None
    if "ours" in steps:
        from autosplit.runtime.tp_collectives import EXPOSED as exposed

    def timed(name):
        dist.barrier()
        before = dict(exposed) if exposed is not None else {}
        c, t = time.process_time(), time.perf_counter()
        loss = steps[name]()
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        if record:
            out["times"].setdefault(name, []).append(wall)
            out["cpu_times"].setdefault(name, []).append(cpu)
            if name.startswith("ours"):
                out["exposed"].setdefault(name, []).append(
                    {k: exposed[k] - before.get(k, 0.0) for k in ("input_grad", "other")})
        return wall, loss
    out["exposed"] = {}

    # warm-up: its steps also give the first losses (same weights, same batch) -------------------
    record = False
    out["cpu_times"] = {}
    for name in configs:
        for _ in range(args.warmup):
            _, loss = timed(name)
            out["losses"].setdefault(name, []).append(loss)
    # timed steps, interleaved in blocks, the order rotating each round --------------------------
    record = True
    rounds = -(-args.steps // args.block)
    for r in range(rounds):
        k = r % len(configs)
        for name in configs[k:] + configs[:k]:
            for _ in range(min(args.block, args.steps - r * args.block)):
                timed(name)
    record = False

    if args.phase_steps and "ours" in steps:
        out["phases"] = collective_phases(steps["ours"], args.phase_steps)
        out["allreduce_ms"] = allreduce_cost(torch.zeros(BATCH, (VIT["img_size"] // VIT["patch_size"]) ** 2 + 1,
                                                         VIT["embed_dim"]), args.pingpong)

    if args.profile and "ours" in steps:
        out["cprofile"] = profile_steps(steps["ours"], 3, ("tottime", 25), ("cumulative", 25))

    dist.barrier()
    dist.destroy_process_group()
    return out


def collective_phases(step, n: int) -> dict:
    """Time spent in autosplit's tensor-parallel collectives (wrapped by name) over ``n`` steps."""
    import torch.distributed as dist
    from autosplit.runtime import tp_collectives as collectives
    totals = {"all_reduce": [0.0, 0], "all_gather": [0.0, 0]}
    saved = {}
    for name in totals:
        fn = saved[name] = getattr(collectives, f"_{name}")

        def wrapper(*a, _fn=fn, _name=name, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                totals[_name][0] += time.perf_counter() - t
                totals[_name][1] += 1
        setattr(collectives, f"_{name}", wrapper)
    step_s = 0.0
    try:
        for _ in range(n):
            dist.barrier()
            t = time.perf_counter()
            step()
            step_s += time.perf_counter() - t
    finally:
        for name, fn in saved.items():
            setattr(collectives, f"_{name}", fn)
    return {"step_s": step_s / n, **{k: (v[0] / n, v[1] / n) for k, v in totals.items()}}


def allreduce_cost(x, n: int) -> float:
    """Milliseconds per plain gloo all-reduce of ``x`` (clone + all_reduce + work.wait()), both ranks."""
    import torch.distributed as dist
    dist.barrier()
    t = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(x.clone(), async_op=True).wait()
    return (time.perf_counter() - t) / n * 1e3


# ------------------------------------------------------------------------------------- driver

def summarize(per_rank: list[dict]) -> dict:
    stats = {}
    for name in per_rank[0]["times"]:
        if name == "single":
            series = per_rank[0]["times"][name]      # rank 1 only waits in the barrier
        else:
            series = [max(ts) for ts in zip(*(r["times"][name] for r in per_rank))]
        stats[name] = step_stats(series)
        cpu = (per_rank[0]["cpu_times"][name] if name == "single" else
               [max(ts) for ts in zip(*(r["cpu_times"][name] for r in per_rank))])
        stats[name]["cpu_median"] = statistics.median(cpu)
    losses = {}
    for name in per_rank[0]["losses"]:
        # every rank returns the same (global) loss for the parallel runs; single runs on rank 0 only
        losses[name] = per_rank[0]["losses"][name]
    return {"stats": stats, "losses": losses}


def checks(summary: dict, per_rank: list[dict]) -> list[tuple[str, str, str, bool | None]]:
    """(what, value, target, passed) rows."""
    rows = []
    dc = per_rank[0]["dtensor_check"]
    diffs = [abs(r["dtensor_check"]["abs_diff"]) for r in per_rank]
    rows.append(("DTensor (qkv reordered) vs single device, loss on the first batch, max over ranks",
                 f"{max(diffs):.1e} ({dc['dtensor']:.6f} vs {dc['single']:.6f})", f"<= {CHECK_TOL:g}",
                 max(diffs) <= CHECK_TOL))
    if "naive_loss" in per_rank[0]:
        nd = abs(per_rank[0]["naive_loss"] - dc["single"])
        rows.append(("DTensor without the reordering (contiguous qkv split), same loss difference",
                     f"{nd:.1e} ({per_rank[0]['naive_loss']:.6f})", "(shows the plan is wrong)", None))
    ls = summary["losses"]
    for name in ("dtensor", "ours", "ours_fused"):
        if name in ls and "single" in ls:
            for i, (a, b) in enumerate(zip(ls[name], ls["single"])):
                d = abs(a - b)
                rows.append((f"{LABELS[name]} vs single device, loss of step {i + 1}", f"{d:.1e}", "<= 1e-4",
                             d <= 1e-4))
    return rows


def exposed_rows(per_rank: list[dict]) -> list[str]:
    """Exposed tp communication per step (median over timed steps, rank 0 / rank 1), before / after."""
    rows = []
    for name in ("ours_fused", "ours"):
        if name not in per_rank[0].get("exposed", {}):
            continue
        for kind, what in (("input_grad", "entries' input-gradient all-reduces (backward)"),
                           ("other", "all other tp collectives")):
            vals = [statistics.median(e[kind] for e in r["exposed"][name]) for r in per_rank]
            rows.append(f"| {LABELS[name]}: exposed wait per step, {what} (s, rank 0 / rank 1) "
                        f"| {' / '.join(f'{v:.4f}' for v in vals)} | |")
    return rows


def render(summary: dict, per_rank: list[dict], command: str, total_s: float, args) -> str:
    import timm
    import torch
    st, ls = summary["stats"], summary["losses"]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    err = per_rank[0]["ours_error"]
    lines = [START, "## 1D tensor parallelism: autosplit vs DTensor (`benchmarks/bench_tp.py`)", "",
             f"- Date: {now}",
             f"- Machine: {os.cpu_count()} CPUs ({cpu_name()}), Python {platform.python_version()}, "
             f"torch {torch.__version__}, timm {timm.__version__}",
             f"- Reproduce (repository root): `{command}` ({total_s:.0f} s here)",
             f"- Model: timm `VisionTransformer({', '.join(f'{k}={v}' for k, v in VIT.items())})`, fp32, SGD "
             f"lr={LR}, cross-entropy, batch {BATCH}; {WORLD} gloo ranks, 1 thread each (`OMP_NUM_THREADS=1`, "
             f"`torch.set_num_threads(1)`).",
             "- DTensor: `init_device_mesh(\"cpu\", (2,))`, `parallelize_module` on each block with `ColwiseParallel` "
             "for `attn.qkv`, `mlp.fc1` and `RowwiseParallel` for `attn.proj`, `mlp.fc2`; before that, as a careful "
             "user must, each fused qkv weight/bias is row-permuted from (3, heads, head_dim) to (rank, 3, local "
             "heads, head_dim) so the contiguous split gives each rank whole heads, and each block's "
             "`attn.num_heads` / `attn.attn_dim` are set to the local values (timm's reshape uses them).",
             "- autosplit: `autosplit.parallelize(model, mesh=(1, 2, 1), num_microbatches=1, schedule=\"1f1b\", "
             "example_input=x)`, `pm.step(x, y)`, SGD over `pm.parameters()`."
             + (f" **Not available in this run**: `{err}`." if err else ""),
             f"- Step = forward + backward + `opt.step()` + `opt.zero_grad()`, after a barrier; time of the slowest "
             f"rank (single device: rank 0, the other rank waits). {args.warmup} warm-up steps each, then "
             f"{args.steps} timed steps each, interleaved in blocks of {args.block} (order rotated every round).",
             f"- Load average (1 min) at start / end of the run: {args.load[0]:.2f} / {args.load[1]:.2f} "
             f"(other work on the machine inflates wall times; *CPU s* is the median over steps of the busiest "
             f"rank's process CPU time in the step, less sensitive to that but blind to waiting).",
             "", "| configuration | median (s) | p10 (s) | p90 (s) | CPU s (median) | steps | loss after step 1 "
             "| local params (rank 0) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    params = {"ours": per_rank[0].get("ours_local_params"), "dtensor": per_rank[0].get("dtensor_local_params"),
              "single": per_rank[0].get("single_params")}
    for name in CONFIGS:
        if name in st:
            s = st[name]
            loss = f"{ls[name][0]:.6f}" if ls.get(name) else ""
            pn = f"{params[name] / 1e6:.2f} M" if params.get(name) else ""
            lines.append(f"| {LABELS[name]} | {s['median']:.3f} | {s['p10']:.3f} | {s['p90']:.3f} "
                         f"| {s['cpu_median']:.3f} | {s['n']} | {loss} | {pn} |")
        elif name == "ours":
            lines.append(f"| {LABELS[name]} | not available | | | | | | |")
    lines += ["", "| comparison | value | target |", "|---|---:|---:|"]
    if "ours" in st and "dtensor" in st:
        lines.append(f"| autosplit / DTensor (median step) | {st['ours']['median'] / st['dtensor']['median']:.3f} "
                     f"| <= 0.90 |")
        lines.append(f"| autosplit / DTensor (median CPU s of the busiest rank) "
                     f"| {st['ours']['cpu_median'] / st['dtensor']['cpu_median']:.3f} | |")
    for name in ("ours", "dtensor"):
        if name in st and "single" in st:
            lines.append(f"| speed-up over single device: {LABELS[name]} | "
                         f"{st['single']['median'] / st[name]['median']:.2f} x | (ideal 2 x) |")
    if "ours" in st and "ours_fused" in st:
        lines.append(f"| autosplit overlapped / not overlapped backward (median step) "
                     f"| {st['ours']['median'] / st['ours_fused']['median']:.3f} | |")
    lines += exposed_rows(per_rank)
    for what, value, target, ok in checks(summary, per_rank):
        mark = "" if ok is None else (" (ok)" if ok else " (**FAILED**)")
        lines.append(f"| {what} | {value}{mark} | {target} |")
    ph = [r.get("phases") for r in per_rank]
    if all(ph):
        ar = max(r["allreduce_ms"] for r in per_rank)
        n_ar = ph[0]["all_reduce"][1]
        lines += ["", f"Where autosplit's step goes ({args.phase_steps} more steps with timers on its tensor-parallel "
                      f"collectives; seconds per step, rank 0 / rank 1):", "",
                  "| part | rank 0 | rank 1 |", "|---|---:|---:|",
                  "| step | " + " | ".join(f"{p['step_s']:.3f}" for p in ph) + " |",
                  "| TP all-reduces (clone + all_reduce + wait), calls | "
                  + " | ".join(f"{p['all_reduce'][0]:.3f} ({p['all_reduce'][1]:.0f})" for p in ph) + " |",
                  "| TP all-gathers, calls | "
                  + " | ".join(f"{p['all_gather'][0]:.3f} ({p['all_gather'][1]:.0f})" for p in ph) + " |",
                  "| everything else (compute, optimizer, Python) | "
                  + " | ".join(f"{p['step_s'] - p['all_reduce'][0] - p['all_gather'][0]:.3f}" for p in ph) + " |",
                  "", f"A plain gloo all-reduce of one {BATCH}x{(VIT['img_size'] // VIT['patch_size']) ** 2 + 1}x"
                      f"{VIT['embed_dim']} fp32 activation ({BATCH * ((VIT['img_size'] // VIT['patch_size']) ** 2 + 1) * VIT['embed_dim'] * 4 / 2**20:.1f} MiB), "
                      f"alone: {ar:.2f} ms. Megatron's minimum is 4 per block (2 forward, 2 backward), the same for "
                      f"DTensor's plan."]
        if "single" in st:
            floor = st["single"]["median"] / TP + n_ar * ar / 1e3
            lines.append(f"Without overlapping communication and compute, a step cannot beat single-device time / {TP} "
                         f"+ {n_ar:.0f} x {ar:.2f} ms = {floor:.3f} s (replicated layers not even counted)"
                         + (f"; the target 0.8 x DTensor is {0.8 * st['dtensor']['median']:.3f} s." if "dtensor" in st
                            else "."))
    lines += ["", END]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=15, help="timed steps per configuration (default 15)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per configuration (default 3)")
    p.add_argument("--block", type=int, default=1, help="consecutive timed steps of one configuration (default 1)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    p.add_argument("--no-naive-check", dest="check_naive", action="store_false",
                   help="skip showing the loss of DTensor's plan without the qkv reordering")
    p.add_argument("--phase-steps", type=int, default=3,
                   help="extra autosplit steps with timers on its collectives (0: skip; default 3)")
    p.add_argument("--pingpong", type=int, default=50, help="plain all-reduces timed for the reference cost")
    p.add_argument("--profile", action="store_true", help="also cProfile 3 autosplit steps on each rank (printed)")
    p.add_argument("--probe", action="store_true",
                   help="only try a tiny autosplit parallelize with mesh (1, 2, 1); exit 0 if it works")
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for the ranks")
    p.add_argument("--out", default=None, help=f"markdown file to update (default {DEFAULT_OUT} when run with "
                                                f"the default --steps/--warmup/--configs, else print only)")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    os.environ["OMP_NUM_THREADS"] = "1"

    if args.probe:
        per_rank = launch(worker, WORLD, args, args.timeout)
        bad = [r.get("unavailable") for r in per_rank if r.get("unavailable")]
        if bad:
            print(f"autosplit tp=2: not available: {bad[0]}")
            return 1
        print(f"autosplit tp=2: works (loss {per_rank[0]['loss']:.6f}, single device "
              f"{per_rank[0]['reference']:.6f})")
        return 0

    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    per_rank = launch(worker, WORLD, args, args.timeout)
    total = time.perf_counter() - t0
    args.load = (load0, os.getloadavg()[0])
    summary = summarize(per_rank)
    command = "python benchmarks/bench_tp.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])
                                                 if (argv if argv is not None else sys.argv[1:]) else "")
    section = render(summary, per_rank, command.strip(), total, args)
    print(section)
    for r in per_rank:
        if r.get("cprofile"):
            print(f"--- cProfile, autosplit steps, rank {r['rank']} ---\n{r['cprofile']}")
    defaults = args.steps == 15 and args.warmup == 3 and args.configs == list(CONFIGS)
    out = args.out or (DEFAULT_OUT if defaults else None)
    if out:
        write_section(REPO / out, section, START, END)
        print(f"wrote {out}")
    failed = [c for c in checks(summary, per_rank) if c[3] is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
