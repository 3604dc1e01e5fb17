"""Benchmark autosplit's pipeline runtime against torch.distributed.pipelining, side by side, on CPU.

Two gloo ranks (one thread each) train timm's VisionTransformer(img_size=32, patch_size=4,
embed_dim=192, depth=12, num_heads=3, num_classes=10) on a batch of 64 in 8 microbatches, SGD, fp32:

  1f1b         -- torch ``Schedule1F1B`` (one stage per rank) vs autosplit ``schedule="1f1b"``, mesh (2,1,1)
  interleaved  -- torch ``ScheduleInterleaved1F1B`` (stages r and r+2 on rank r) vs autosplit
                  ``schedule="interleaved", chunks_per_rank=2``
  zero bubble  -- autosplit ``schedule="zb-h1"`` and ``"zb-v"`` (two chunks per rank in a V: stages r and
                  3-r) against torch ``Schedule1F1B`` (issue 11's targets: <= 0.95 and <= 0.92 of its step)
                  and torch's ``ScheduleInterleavedZeroBubble`` (stages r and r+2) / ``ScheduleZBVZeroBubble``
                  (stages r and 3-r) on the same hand split as torch's other schedules.
  single rank  -- the whole model in one process: one step on the full batch, one as 8 microbatches of
                  gradient accumulation (the other rank idles in a barrier), and the accumulation on
                  both ranks at once (both cores busy, no pipeline: what two processes cost by itself).

torch's side is split by hand, as its users do: ``PipelineStage`` over nn.Module pieces with equal block
counts.  autosplit plans its own cut; ``*_equal`` runs autosplit on torch's cut.  Every configuration
starts from the same weights.  Timing: ``common.rotate`` (warm-up, then one step of each per round, the
order rotated; a step is the slowest rank's forward + backward of all microbatches + SGD step + zero_grad).

Then (unless --no-phases) a few more steps of each pipeline under torch.profiler (``common.profiled_steps``):
where each step goes, read from the executor's ``autosplit::`` ranges and torch's ``PP:`` ranges, and the
median F / B / I / W of one microbatch per stage; and a ping-pong of one boundary transfer waited with
``work.wait()`` and with autosplit's ``Watchdog.wait``.  ``--profile``: a cProfile of autosplit's 1F1B.

Run from the repository root:  python benchmarks/bench_pipeline.py              (writes docs/benchmarks.md)
                               python benchmarks/bench_pipeline.py --steps 5    (quicker, print only)
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

from common import (action_times, finish, machine_lines, md_table, paired_ratio, phase_totals, profile_steps,
                    profiled_steps, rotate, slowest, spawn_ranks, step_stats, train_step)

START, END = "<!-- bench_pipeline:start -->", "<!-- bench_pipeline:end -->"
REPO = Path(__file__).resolve().parent.parent
WORLD, BATCH, MICROBATCHES, LR = 2, 64, 8, 0.01
VIT = dict(img_size=32, patch_size=4, embed_dim=192, depth=12, num_heads=3, num_classes=10)

# autosplit configurations: (schedule, chunks per rank, on torch's cut); torch's: (schedule class, stages)
OURS = {"ours_1f1b": ("1f1b", 1, False), "ours_interleaved": ("interleaved", 2, False),
        "ours_1f1b_equal": ("1f1b", 1, True), "ours_interleaved_equal": ("interleaved", 2, True),
        "ours_zbh1": ("zb-h1", 1, False), "ours_zbv": ("zb-v", 2, False)}
TORCH = {"torch_1f1b": ("Schedule1F1B", 2), "torch_interleaved": ("ScheduleInterleaved1F1B", 4),
         "torch_interleaved_zb": ("ScheduleInterleavedZeroBubble", 4), "torch_zbv": ("ScheduleZBVZeroBubble", 4)}
PIPELINE = tuple(OURS) + tuple(TORCH)
SINGLE = ("single_full", "single_accum", "single_accum_both")
LABELS = {
    "ours_1f1b": "autosplit 1f1b", "torch_1f1b": "torch Schedule1F1B",
    "ours_interleaved": "autosplit interleaved (2 chunks/rank)",
    "torch_interleaved": "torch ScheduleInterleaved1F1B (2 stages/rank)",
    "ours_1f1b_equal": "autosplit 1f1b on torch's cut", "ours_interleaved_equal": "autosplit interleaved on torch's cut",
    "ours_zbh1": "autosplit zb-h1", "ours_zbv": "autosplit zb-v (2 chunks/rank, V)",
    "torch_interleaved_zb": "torch ScheduleInterleavedZeroBubble (2 stages/rank)",
    "torch_zbv": "torch ScheduleZBVZeroBubble (2 stages/rank, V)",
    "single_full": "single rank, full batch of 64", "single_accum": "single rank, 8 x 8 gradient accumulation",
    "single_accum_both": "single-rank accumulation on both ranks at once",
}
# (ours, theirs, target): rows of the comparison table, median step and median of per-round ratios
COMPARE = [("ours_1f1b", "torch_1f1b", ""), ("ours_1f1b_equal", "torch_1f1b", ""),
           ("ours_interleaved", "torch_interleaved", ""), ("ours_interleaved_equal", "torch_interleaved", ""),
           ("ours_zbh1", "torch_1f1b", "<= 0.95"), ("ours_zbh1", "ours_1f1b", ""),
           ("ours_zbh1", "torch_interleaved_zb", ""), ("ours_zbv", "torch_1f1b", "<= 0.92"),
           ("ours_zbv", "ours_1f1b", ""), ("ours_zbv", "torch_zbv", "")]


def build_model():
    from timm.models import VisionTransformer
    return VisionTransformer(**VIT)


def _pieces(vit, n_pieces: int):
    """Hand-split ``vit`` into ``n_pieces`` nn.Modules with equal block counts (shares its parameters)."""
    import torch
    from torch import nn
    assert vit.global_pool == "token" and vit.reg_token is None and not vit.no_embed_class
    blocks = list(vit.blocks)
    per = len(blocks) // n_pieces
    assert per * n_pieces == len(blocks)

    class Piece(nn.Module):
        def __init__(self, k):
            super().__init__()
            self.first, self.last = k == 0, k == n_pieces - 1
            self.blocks = nn.Sequential(*blocks[k * per:(k + 1) * per])
            if self.first:
                self.patch_embed, self.cls_token, self.pos_embed = vit.patch_embed, vit.cls_token, vit.pos_embed
                self.pre = nn.Sequential(vit.pos_drop, vit.patch_drop, vit.norm_pre)
            if self.last:
                self.norm, self.post = vit.norm, nn.Sequential(vit.fc_norm, vit.head_drop, vit.head)

        def forward(self, x):
            if self.first:
                x = self.patch_embed(x)                                   # (B, N, C)
                x = self.pre(torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed)
            x = self.blocks(x)
            if self.last:
                x = self.post(self.norm(x)[:, 0])    # class-token pooling; timm: fc_norm, head_drop, head
            return x
    return [Piece(k) for k in range(n_pieces)]


def build_steps(rank: int, base, x, y) -> tuple[dict, dict, object]:
    """{config: step()} for every configuration, autosplit's plans' stage lines, and one's Watchdog."""
    import torch
    from torch.distributed import pipelining as tp

    import autosplit
    from autosplit.passes.partition import equal_block_bounds
    mb = BATCH // MICROBATCHES
    steps, stages = {}, {}
    for name, (schedule, chunks, equal) in OURS.items():
        bounds = None
        if equal:
            plan = autosplit.compile(base, mesh=(WORLD, 1, 1), example_input=x[:mb], schedule=schedule,
                                     chunks_per_rank=chunks, num_microbatches=MICROBATCHES)
            bounds = equal_block_bounds(plan.layer_end_segments, plan.bounds[-1] + 1, WORLD * chunks)
        pm = autosplit.parallelize(copy.deepcopy(base), mesh=(WORLD, 1, 1), loss_fn=torch.nn.CrossEntropyLoss(),
                                   num_microbatches=MICROBATCHES, schedule=schedule, chunks_per_rank=chunks,
                                   example_input=x[:mb], stage_bounds=bounds)
        steps[name] = train_step(lambda pm=pm: pm.step(x, y), torch.optim.SGD(pm.parameters(), lr=LR))
        stages[name] = [f"{s.layers} -> {' + '.join('x'.join(map(str, t.shape)) for t in s.outputs)}"
                        for s in pm.plan.stages]
    # torch: boundary examples; requires_grad=True says a gradient flows back through them
    act = torch.zeros(mb, (VIT["img_size"] // VIT["patch_size"]) ** 2 + 1, VIT["embed_dim"], requires_grad=True)
    logits = torch.zeros(mb, VIT["num_classes"], requires_grad=True)
    for name, (cls, n) in TORCH.items():
        pieces = _pieces(copy.deepcopy(base), n)
        # looped placement: rank r holds r, r+W, ...; ZBV's V: rank r holds r and 2W-1-r
        local = [rank, 2 * WORLD - 1 - rank] if name == "torch_zbv" else list(range(rank, n, WORLD))
        pstages = [tp.PipelineStage(pieces[s], s, n, torch.device("cpu"), input_args=(x[:mb] if s == 0 else act,),
                                    output_args=(logits if s == n - 1 else act,)) for s in local]
        sched = getattr(tp, cls)(pstages[0] if n == WORLD else pstages, MICROBATCHES,
                                 loss_fn=torch.nn.CrossEntropyLoss(), scale_grads=True)
        def run(sched=sched, first=0 in local, last=n - 1 in local):
            losses: list = []
            sched.step(*((x,) if first else ()), target=y if last else None, losses=losses if last else None,
                       return_outputs=False)
            return float(torch.stack(losses).mean()) if losses else None
        steps[name] = train_step(run, torch.optim.SGD([p for s in local for p in pieces[s].parameters()], lr=LR))
    single, loss_fn = copy.deepcopy(base), torch.nn.CrossEntropyLoss()
    sopt = torch.optim.SGD(single.parameters(), lr=LR)

    def single_step(chunks: int, all_ranks: bool = False):
        total = 0.0
        for xs, ys in zip(x.chunk(chunks), y.chunk(chunks)) if rank == 0 or all_ranks else ():
            loss = loss_fn(single(xs), ys) / chunks
            loss.backward()
            total += float(loss.detach())
        return total
    steps["single_full"] = train_step(lambda: single_step(1), sopt)
    steps["single_accum"] = train_step(lambda: single_step(MICROBATCHES), sopt)
    steps["single_accum_both"] = train_step(lambda: single_step(MICROBATCHES, all_ranks=True), sopt)
    return steps, stages, pm.watchdog


def run_rank(rank: int, args) -> dict:
    import torch
    torch.manual_seed(0)
    base = build_model()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 3, 32, 32, generator=gen)
    y = torch.randint(0, VIT["num_classes"], (BATCH,), generator=gen)
    out: dict = {"rank": rank}
    with torch.no_grad():
        out["reference"] = float(torch.nn.functional.cross_entropy(base(x), y))
        h = x[:BATCH // MICROBATCHES]
        for p in _pieces(base, 4):
            h = p(h)
        out["split_max_abs_diff"] = float((h - base(x[:BATCH // MICROBATCHES])).abs().max())   # hand split exact
    steps, out["stages"], watchdog = build_steps(rank, base, x, y)
    configs = [c for c in PIPELINE + SINGLE if c in args.configs]
    if rank == 0:
        print(f"built; warm-up and {args.steps} timed rounds of {', '.join(configs)}", flush=True)
    out.update(rotate(steps, configs, args.warmup, args.steps))
    if args.phases:
        out["phases"] = {name: profiled_steps(steps[name], args.phase_steps) for name in configs if name in PIPELINE}
        out["pingpong"] = pingpong(rank, watchdog, args.pingpong)
    if args.profile and "ours_1f1b" in configs:
        out["cprofile"] = profile_steps(steps["ours_1f1b"], args.phase_steps, ("tottime", 18))
    return out


def pingpong(rank: int, watchdog, n: int) -> dict:
    """Round trips of one boundary tensor between the two ranks: plain ``work.wait()`` vs ``Watchdog.wait``."""
    import torch
    import torch.distributed as dist
    result = {}
    for size, buf in (("390 KiB activation", torch.zeros(8, 65, 192)), ("4-byte tensor", torch.zeros(1))):
        for how, wait in (("work.wait()", lambda w: w.wait()), ("Watchdog.wait", lambda w: watchdog.wait(w, "pp"))):
            dist.barrier()
            t = time.perf_counter()
            for _ in range(n):
                for send in (rank == 0, rank != 0):
                    wait(dist.isend(buf, 1 - rank, tag=7) if send else dist.irecv(buf, 1 - rank, tag=7))
            result[f"{size}|{how}"] = (time.perf_counter() - t) / n
    return result


# ------------------------------------------------------------------------------------- driver

def render(per_rank: list[dict], args, command: str, total_s: float) -> str:
    names = [c for c in PIPELINE + SINGLE if c in per_rank[0]["times"]]
    series = {n: slowest(per_rank, "times", n, rank0_only=n in ("single_full", "single_accum")) for n in names}
    st = {n: step_stats(s) for n, s in series.items()}
    first = {n: next(v[0] for r in per_rank if (v := r["first"].get(n)) and v[0] is not None)
             for n in names if n in PIPELINE}
    ref = per_rank[0]["reference"]
    lines = [START, "## Pipeline runtime: autosplit vs torch.distributed.pipelining (`benchmarks/bench_pipeline.py`)",
             "", *machine_lines(command, total_s, args.load, "timm"),
             f"- Model: timm `VisionTransformer({', '.join(f'{k}={v}' for k, v in VIT.items())})`, fp32, SGD "
             f"lr={LR}; batch {BATCH} in {MICROBATCHES} microbatches; {WORLD} gloo ranks, 1 thread each.",
             f"- Step = forward + backward of all microbatches + `opt.step()` + `opt.zero_grad()`, after a barrier; "
             f"time of the slowest rank. {args.warmup} warm-up steps per configuration, then {args.steps} timed "
             f"steps each, one step of each per round (order rotated every round).",
             "- Stage cuts: torch's by hand with equal block counts; autosplit's own plan (stage layers -> boundary "
             "tensors): " + "; ".join(f"{k}: " + " / ".join(f"`{s}`" for s in v)
                                      for k, v in per_rank[0]["stages"].items() if not k.endswith("_equal")), ""]
    lines += md_table(["configuration", "median (s)", "p10 (s)", "p90 (s)", "steps", "first-step loss - whole model"],
                      [[LABELS[n], f"{st[n]['median']:.3f}", f"{st[n]['p10']:.3f}", f"{st[n]['p90']:.3f}", st[n]["n"],
                        f"{abs(first[n] - ref):.1e}" if n in first else ""] for n in names])
    rows = []
    for ours, theirs, target in COMPARE:
        if ours in st and theirs in st:
            rows.append([f"{LABELS[ours]} / {LABELS[theirs]}", f"{st[ours]['median'] / st[theirs]['median']:.3f}",
                         f"{paired_ratio(series[ours], series[theirs]):.3f}", target])
    for base in ("single_accum", "single_full"):
        if base in st and "ours_1f1b" in st:
            ideal = (MICROBATCHES + WORLD - 1) / MICROBATCHES * st[base]["median"] / WORLD
            for n in ("ours_1f1b", "torch_1f1b"):
                rows.append([f"{LABELS[n]} / 1F1B ideal (m+p-1)/m x T/p from {LABELS[base]} ({ideal:.3f} s)",
                             f"{st[n]['median'] / ideal:.3f}", "", ""])
    if "single_accum_both" in st and "single_accum" in st:
        rows.append(["two busy cores: single-rank accumulation, both ranks / one rank",
                     f"{st['single_accum_both']['median'] / st['single_accum']['median']:.3f}", "", ""])
    lines += ["", *md_table(["comparison", "median step ratio", "median of per-round ratios", "target"], rows),
              "", f"Hand split vs whole model, max abs diff of logits: {per_rank[0]['split_max_abs_diff']:.1e}."]
    if per_rank[0].get("phases"):
        lines += ["", *phase_tables(per_rank), "", *bound_table(per_rank, st), "", *pingpong_table(per_rank)]
    return "\n".join(lines + ["", END]) + "\n"


PHASES = ("F", "B", "I", "W", "wait", "transfers", "optimizer", "other")


def phase_tables(per_rank: list[dict]) -> list[str]:
    n_steps = len(next(iter(per_rank[0]["phases"].values())))
    rows = []
    for name in per_rank[0]["phases"]:
        totals = [max(r["phases"][name][k]["total"] for r in per_rank) for k in range(n_steps)]
        pick = sorted(range(n_steps), key=totals.__getitem__)[(n_steps - 1) // 2]
        for r in per_rank:
            ph = phase_totals(r["phases"][name][pick])
            rows.append([LABELS[name], r["rank"], f"{r['phases'][name][pick]['total']:.3f}",
                         *(f"{ph[c]:.3f}" if c in ph else "-" for c in PHASES)])
    lines = [f"Where the time goes: {n_steps} more steps of each pipeline under torch.profiler (rotated like the "
             "timed ones; the profiler's own cost is inside them); shown: the step with the median time, seconds per "
             "rank, read from `record_function` ranges (exclusive: a nested range counts in its own column). "
             "F / B / I / W: the compute actions (autosplit `autosplit::1F3`, torch `PP:1F3`; torch's "
             "`Schedule1F1B` opens no ranges, so all of its step is *other*, and torch's waits for receives are "
             "inside its computes); *wait*: autosplit waiting for a receive (the bubble included); *transfers*: "
             "posting send/receive groups (autosplit also the step's last send waits; torch its SEND/RECV "
             "actions); *optimizer*: `opt.step()` + `opt.zero_grad()`; *other*: the rest (loss all-reduce, "
             "Python scheduling).", ""]
    lines += md_table(["pipeline", "rank", "step", *PHASES], rows)
    rows = []
    for name in ("ours_1f1b", "ours_zbh1", "ours_interleaved", "ours_zbv"):
        if name in per_rank[0]["phases"]:
            times = {k: v for r in per_rank for k, v in action_times(r["phases"][name]).items()}
            for stage in sorted({s for s, _ in times}):
                cell = {k: times.get((stage, k)) for k in "FBIW"}
                iw = cell["I"] + cell["W"] if cell["I"] and cell["W"] else None
                rows.append([LABELS[name], stage, *(f"{v * 1e3:.1f}" if v else "-" for v in cell.values()),
                             f"{iw * 1e3:.1f}" if iw else "-"])
    return lines + ["", "One microbatch's compute per stage inside the pipelines (median over the profiled steps "
                    "of each action's exclusive time, ms; the waits for receives excluded):", "",
                    *md_table(["pipeline", "stage", "F", "B", "I", "W", "I + W"], rows)]


def bound_table(per_rank: list[dict], st: dict) -> list[str]:
    """Each autosplit schedule timed at the compute it measured, with nothing else: what is the schedule's
    and what is the runtime's.  ``predict_step`` (the cost model's timed run of the lowered lists) with
    each stage's profiled median F / B / I / W (the table above), free transfers, no posting, no sharing.
    The profiled actions carry the profiler's own cost, so a bound is compared with the 1F1B bound of the
    same profiled steps, not with a timed median."""
    from autosplit.cost_model.step_time import StageTimes, predict_step
    bounds, rows = {}, []
    for name in ("ours_1f1b", "ours_zbh1", "ours_interleaved", "ours_zbv"):
        if name not in per_rank[0]["phases"] or name not in st:
            continue
        schedule, chunks, _ = OURS[name]
        times = {k: v for r in per_rank for k, v in action_times(r["phases"][name]).items()}
        stages = [StageTimes(fwd=f, bwd=b or i + w, w=w)
                  for f, b, i, w in ((times.get((s, k), 0.0) for k in "FBIW") for s in range(WORLD * chunks))]
        bounds[name] = predict_step(schedule, WORLD, MICROBATCHES, chunks, stages).total
        base = bounds.get("ours_1f1b")
        target = next((t for o, th, t in COMPARE if o == name and th == "torch_1f1b" and t), "")
        rows.append([LABELS[name], f"{bounds[name]:.3f}", f"{bounds[name] / base:.3f}" if base else "-",
                     f"{st[name]['median'] / st['ours_1f1b']['median']:.3f}" if "ours_1f1b" in st else "-", target])
    return ["Each autosplit schedule at the compute it measured, and nothing else: the cost model's timed run of "
            "the schedule's lowered lists (`cost_model/step_time.predict_step`) with each stage's median F / B / I / W "
            "of the profiled steps (the table above), transfers free, no posting, no sharing. Its ratio to 1F1B's is "
            "the most the schedule can gain at this machine's F : I : W; the timed ratio beside it is what it gained.",
            "", *md_table(["pipeline", "schedule at its profiled compute (s)", "that / autosplit 1f1b's",
                           "timed median / autosplit 1f1b's", "target (of torch Schedule1F1B)"], rows)]


def pingpong_table(per_rank: list[dict]) -> list[str]:
    pp = per_rank[0]["pingpong"]
    rows = []
    for size in ("390 KiB activation", "4-byte tensor"):
        a, b = pp[f"{size}|work.wait()"], pp[f"{size}|Watchdog.wait"]
        rows.append([size, f"{a * 1e3:.3f}", f"{b * 1e3:.3f}", f"{(b - a) / 2 * 1e3:.3f}"])
    return ["Boundary ping-pong between the two ranks (isend then irecv per round trip, each waited at once), per "
            "round trip: what waiting through autosplit's `Watchdog.wait` costs over `work.wait()` (2 waits per "
            "round trip on each rank).", "",
            *md_table(["tensor", "work.wait() (ms)", "Watchdog.wait (ms)", "extra per wait (ms)"], rows)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=15, help="timed steps per configuration (default 15)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per configuration (default 3)")
    p.add_argument("--configs", default=",".join(PIPELINE + SINGLE),
                   help="comma-separated subset of: " + ", ".join(PIPELINE + SINGLE))
    p.add_argument("--no-phases", dest="phases", action="store_false", help="skip the profiled steps and ping-pong")
    p.add_argument("--phase-steps", type=int, default=3, help="profiled steps per pipeline (default 3)")
    p.add_argument("--pingpong", type=int, default=200, help="round trips per ping-pong measurement")
    p.add_argument("--profile", action="store_true", help="also cProfile autosplit's 1f1b steps on each rank")
    p.add_argument("--out", default=None, help="markdown file to update (default docs/benchmarks.md when run with "
                                               "the default --steps/--warmup/--configs, else print only)")
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for the ranks")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if set(args.configs) - set(PIPELINE + SINGLE):
        p.error(f"unknown configurations: {sorted(set(args.configs) - set(PIPELINE + SINGLE))}")
    t0, load = time.perf_counter(), os.getloadavg()[0]
    per_rank = spawn_ranks(run_rank, WORLD, args, args.timeout)
    args.load = (load, os.getloadavg()[0])
    command = " ".join(["python benchmarks/bench_pipeline.py", *(argv if argv is not None else sys.argv[1:])])
    finish(render(per_rank, args, command, time.perf_counter() - t0), args,
           (args.steps, args.warmup, args.configs) == (15, 3, list(PIPELINE + SINGLE)), REPO, START, END)
    for r in per_rank:
        if "cprofile" in r:
            print(f"--- cProfile, rank {r['rank']}, autosplit 1f1b ---\n{r['cprofile']}")
    print("raw step times (s), slowest rank, in order:", {n: [round(t, 3) for t in slowest(per_rank, "times", n)]
                                                          for n in per_rank[0]["times"]})
    print("median first-step losses:", {n: statistics.median(v) for n, v in per_rank[0]["first"].items() if v[0]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
