"""Benchmark autosplit's pipeline runtime against torch.distributed.pipelining, side by side, on CPU.

Two gloo ranks (one thread each) train timm's VisionTransformer(img_size=32, patch_size=4,
embed_dim=192, depth=12, num_heads=3, num_classes=10) on a batch of 64 in 8 microbatches, SGD, fp32:

  1f1b         -- torch ``Schedule1F1B`` (one stage per rank) vs autosplit ``schedule="1f1b"``, mesh (2,1,1)
  interleaved  -- torch ``ScheduleInterleaved1F1B`` (stages r and r+2 on rank r) vs autosplit
                  ``schedule="interleaved", chunks_per_rank=2``
  zero bubble  -- autosplit ``schedule="zb-h1"`` (one stage per rank) and ``schedule="zb-v"`` (two chunks
                  per rank in a V: stages r and 3-r), against torch ``Schedule1F1B`` (the targets:
                  zb-h1 <= 0.95, zb-v <= 0.92 of its step) and torch's own zero-bubble schedules
                  ``ScheduleInterleavedZeroBubble`` (stages r and r+2) and ``ScheduleZBVZeroBubble``
                  (stages r and 3-r), on the same hand split as torch's other schedules.
  single rank  -- the whole model in one process on one thread: one step on the full batch, and one
                  step as 8 microbatches of gradient accumulation (the other rank idles in a barrier);
                  also the accumulation step on both ranks at once (both cores busy, no pipeline), to
                  show what running two processes costs by itself.

torch's side is split by hand, the way its users do: ``PipelineStage`` over nn.Module pieces (patch
embedding + first blocks, ..., last blocks + norm + head) with equal block counts, shapes given as
``input_args`` / ``output_args``.  autosplit plans its own cut (for this model it is the same one).
Every configuration starts from the same weights.  After 3 warm-up steps of each, the timed steps are
interleaved one step at a time (the order rotates each round), each step starting after a barrier; a
step's time is the slowest rank's time for forward + backward of all microbatches + SGD step + zero_grad.

Then (unless --no-phases) a few more steps of each pipeline run with timers on the runtime's methods
(where the time goes: compute, waits, posting sends/receives, optimizer, the rest), and a ping-pong
micro-benchmark of one boundary transfer waited with ``work.wait()`` and with autosplit's
``Watchdog.wait``.  ``--profile`` adds a cProfile of autosplit's 1F1B steps on each rank.

Run from the repository root:  python benchmarks/bench_pipeline.py              (writes docs/benchmarks.md)
                               python benchmarks/bench_pipeline.py --steps 5    (quicker, print only)
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

from common import cpu_name, launch, profile_steps, step_stats, write_section

START = "<!-- bench_pipeline:start -->"
END = "<!-- bench_pipeline:end -->"
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = "docs/benchmarks.md"

WORLD = 2
BATCH = 64
MICROBATCHES = 8
LR = 0.01
VIT = dict(img_size=32, patch_size=4, embed_dim=192, depth=12, num_heads=3, num_classes=10)

PIPELINE = ("ours_1f1b", "torch_1f1b", "ours_interleaved", "torch_interleaved", "ours_1f1b_equal",
            "ours_interleaved_equal", "ours_zbh1", "ours_zbv", "torch_interleaved_zb", "torch_zbv")
SINGLE = ("single_full", "single_accum", "single_accum_both")
EXTRA = ("ours_1f1b_plainwait",)       # not run by default: --configs ...,ours_1f1b_plainwait
LABELS = {
    "ours_1f1b": "autosplit 1f1b",
    "torch_1f1b": "torch Schedule1F1B",
    "ours_interleaved": "autosplit interleaved (2 chunks/rank)",
    "torch_interleaved": "torch ScheduleInterleaved1F1B (2 stages/rank)",
    "ours_1f1b_equal": "autosplit 1f1b on torch's cut",
    "ours_interleaved_equal": "autosplit interleaved on torch's cut",
    "ours_zbh1": "autosplit zb-h1",
    "ours_zbv": "autosplit zb-v (2 chunks/rank, V)",
    "torch_interleaved_zb": "torch ScheduleInterleavedZeroBubble (2 stages/rank)",
    "torch_zbv": "torch ScheduleZBVZeroBubble (2 stages/rank, V)",
    "ours_1f1b_plainwait": "autosplit 1f1b, Watchdog.wait replaced by work.wait()",
    "single_full": "single rank, full batch of 64",
    "single_accum": "single rank, 8 x 8 gradient accumulation",
    "single_accum_both": "single-rank accumulation on both ranks at once",
}


# ------------------------------------------------------------------------------ model and pieces

def build_model():
    from timm.models import VisionTransformer
    return VisionTransformer(**VIT)


def _pieces(vit, n_pieces: int):
    """Hand-split ``vit`` into ``n_pieces`` nn.Modules with equal block counts (shares its parameters)."""
    import torch
    from torch import nn

    class First(nn.Module):
        def __init__(self, blocks):
            super().__init__()
            self.patch_embed, self.cls_token, self.pos_embed = vit.patch_embed, vit.cls_token, vit.pos_embed
            self.pos_drop, self.patch_drop, self.norm_pre = vit.pos_drop, vit.patch_drop, vit.norm_pre
            self.blocks = nn.Sequential(*blocks)

        def forward(self, x):
            x = self.patch_embed(x)
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
            x = self.norm_pre(self.patch_drop(self.pos_drop(x)))
            return self.blocks(x)

    class Middle(nn.Module):
        def __init__(self, blocks):
            super().__init__()
            self.blocks = nn.Sequential(*blocks)

        def forward(self, x):
            return self.blocks(x)

    class Last(nn.Module):
        def __init__(self, blocks):
            super().__init__()
            self.blocks = nn.Sequential(*blocks)
            self.norm, self.fc_norm, self.head_drop, self.head = vit.norm, vit.fc_norm, vit.head_drop, vit.head

        def forward(self, x):
            x = self.norm(self.blocks(x))
            x = x[:, 0]                      # class-token pooling (timm global_pool="token")
            return self.head(self.head_drop(self.fc_norm(x)))

    assert vit.global_pool == "token" and vit.reg_token is None and not vit.no_embed_class
    blocks = list(vit.blocks)
    per = len(blocks) // n_pieces
    assert per * n_pieces == len(blocks)
    groups = [blocks[i * per:(i + 1) * per] for i in range(n_pieces)]
    return [First(groups[0])] + [Middle(g) for g in groups[1:-1]] + [Last(groups[-1])]


def equal_layer_bounds(model, example, n_stages: int) -> list[int]:
    """autosplit's ``stage_bounds`` for the equal-block cut (torch's hand split)."""
    import autosplit
    from autosplit.passes.partition import equal_block_bounds
    plan = autosplit.compile(model, mesh=(WORLD, 1, 1), example_input=example,
                             schedule="interleaved" if n_stages > WORLD else "1f1b",
                             chunks_per_rank=n_stages // WORLD, num_microbatches=MICROBATCHES)
    return equal_block_bounds(plan.layer_end_segments, plan.bounds[-1] + 1, n_stages)


# ------------------------------------------------------------------------------------- timing

class PhaseTimer:
    """Exclusive time per category on the main thread (time of nested timed calls goes to their own
    category).  A category function may return None: that call is not timed (its time stays with the
    caller's category)."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.stack: list[list] = []
        self.main = threading.main_thread()
        self.enabled = False

    def inside(self, category: str) -> bool:
        return any(frame[1] == category for frame in self.stack)

    def wrap(self, fn, category):
        timer = self

        def wrapper(*args, **kwargs):
            if not timer.enabled or threading.current_thread() is not timer.main:
                return fn(*args, **kwargs)
            cat = category(*args, **kwargs) if callable(category) else category
            if cat is None:
                return fn(*args, **kwargs)
            frame = [0.0, cat]
            timer.stack.append(frame)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                timer.stack.pop()
                timer.totals[cat] = timer.totals.get(cat, 0.0) + elapsed - frame[0]
                timer.counts[cat] = timer.counts.get(cat, 0) + 1
                if timer.stack:
                    timer.stack[-1][0] += elapsed
        wrapper.__wrapped__ = fn
        return wrapper


PHASES = ("forward", "backward", "post", "wait", "loss all-reduce")


def _patch(timer: PhaseTimer) -> list:
    """Install timers on autosplit's and torch's runtime methods; returns what to restore.

    forward  -- stage forward (+ loss on the last stage): autosplit PipelineExecutor._forward /
                _finish_forward; torch _PipelineStageBase.forward_one_chunk / _maybe_compute_loss
    backward -- PipelineExecutor._backward; _PipelineStageBase.backward_one_chunk
    post     -- posting a group of isend/irecv (and allocating receive buffers): PipelineExecutor._post;
                torch schedules._batch_p2p
    wait     -- blocking on transfers: autosplit Watchdog.wait (all of it: the helper-thread hand-off,
                polling, store checks); torch Work.wait() on the main thread
    loss all-reduce -- autosplit's runtime/gradients.py global_mean (torch has no equivalent)
    """
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as tsched
    import torch.distributed.pipelining.stage as tstage

    from autosplit.runtime import executor, faults, gradients

    targets = [
        (executor.PipelineExecutor, "_forward", "forward"),
        (executor.PipelineExecutor, "_finish_forward", "forward"),
        (executor.PipelineExecutor, "_backward", "backward"),
        (executor.PipelineExecutor, "_weight_grad", "backward"),
        (executor.PipelineExecutor, "_post", "post"),
        (faults.Watchdog, "wait", lambda self, work, doing, **k: "loss all-reduce" if "all-reduce" in doing else "wait"),
        (gradients, "global_mean", "loss all-reduce"),
        (tstage._PipelineStageBase, "forward_one_chunk", "forward"),
        (tstage._PipelineStageBase, "backward_one_chunk", "backward"),
        (tstage._PipelineStageBase, "backward_weight_one_chunk", "backward"),
        (tsched._PipelineSchedule, "_maybe_compute_loss", "forward"),
        (tsched, "_batch_p2p", "post"),
        (dist.Work, "wait", lambda *a, **k: None if timer.inside("wait") or timer.inside("loss all-reduce")
         else "wait"),
    ]
    saved = []
    for owner, name, cat in targets:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, timer.wrap(original, cat))
    return saved


