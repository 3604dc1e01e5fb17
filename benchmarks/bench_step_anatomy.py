"""Where one training step's time goes on this CPU, beside what the cost model predicts for it (issue 14).

One configuration (default: timm ViT width 192, depth 6, 6 heads, 32 px, batch 16, mesh (2, 1, 1), 1F1B,
4 microbatches; the cost model's accuracy benchmark's "pp2 1f1b m4"; ``--mesh 1,2,1 --microbatches 2`` is
its "tp2 m2") on pp x tp x dp gloo ranks, one thread each, planned with this machine's measured profile
fitted to the model (as bench_cost_model.py does). Terms:

  action      -- one F / B (I / W) of the running pipeline, timed by wrapping the executor's per-action
                 call: its wall time, and its *net* time (minus the receive wait and the tensor-parallel
                 collective waits inside it).
  collectives -- per step, the time the rank waited in tensor-parallel collectives
                 (``tp_collectives.EXPOSED``), beside the prediction's exposed communication.
  isolated    -- the same stage module's forward (with grad) and backward, on the same rank, outside the
                 pipeline: ``back to back`` (one microbatch, nothing between passes), ``after waits``
                 (two microbatches in flight, a 5 ms sleep before each pass, as a pipeline rank waits),
                 once with the other ranks idle and once with every rank doing it at once (pp only: a
                 tensor-parallel stage cannot run without its peers).
  outside     -- per step, the time before the rank's first action (the call check's all-gather, input
                 checks) and after its last (the sends' final waits, the loss all-reduce), and the time
                 spent posting transfer groups (``[...]`` items of the schedule).
  predicted   -- ``predict_plan``: the stage's F / B per microbatch and the step (cost_model/step_time.py).

Timing: after 3 warm-up steps, ``--steps`` steps each after a barrier; medians.  Prints a table; writes
nothing (docs/benchmarks.md quotes its runs by hand).

Run from the repository root:  python benchmarks/bench_step_anatomy.py [--schedule zb-h1] [--microbatches 8]
[--mesh 1,2,1] [--sequence-parallel]
"""
from __future__ import annotations

import argparse
import statistics
import time

from common import md_table, spawn_ranks

VIT = dict(img_size=32, patch_size=4, embed_dim=192, depth=6, num_heads=6, num_classes=10)
BATCH = 16


def _median_ms(xs) -> float:
    return statistics.median(xs) * 1e3 if xs else float("nan")


def _isolated(mod, inp, y, first: bool, last: bool, in_flight: int, sleep: float, reps: int = 8) -> tuple[float, float]:
    """Median ms of the stage's forward (with grad) and backward passes, ``in_flight`` forwards before
    their backwards, ``sleep`` seconds before each pass; the inputs require grad as the pipeline's do
    (every stage's but the first)."""
    import torch
    fs, bs = [], []
    for _ in range(reps):
        held = []
        for _ in range(in_flight):
            time.sleep(sleep)
            t0 = time.perf_counter()
            xs = [t.detach().requires_grad_(not first and t.is_floating_point()) for t in inp]
            held.append((xs, mod(*xs)))
            fs.append(time.perf_counter() - t0)
        for xs, out in held:
            time.sleep(sleep)
            t0 = time.perf_counter()
            if last:
                torch.nn.functional.cross_entropy(out[0], y).backward()
            else:
                torch.autograd.backward(list(out), [torch.ones_like(o) for o in out])
            bs.append(time.perf_counter() - t0)
    return _median_ms(fs), _median_ms(bs)