def _unpatch(saved: list) -> None:
    for owner, name, original in reversed(saved):
        setattr(owner, name, original)


# ------------------------------------------------------------------------------------- worker

def worker(rank: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    try:
        results.put((rank, run_rank(rank, args)))
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent
        import traceback
        results.put((rank, {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}))


def run_rank(rank: int, args) -> dict:
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

    import autosplit

    torch.manual_seed(0)
    base = build_model()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 3, 32, 32, generator=gen)
    y = torch.randint(0, VIT["num_classes"], (BATCH,), generator=gen)
    mb = BATCH // MICROBATCHES
    loss_fn = torch.nn.CrossEntropyLoss()
    cpu = torch.device("cpu")
    out: dict = {"rank": rank, "first_loss": {}, "times": {}, "phases": {}}

    with torch.no_grad():
        out["first_loss"]["reference"] = float(loss_fn(base(x), y))
        # the hand split computes exactly what the model computes
        pieces = _pieces(base, 4)
        h = x[:mb]
        for p in pieces:
            h = p(h)
        out["split_max_abs_diff"] = float((h - base(x[:mb])).abs().max())

    steps: dict = {}
    opts: dict = {}

    # autosplit ------------------------------------------------------------------------------
    for name, schedule, chunks in (("ours_1f1b", "1f1b", 1), ("ours_interleaved", "interleaved", 2),
                                   ("ours_1f1b_equal", "1f1b", 1), ("ours_interleaved_equal", "interleaved", 2),
                                   ("ours_zbh1", "zb-h1", 1), ("ours_zbv", "zb-v", 2)):
        if name not in args.configs:
            continue
        bounds = None
        if name.endswith("_equal"):
            bounds = equal_layer_bounds(base, torch.empty(mb, 3, 32, 32, device="meta"), WORLD * chunks)
        model = copy.deepcopy(base)
        pm = autosplit.parallelize(model, mesh=(WORLD, 1, 1), loss_fn=torch.nn.CrossEntropyLoss(),
                                   num_microbatches=MICROBATCHES, schedule=schedule, chunks_per_rank=chunks,
                                   example_input=x[:mb], stage_bounds=bounds)
        opt = torch.optim.SGD(pm.parameters(), lr=LR)

        def step(pm=pm, opt=opt):
            loss = pm.step(x, y)
            opt.step()
            opt.zero_grad()
            return loss
        steps[name], opts[name] = step, pm
        out.setdefault("ours_stages", {})[name] = [
            f"{s.layers} -> {' + '.join('x'.join(map(str, t.shape)) for t in s.outputs)}" for s in pm.plan.stages]

    if "ours_1f1b_plainwait" in args.configs and "ours_1f1b" in steps:
        from autosplit.runtime import faults

        def plain_wait(self, work, doing, host=False):
            if work is not None:
                work.wait()

        def step_plain(inner=steps["ours_1f1b"]):
            original = faults.Watchdog.wait
            faults.Watchdog.wait = plain_wait
            try:
                return inner()
            finally:
                faults.Watchdog.wait = original
        steps["ours_1f1b_plainwait"] = step_plain

    # torch.distributed.pipelining -------------------------------------------------------------
    # examples of the boundary tensors; requires_grad=True tells torch that a gradient flows back through it
    act = torch.zeros(mb, (VIT["img_size"] // VIT["patch_size"]) ** 2 + 1, VIT["embed_dim"], requires_grad=True)
    logits = torch.zeros(mb, VIT["num_classes"], requires_grad=True)
    for name, n_stages, kind in (("torch_1f1b", WORLD, Schedule1F1B),
                                 ("torch_interleaved", 2 * WORLD, ScheduleInterleaved1F1B),
                                 ("torch_interleaved_zb", 2 * WORLD, ScheduleInterleavedZeroBubble),
                                 ("torch_zbv", 2 * WORLD, ScheduleZBVZeroBubble)):
        if name not in args.configs:
            continue
        model = copy.deepcopy(base)
        pieces = _pieces(model, n_stages)
        # looped placement: rank r holds r, r+W, ...; ZBV's V: rank r holds r and 2W-1-r
        local = [rank, 2 * WORLD - 1 - rank] if name == "torch_zbv" else list(range(rank, n_stages, WORLD))
        stages = [PipelineStage(pieces[s], s, n_stages, cpu,
                                input_args=(x[:mb] if s == 0 else act,),
                                output_args=(logits if s == n_stages - 1 else act,)) for s in local]
        if n_stages == WORLD:
            sched = kind(stages[0], MICROBATCHES, loss_fn=torch.nn.CrossEntropyLoss(), scale_grads=True)
        else:
            sched = kind(stages, MICROBATCHES, loss_fn=torch.nn.CrossEntropyLoss(), scale_grads=True)
        params = [p for s in local for p in pieces[s].parameters()]
        opt = torch.optim.SGD(params, lr=LR)
        has_first, has_last = 0 in local, (n_stages - 1) in local

        def step(sched=sched, opt=opt, has_first=has_first, has_last=has_last):
            losses: list = []
            sched.step(*((x,) if has_first else ()), target=y if has_last else None,
                       losses=losses if has_last else None, return_outputs=False)
            opt.step()
            opt.zero_grad()
            return float(torch.stack(losses).mean()) if losses else None
        steps[name] = step

    # single rank -------------------------------------------------------------------------------
    single = copy.deepcopy(base)
    sopt = torch.optim.SGD(single.parameters(), lr=LR)

    def single_full():
        if rank != 0:
            return None
        loss = loss_fn(single(x), y)
        loss.backward()
        sopt.step()
        sopt.zero_grad()
        return float(loss)

    def single_accum(all_ranks=False):
        if rank != 0 and not all_ranks:
            return None
        total = 0.0
        for xs, ys in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
            loss = loss_fn(single(xs), ys) / MICROBATCHES
            loss.backward()
            total += float(loss)
        sopt.step()
        sopt.zero_grad()
        return total
    steps["single_full"] = single_full
    steps["single_accum"] = single_accum
    steps["single_accum_both"] = lambda: single_accum(all_ranks=True)

    configs = [c for c in PIPELINE + EXTRA + SINGLE if c in args.configs]

    def timed(name):
        dist.barrier()
        t0 = time.perf_counter()
        loss = steps[name]()
        return time.perf_counter() - t0, loss

    # warm-up (the first step of each configuration also gives its first-step loss) -------------
    for name in configs:
        for i in range(args.warmup):
            _, loss = timed(name)
            if i == 0 and name in PIPELINE:
                out["first_loss"][name] = loss
    # timed steps, interleaved one step at a time, rotating the order each round -----------------
    if rank == 0:
        print(f"warm-up done ({', '.join(configs)}); {args.steps} timed rounds", flush=True)
    for r in range(args.steps):
        if rank == 0 and r % 5 == 4:
            print(f"  round {r + 1}/{args.steps}", flush=True)
        k = r % len(configs)
        for name in configs[k:] + configs[:k]:
            out["times"].setdefault(name, []).append(timed(name)[0])

    # where the time goes -------------------------------------------------------------------------
    if args.phases:
        timer = PhaseTimer()
        saved = _patch(timer)
        try:
            # one instrumented step of each pipeline per round, like the timed steps
            out["phase_steps"] = args.phase_steps
            for _ in range(args.phase_steps):
                for name in [c for c in PIPELINE if c in configs]:
                    timer.totals, timer.counts = {}, {}
                    dist.barrier()
                    timer.enabled = True
                    t0 = time.perf_counter()
                    steps[name]()
                    total = time.perf_counter() - t0
                    timer.enabled = False
                    out["phases"].setdefault(name, []).append(
                        {"total": total, "parts": dict(timer.totals), "counts": dict(timer.counts)})
        finally:
            _unpatch(saved)
        out["optimizer_s"] = {}
        for name, opt_params in [(n, opts[n].parameters()) for n in ("ours_1f1b",) if n in opts]:
            params = list(opt_params)
            for p in params:
                p.grad = torch.zeros_like(p)
            o = torch.optim.SGD(params, lr=0.0)
            t0 = time.perf_counter()
            for _ in range(5):
                o.step()
                o.zero_grad(set_to_none=False)
            out["optimizer_s"][name] = (time.perf_counter() - t0) / 5
            for p in params:
                p.grad = None
        if opts:
            out["pingpong"] = pingpong(rank, next(iter(opts.values())).watchdog, act.detach(), args.pingpong)

    if args.profile and "ours_1f1b" in configs:
        out["cprofile"] = profile_steps(steps["ours_1f1b"], args.phase_steps, ("tottime", 18))

    dist.barrier()
    dist.destroy_process_group()
    return out


def pingpong(rank: int, watchdog, tensor, n: int) -> dict:
    """Round trips of one boundary tensor between the two ranks: plain work.wait() vs Watchdog.wait."""
    import torch
    import torch.distributed as dist
    peer = 1 - rank
    result = {}
    for size_name, buf in (("390 KiB activation", tensor.clone()), ("4-byte tensor", torch.zeros(1))):
        for how in ("work.wait()", "Watchdog.wait"):
            def wait(work, how=how):
                if how == "work.wait()":
                    work.wait()
                else:
                    watchdog.wait(work, "pingpong")
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(n):
                if rank == 0:
                    wait(dist.isend(buf, peer, tag=77))
                    wait(dist.irecv(buf, peer, tag=78))
                else:
                    wait(dist.irecv(buf, peer, tag=77))
                    wait(dist.isend(buf, peer, tag=78))
            result[(size_name, how)] = (time.perf_counter() - t0) / n
    return {f"{k[0]}|{k[1]}": v for k, v in result.items()}


# ------------------------------------------------------------------------------------- driver

def summarize(per_rank: list[dict]) -> dict:
    names = list(per_rank[0]["times"])
    stats, raw = {}, {}
    for name in names:
        # a step's time is the slowest rank's; the single-rank runs only count rank 0
        if name in ("single_full", "single_accum"):
            series = per_rank[0]["times"][name]
        else:
            series = [max(ts) for ts in zip(*(r["times"][name] for r in per_rank))]
        stats[name] = step_stats(series)
        raw[name] = series
    first = {}
    for r in per_rank:
        for k, v in r["first_loss"].items():
            if v is not None:
                first[k] = v
    return {"stats": stats, "first_loss": first, "series": raw}


def render(summary: dict, per_rank: list[dict], command: str, total_s: float, args) -> str:
    import timm
    import torch
    st, fl, series = summary["stats"], summary["first_loss"], summary["series"]
    m, p = MICROBATCHES, WORLD
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [START, "## Pipeline runtime: autosplit vs torch.distributed.pipelining (`benchmarks/bench_pipeline.py`)",
             "",
             f"- Date: {now}",
             f"- Machine: {os.cpu_count()} CPUs ({cpu_name()}), Python {platform.python_version()}, "
             f"torch {torch.__version__}, timm {timm.__version__}",
             f"- Reproduce (repository root): `{command}` ({total_s:.0f} s here; 1-minute load average "
             f"{summary['load'][0]:.2f} just before, {summary['load'][1]:.2f} just after, of which about 2 is this "
             f"benchmark: more means other processes shared the CPUs, which shows as p90 outliers)",
             f"- Model: timm `VisionTransformer({', '.join(f'{k}={v}' for k, v in VIT.items())})`, fp32, SGD "
             f"lr={LR}; batch {BATCH} in {m} microbatches of {BATCH // m}; {p} gloo ranks, 1 thread each "
             f"(`OMP_NUM_THREADS=1`, `torch.set_num_threads(1)`).",
             f"- Step = forward + backward of all microbatches + `opt.step()` + `opt.zero_grad()`, after a barrier; "
             f"time of the slowest rank. {args.warmup} warm-up steps per configuration, then {args.steps} timed steps "
             f"each, interleaved one step at a time (order rotated every round).",
             "- Stage cuts: torch's by hand with equal block counts (embedding + blocks 0-5 / blocks 6-11 + norm + "
             "head; 3 blocks per stage for interleaved), boundary one 8x65x192 tensor; autosplit's own plan "
             "with `parallelize`'s default cost model (on CPU: this machine, calibrated by rank 0) "
             "(stage layers -> boundary tensors): "
             + "; ".join(f"{k}: " + " / ".join(f"`{x}`" for x in v)
                         for k, v in per_rank[0].get("ours_stages", {}).items()),
             "", "| configuration | median (s) | p10 (s) | p90 (s) | steps | first-step loss |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in PIPELINE + EXTRA + SINGLE:
        if name in st:
            s = st[name]
            loss = f"{fl[name]:.6f}" if name in fl else ""
            lines.append(f"| {LABELS[name]} | {s['median']:.3f} | {s['p10']:.3f} | {s['p90']:.3f} | {s['n']} "
                         f"| {loss} |")
    lines.append(f"| (reference: whole model, full batch, no update) | | | | | {fl['reference']:.6f} |")
    lines += ["", "| comparison | value | target |", "|---|---:|---:|"]
    for sched in ("1f1b", "interleaved"):
        ours, theirs = f"ours_{sched}", f"torch_{sched}"
        if ours in st and theirs in st:
            ratio = st[ours]["median"] / st[theirs]["median"]
            lines.append(f"| {sched}: autosplit / torch (median step) | {ratio:.3f} | <= 0.90 |")
    for sched in ("1f1b", "interleaved"):
        for ours in (f"ours_{sched}", f"ours_{sched}_equal"):
            theirs = f"torch_{sched}"
            if ours in series and theirs in series:
                paired = statistics.median(a / b for a, b in zip(series[ours], series[theirs]))
                lines.append(f"| {sched}: {LABELS[ours].replace('autosplit ' + sched, 'autosplit')} / torch, median "
                             f"of per-round ratios | {paired:.3f} | <= 0.90 |")
    lines += zero_bubble_rows(st, series, fl)
    if "ours_1f1b_plainwait" in series and "ours_1f1b" in series:
        paired = statistics.median(a / b for a, b in zip(series["ours_1f1b_plainwait"], series["ours_1f1b"]))
        lines.append(f"| 1f1b: plain `work.wait()` / `Watchdog.wait`, median of per-round ratios | {paired:.3f} | |")
    for sched in ("1f1b", "interleaved"):
        ours, theirs = f"ours_{sched}_equal", f"torch_{sched}"
        if ours in st and theirs in st:
            lines.append(f"| {sched}: autosplit on torch's cut / torch (median step) | "
                         f"{st[ours]['median'] / st[theirs]['median']:.3f} | |")
    for base in ("single_accum", "single_full"):
        if base in st and "ours_1f1b" in st:
            ideal = (m + p - 1) / m * st[base]["median"] / p
            lines.append(f"| 1f1b ideal from {LABELS[base]}: (m+p-1)/m x T/p | {ideal:.3f} s | |")
            lines.append(f"| 1f1b: autosplit / ideal ({base}) | {st['ours_1f1b']['median'] / ideal:.3f} | <= 1.05 |")
            for other in ("ours_1f1b_equal", "torch_1f1b"):
                if other in st:
                    lines.append(f"| 1f1b: {LABELS[other].replace(' 1f1b', '').replace(' Schedule1F1B', '')} / "
                                 f"ideal ({base}) | {st[other]['median'] / ideal:.3f} | |")
    if "single_accum_both" in st and "single_accum" in st:
        lines.append(f"| two busy cores: single-rank accumulation step, both ranks / one rank | "
                     f"{st['single_accum_both']['median'] / st['single_accum']['median']:.3f} | |")
    for sched in ("1f1b", "interleaved"):
        a, b = fl.get(f"ours_{sched}"), fl.get(f"torch_{sched}")
        if a is not None and b is not None:
            lines.append(f"| {sched}: first-step loss, abs(autosplit - torch) | {abs(a - b):.2e} | < 1e-4 |")
    lines.append(f"| hand split vs whole model, max abs diff of logits | {per_rank[0]['split_max_abs_diff']:.1e} | |")
    if per_rank[0].get("phases"):
        lines += ["", *phase_table(per_rank)]
    if per_rank[0].get("pingpong"):
        lines += ["", *pingpong_table(per_rank)]
    lines.append("")
    lines.append(END)
    return "\n".join(lines) + "\n"


ZB_TARGETS = {"ours_zbh1": 0.95, "ours_zbv": 0.92}    # of torch Schedule1F1B's step (issue 11)


def zero_bubble_rows(st: dict, series: dict, fl: dict) -> list[str]:
    """Zero-bubble rows of the comparison table: each against torch's 1F1B (the targets) and against
    torch's own zero-bubble schedule of the same placement."""
    rows = []
    for ours, target in ZB_TARGETS.items():
        for theirs in ("torch_1f1b", "ours_1f1b", "torch_interleaved_zb" if ours == "ours_zbh1" else "torch_zbv"):
            if ours not in st or theirs not in st:
                continue
            goal = f"<= {target:.2f}" if theirs == "torch_1f1b" else ""
            paired = statistics.median(a / b for a, b in zip(series[ours], series[theirs]))
            rows.append(f"| {LABELS[ours]} / {LABELS[theirs]} (median step) | "
                        f"{st[ours]['median'] / st[theirs]['median']:.3f} | {goal} |")
            rows.append(f"| {LABELS[ours]} / {LABELS[theirs]}, median of per-round ratios | {paired:.3f} | {goal} |")
    for name in ("ours_zbh1", "ours_zbv", "torch_interleaved_zb", "torch_zbv"):
        if fl.get(name) is not None and fl.get("reference") is not None:
            rows.append(f"| {LABELS[name]}: first-step loss, abs(- whole model) | {abs(fl[name] - fl['reference']):.2e} "
                        f"| < 1e-4 |")
    return rows


def phase_table(per_rank: list[dict]) -> list[str]:
    names = [n for n in PIPELINE if n in per_rank[0]["phases"]]
    steps = per_rank[0].get("phase_steps", "?")
    lines = [f"Where the time goes: {steps} more steps of each pipeline (interleaved like the timed ones) with "
             "timers on the runtimes' methods; shown: the step with the median time (main thread; a nested "
             "timed call counts in its own column, not its caller's). *post*: posting "
             "isend/irecv; *wait*: blocking on transfers (autosplit: all of `Watchdog.wait`, torch: "
             "`Work.wait()`), including waiting for the other rank's compute (the pipeline bubble); *other*: "
             "step minus the timed columns (optimizer, Python scheduling code). Seconds per step; (n) = calls "
             "per step.", "",
             "| pipeline | rank | step | forward | backward | post (n) | wait (n) | loss all-reduce | other |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in names:
        # the step whose slowest-rank time is the median (lower middle) of the phase steps, on both ranks
        totals = [max(r["phases"][n][k]["total"] for r in per_rank) for k in range(len(per_rank[0]["phases"][n]))]
        pick = sorted(range(len(totals)), key=totals.__getitem__)[(len(totals) - 1) // 2]
        for r in per_rank:
            ph = r["phases"][n][pick]
            parts, counts = ph["parts"], ph["counts"]

            def cell(c, with_count=False):
                if c not in parts:
                    return "-"
                return f"{parts[c]:.3f}" + (f" ({counts[c]:.0f})" if with_count else "")
            other = ph["total"] - sum(parts.values())
            lines.append(f"| {LABELS[n]} | {r['rank']} | {ph['total']:.3f} | {cell('forward')} | {cell('backward')} "
                         f"| {cell('post', True)} | {cell('wait', True)} | {cell('loss all-reduce')} | {other:.3f} |")
    opt = per_rank[0].get("optimizer_s", {}).get("ours_1f1b")
    if opt:
        lines += ["", f"SGD `step()` + `zero_grad()` over one rank's half of the parameters, timed alone: "
                      f"{opt * 1e3:.1f} ms (part of *other*)."]
    return lines



def pingpong_table(per_rank: list[dict]) -> list[str]:
    pp = per_rank[0]["pingpong"]
    lines = ["Boundary ping-pong between the two ranks (isend then irecv per round trip, each waited at once): "
             "time per round trip; the difference is the cost of waiting through autosplit's `Watchdog.wait` "
             "(hand-off to a helper thread, polled with sleeps growing from 10 us to 1 ms, store checked every 20 ms) instead of `work.wait()`, for 2 waits per "
             "round trip on each rank.", "",
             "| tensor | work.wait() (ms) | Watchdog.wait (ms) | extra per wait (ms) |", "|---|---:|---:|---:|"]
    for size in ("390 KiB activation", "4-byte tensor"):
        a, b = pp[f"{size}|work.wait()"], pp[f"{size}|Watchdog.wait"]
        lines.append(f"| {size} | {a * 1e3:.3f} | {b * 1e3:.3f} | {(b - a) / 2 * 1e3:.3f} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=15, help="timed steps per configuration (default 15)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per configuration (default 3)")
    p.add_argument("--configs", default=",".join(PIPELINE + SINGLE),
                   help="comma-separated subset of: " + ", ".join(PIPELINE + EXTRA + SINGLE))
    p.add_argument("--no-phases", dest="phases", action="store_false",
                   help="skip the per-phase timers and the ping-pong micro-benchmark")
    p.add_argument("--phase-steps", type=int, default=5, help="steps per pipeline run with phase timers")
    p.add_argument("--pingpong", type=int, default=200, help="round trips per ping-pong measurement")
    p.add_argument("--profile", action="store_true", help="also cProfile autosplit's 1f1b steps on each rank")
    p.add_argument("--out", default=None, help=f"markdown file to update (default {DEFAULT_OUT} when run with "
                                                f"the default --steps/--warmup/--configs, else print only)")
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for the ranks")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(args.configs) - set(PIPELINE + EXTRA + SINGLE)
    if unknown:
        p.error(f"unknown configurations: {sorted(unknown)}")

    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    per_rank = launch(worker, WORLD, args, args.timeout)
    total = time.perf_counter() - t0
    summary = summarize(per_rank)
    summary["load"] = (load_before, os.getloadavg()[0])
    command = "python " + " ".join(["benchmarks/bench_pipeline.py"] + list(argv if argv is not None else sys.argv[1:]))
    section = render(summary, per_rank, command.strip(), total, args)
    print(section)
    print("raw step times (s), slowest rank per step, in the order taken:")
    for name, series in summary["series"].items():
        print(f"  {name:18s} " + " ".join(f"{t:.3f}" for t in series))
    for r in per_rank:
        if "cprofile" in r:
            print(f"--- cProfile, rank {r['rank']}, autosplit 1f1b, {args.phase_steps} steps (by tottime) ---")
            print(r["cprofile"])
    defaults = (args.steps, args.warmup, args.configs) == (15, 3, list(PIPELINE + SINGLE))
    path = Path(args.out) if args.out else (REPO / DEFAULT_OUT if defaults else None)
    if path is not None:
        write_section(path, section, START, END)
        print(f"wrote the bench_pipeline section of {path} ({total:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