def _rank(rank: int, args: dict) -> dict:
    import torch
    import torch.distributed as dist
    import timm
    import autosplit
    from autosplit.cost_model.step_time import plan_deferred_w_stages, predict_plan
    from autosplit.runtime.parallel import tp_collectives
    m, mesh = args["microbatches"], args["mesh"]
    rows = BATCH // mesh[2]                                  # this replica's batch
    torch.manual_seed(0)
    pm = autosplit.parallelize(timm.models.VisionTransformer(**VIT), mesh=mesh, num_microbatches=m,
                               schedule=args["schedule"], chunks_per_rank=args["chunks"],
                               sequence_parallel=args["sequence_parallel"],
                               device=args["profile"], example_input=torch.randn(rows // m, 3, 32, 32))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    x, y = x[pm.dp_rank * rows:(pm.dp_rank + 1) * rows], y[pm.dp_rank * rows:(pm.dp_rank + 1) * rows]
    for _ in range(3):
        pm.step(x, y)
    ex, plan = pm.executor, pm.plan
    stage = [s for s in range(plan.n_stages) if s in ex.modules][0]
    last = stage == plan.n_stages - 1
    iso = {}
    if mesh[1] == 1:            # a tensor-parallel stage runs collectives: it cannot be timed alone
        inp = [x[:rows // m]] if stage == 0 else [torch.randn(t.shape) for t in plan.stages[stage].inputs]
        every = "both ranks" if dist.get_world_size() == 2 else "every rank"
        for who in [*range(dist.get_world_size()), None]:       # each rank alone in turn, then all at once
            label = "alone" if who is not None else every
            for in_flight, sleep, how in ((1, 0.0, "back to back"), (2, 0.005, "after waits")):
                dist.barrier()
                if who is None or who == rank:
                    run = (ex.modules[stage], inp, y[:rows // m], stage == 0, last, in_flight, sleep)
                    _isolated(*run, reps=2)                                    # warm-up
                    iso[f"{how}, {label}"] = _isolated(*run)
                dist.barrier()
    # the running step: per action wall and net time, posting, collectives, before / after the actions
    log, waits = [], [0.0]
    take, guarded = ex._take, ex._guarded

    def timed_take(box, key):
        t0 = time.perf_counter()
        try:
            return take(box, key)
        finally:
            waits[0] += time.perf_counter() - t0

    def timed_guarded(item, fn):
        waits[0] = 0.0
        exposed = sum(tp_collectives.EXPOSED.values())
        t0 = time.perf_counter()
        guarded(item, fn)
        collective = sum(tp_collectives.EXPOSED.values()) - exposed
        log.append((str(item), t0, time.perf_counter() - t0, waits[0], collective))
    ex._take, ex._guarded = timed_take, timed_guarded
    steps, before, after, posting, net, computing, waiting, collectives = [], [], [], [], {}, [], [], []
    for _ in range(args["steps"]):
        log.clear()
        dist.barrier()
        t0 = time.perf_counter()
        pm.step(x, y)
        t1 = time.perf_counter()
        steps.append(t1 - t0)
        computes = [e for e in log if not e[0].startswith("[")]
        before.append(computes[0][1] - t0)
        end_of_last = computes[-1][1] + computes[-1][2]
        after.append(t1 - end_of_last)
        posting.append(sum(e[2] for e in log if e[0].startswith("[") and e[1] < end_of_last))
        for name, _, d, w, c in computes:
            net.setdefault(name.lstrip("0123456789")[0], []).append(d - w - c)
        computing.append(sum(d - w - c for _, _, d, w, c in computes))
        waiting.append(sum(w for _, _, _, w, _ in computes))
        collectives.append(sum(c for *_, c in computes))
    ex._take, ex._guarded = take, guarded
    s = plan.stages[stage]
    pred = predict_plan(plan, device=args["profile"])
    # a zero-bubble stage the runtime keeps fused runs its whole backward in I (and W finds nothing)
    w = s.w_time if stage in plan_deferred_w_stages(plan, args["profile"]) else 0.0
    return {"stage": stage, "steps": steps, "iso": iso, "before": _median_ms(before), "after": _median_ms(after),
            "posting": _median_ms(posting), "net": {k: _median_ms(v) for k, v in net.items()},
            "computing": _median_ms(computing), "waiting": _median_ms(waiting),
            "collectives": _median_ms(collectives),
            "pred": {"F": s.fwd_time * 1e3, "B": s.bwd_time * 1e3, "I": (s.bwd_time - w) * 1e3, "W": w * 1e3, "step": pred.total * 1e3, "compute": pred.compute * 1e3,
                     "bubble": pred.bubble * 1e3, "exposed": pred.exposed_comm * 1e3}}


def main() -> None:
    import torch
    import timm
    from autosplit.cost_model import profile_cache
    from autosplit.cost_model.model_fit import fit_to_model
    from autosplit.profiling.measure_profile import measure_here
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=1, help="chunks_per_rank (interleaved, zb-v: 2)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--mesh", type=lambda v: tuple(int(k) for k in v.split(",")), default=(2, 1, 1),
                    help="pp,tp,dp (default 2,1,1)")
    ap.add_argument("--sequence-parallel", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    world = args.mesh[0] * args.mesh[1] * args.mesh[2]
    key = profile_cache.machine_key("cpu", world)
    key["threads"] = 1
    profile = profile_cache.load(key) or measure_here(world, threads=1)
    with torch.device("meta"):
        model = timm.models.VisionTransformer(**VIT)
    profile = fit_to_model(profile, model, torch.empty(1, 3, 32, 32), sizes=(2, 8))[0]
    print(profile.name)
    per_rank = spawn_ranks(_rank, world, {**vars(args), "profile": profile}, timeout=1800)
    slowest = [max(r["steps"][i] for r in per_rank) for i in range(args.steps)]
    print(f"\nstep: measured {_median_ms(slowest):.1f} ms (slowest rank, median of {args.steps}), "
          f"predicted {per_rank[0]['pred']['step']:.1f} ms\n")
    head = ["rank (stage)", "action", "predicted ms", "in the step, net of waits"]
    rows = [[f"{rank} ({r['stage']})", kind, f"{r['pred'][kind]:.2f}", f"{ms:.2f}"]
            + [f"{v[0 if kind == 'F' else 1]:.2f}" if kind in "FB" else "-" for v in r["iso"].values()]
            for rank, r in enumerate(per_rank) for kind, ms in sorted(r["net"].items())]
    print("\n".join(md_table(head + [f"isolated: {k}" for k in per_rank[0]["iso"]], rows)))
    print(f"\npredicted for the slowest rank: {predict_plan_parts(per_rank[0])}")
    print("\nms per step, medians:")
    print("\n".join(md_table(
        ["rank", "before its first action", "computing (actions net of waits)", "waiting for receives",
         "waiting in tp collectives", "posting groups", "after its last action"],
        [[rank] + [f"{r[k]:.2f}" for k in ("before", "computing", "waiting", "collectives", "posting", "after")]
         for rank, r in enumerate(per_rank)])))

def predict_plan_parts(r: dict) -> str:
    """The prediction's parts for the slowest rank, as one line (ms)."""
    p = r["pred"]
    return (f"compute {p['compute']:.1f}, bubble {p['bubble']:.1f}, exposed comm {p['exposed']:.1f} ms "
            f"(step {p['step']:.1f})")


if __name__ == "__main__":
    main()
