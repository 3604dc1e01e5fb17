"""Benchmark autosplit's 1D tensor parallelism against DTensor's ``parallelize_module``, side by side, on CPU.

Two gloo ranks (one thread each) train timm's VisionTransformer(img_size=32, patch_size=4,
embed_dim=192, depth=12, num_heads=6, num_classes=10) on a batch of 64, SGD, fp32, cross-entropy:

  dtensor  -- ``init_device_mesh("cpu", (2,))`` and ``parallelize_module`` on every block:
              ``ColwiseParallel`` for ``attn.qkv`` and ``mlp.fc1``, ``RowwiseParallel`` for ``attn.proj``
              and ``mlp.fc2`` (Megatron's plan, written the way DTensor's tutorials write it).
  ours     -- ``autosplit.parallelize(model, mesh=(1, 2, 1), num_microbatches=1, schedule="1f1b")``
              and ``pm.step(x, y)``: the backward all-reduce of each column-parallel entry's input
              gradient runs while the weight-gradient GEMMs compute (issue 11).
  ours_fwd -- the same with ``tp_overlap_chunks=2``: the forward all-reduces also overlap the other
              row chunk's compute (passes/tp_overlap.py).
  ours_fused -- ``tp_collectives.OVERLAP_BACKWARD = False`` at build time: the fused backward, nothing
              overlapped (the "before").  For all three, ``tp_collectives.EXPOSED`` (seconds waited in
              tp collectives) per step: the exposed communication.
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

Timing: ``common.rotate`` (3 warm-up steps of each, then blocks of ``--block`` steps of each, the order
rotated every round, each step after a barrier); a step is the slowest rank's forward + backward +
``opt.step()`` + ``opt.zero_grad()``.

If autosplit's ``parallelize`` fails, the section reports DTensor alone, with the error.  ``--probe``: only
try a tiny mesh (1, 2, 1) ``parallelize``; ``--profile``: a cProfile of autosplit's steps (printed).

Run from the repository root:  python benchmarks/bench_tp.py             (writes docs/benchmarks.md)
                               python benchmarks/bench_tp.py --steps 5   (quicker, print only)
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

from common import (finish, machine_lines, md_table, paired_ratio, profile_steps, rotate, slowest, spawn_ranks,
                    step_stats, train_step)

START, END = "<!-- bench_tp:start -->", "<!-- bench_tp:end -->"
REPO = Path(__file__).resolve().parent.parent
WORLD = TP = 2
BATCH, LR = 64, 0.01
VIT = dict(img_size=32, patch_size=4, embed_dim=192, depth=12, num_heads=6, num_classes=10)
CHECK_TOL = 1e-5
N_TOKENS = (VIT["img_size"] // VIT["patch_size"]) ** 2 + 1

CONFIGS = ("ours", "ours_fwd", "ours_fused", "dtensor", "single")
LABELS = {
    "ours": "autosplit tp=2 (mesh (1, 2, 1))",
    "ours_fwd": "autosplit tp=2, forward overlapped too (tp_overlap_chunks=2)",
    "ours_fused": "autosplit tp=2, nothing overlapped",
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
        out["loss"] = pm.step(x, y)
    except Exception as exc:  # noqa: BLE001
        out["unavailable"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return out


def run_rank(rank: int, args) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    torch.manual_seed(0)
    base = build_model()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 3, 32, 32, generator=gen)
    y = torch.randint(0, VIT["num_classes"], (BATCH,), generator=gen)
    loss_fn = torch.nn.CrossEntropyLoss()
    with torch.no_grad():
        reference = float(loss_fn(base(x), y))
    mesh = init_device_mesh("cpu", (TP,))
    dt_model = dtensor_model(base, mesh)
    with torch.no_grad():
        dt_loss = float(loss_fn(dt_model(x), y))
    out: dict = {"rank": rank, "dtensor_check": {"dtensor": dt_loss, "single": reference,
                                                 "abs_diff": abs(dt_loss - reference)}}
    if args.check_naive:                    # the plan without the reordering, to show what it gets wrong
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        naive = copy.deepcopy(base)
        for block in naive.blocks:
            block.attn.num_heads //= TP
            block.attn.attn_dim //= TP
            parallelize_module(block, mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                             "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})
        with torch.no_grad():
            out["naive_loss"] = float(loss_fn(naive(x), y))

    def plain_step(model):
        """A step of ``model`` the plain way: loss, backward, ``opt.step()``, ``opt.zero_grad()``."""
        def forward_backward():
            loss = loss_fn(model(x), y)
            loss.backward()
            return float(loss.detach())
        return train_step(forward_backward, torch.optim.SGD(model.parameters(), lr=LR))
    steps = {"dtensor": plain_step(dt_model)}
    out["local_params"] = {"dtensor": sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                                          for p in dt_model.parameters()),
                           "single": sum(p.numel() for p in base.parameters())}
    out["ours_error"] = None
    try:
        import autosplit
        from autosplit.runtime.parallel import tp_collectives
        for name, overlap, chunks in (("ours_fwd", True, 2), ("ours_fused", False, 1), ("ours", True, 1)):
            tp_collectives.OVERLAP_BACKWARD = overlap         # read at build time; False: the fused backward
            pm = autosplit.parallelize(copy.deepcopy(base), mesh=(1, TP, 1), loss_fn=torch.nn.CrossEntropyLoss(),
                                       num_microbatches=1, schedule="1f1b", example_input=x,
                                       tp_overlap_chunks=chunks)
            steps[name] = train_step(lambda pm=pm: float(pm.step(x, y)), torch.optim.SGD(pm.parameters(), lr=LR))
        tp_collectives.OVERLAP_BACKWARD = True
        out["local_params"]["ours"] = sum(p.numel() for p in pm.parameters())
        del pm
    except Exception as exc:  # noqa: BLE001 - recorded, the benchmark goes on with DTensor alone
        out["ours_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    if not _agree(out["ours_error"] is None):
        out["ours_error"] = out["ours_error"] or "autosplit.parallelize failed on another rank"
        for name in ("ours", "ours_fwd", "ours_fused"):
            steps.pop(name, None)
    steps["single"] = plain_step(copy.deepcopy(base)) if rank == 0 else (lambda: None)   # rank 1 only waits
    configs = [c for c in CONFIGS if c in steps and c in args.configs]

    def probe():        # seconds waited in tp collectives, and how many all-reduces ran
        from autosplit.runtime.parallel.tp_collectives import COUNTS, EXPOSED
        comm = (("copy", "bwd"), ("all_reduce", "fwd"), ("grad_all_reduce", "bwd"))   # the calls that all-reduce
        return {**EXPOSED, "all_reduces": sum(COUNTS[k] for k in comm)}
    out.update(rotate(steps, configs, args.warmup, args.steps, args.block,
                      probe=probe if out["ours_error"] is None else None))
    out["allreduce_ms"] = allreduce_cost(torch.zeros(BATCH, N_TOKENS, VIT["embed_dim"]), args.pingpong)
    if args.profile and "ours" in steps:
        out["cprofile"] = profile_steps(steps["ours"], 3, ("tottime", 25), ("cumulative", 25))
    return out


def allreduce_cost(x, n: int) -> float:
    """Milliseconds per plain gloo all-reduce of ``x`` (clone + all_reduce + work.wait()), both ranks."""
    import torch.distributed as dist
    dist.barrier()
    t = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(x.clone(), async_op=True).wait()
    return (time.perf_counter() - t) / n * 1e3


# ------------------------------------------------------------------------------------- driver

def checks(per_rank: list[dict]) -> list[tuple[str, str, str, bool | None]]:
    """(what, value, target, passed) rows."""
    dc = per_rank[0]["dtensor_check"]
    diff = max(abs(r["dtensor_check"]["abs_diff"]) for r in per_rank)
    rows = [("DTensor (qkv reordered) vs single device, loss on the first batch, max over ranks",
             f"{diff:.1e} ({dc['dtensor']:.6f} vs {dc['single']:.6f})", f"<= {CHECK_TOL:g}", diff <= CHECK_TOL)]
    if "naive_loss" in per_rank[0]:
        rows.append(("DTensor without the reordering (contiguous qkv split), same loss difference",
                     f"{abs(per_rank[0]['naive_loss'] - dc['single']):.1e} ({per_rank[0]['naive_loss']:.6f})",
                     "(shows the plan is wrong)", None))
    first = per_rank[0]["first"]            # every rank returns the global loss; single runs on rank 0
    for name in ("dtensor", "ours", "ours_fwd", "ours_fused"):
        for i, (a, b) in enumerate(zip(first.get(name, []), first.get("single", []))):
            rows.append((f"{LABELS[name]} vs single device, loss of step {i + 1}", f"{abs(a - b):.1e}", "<= 1e-4",
                         abs(a - b) <= 1e-4))
    return rows


def render(per_rank: list[dict], args, command: str, total_s: float) -> str:
    names = [c for c in CONFIGS if c in per_rank[0]["times"]]
    st = {n: {**step_stats(slowest(per_rank, "times", n, n == "single")),
              "cpu": statistics.median(slowest(per_rank, "cpu", n, n == "single"))} for n in names}
    err, first = per_rank[0]["ours_error"], per_rank[0]["first"]
    lines = [START, "## 1D tensor parallelism: autosplit vs DTensor (`benchmarks/bench_tp.py`)", "",
             *machine_lines(command, total_s, args.load, "timm"),
             f"- Model: timm `VisionTransformer({', '.join(f'{k}={v}' for k, v in VIT.items())})`, fp32, SGD "
             f"lr={LR}, cross-entropy, batch {BATCH}; {WORLD} gloo ranks, 1 thread each.",
             "- DTensor: `init_device_mesh(\"cpu\", (2,))`, `parallelize_module` on each block with `ColwiseParallel` "
             "for `attn.qkv`, `mlp.fc1` and `RowwiseParallel` for `attn.proj`, `mlp.fc2`; before that, as a careful "
             "user must, each fused qkv weight/bias is row-permuted from (3, heads, head_dim) to (rank, 3, local "
             "heads, head_dim) so the contiguous split gives each rank whole heads, and each block's "
             "`attn.num_heads` / `attn.attn_dim` are set to the local values (timm's reshape uses them).",
             "- autosplit: `autosplit.parallelize(model, mesh=(1, 2, 1), num_microbatches=1, schedule=\"1f1b\", "
             "example_input=x)`, `pm.step(x, y)`, SGD over `pm.parameters()`; the two other autosplit rows add "
             "the forward overlap (`tp_overlap_chunks=2`) or take out the backward one."
             + (f" **Not available in this run**: `{err}`." if err else ""),
             f"- Step = forward + backward + `opt.step()` + `opt.zero_grad()`, after a barrier; time of the slowest "
             f"rank (single device: rank 0, the other rank waits). {args.warmup} warm-up steps each, then "
             f"{args.steps} timed steps each, in blocks of {args.block} (order rotated every round). *CPU s*: "
             "median of the busiest rank's process CPU time per step (less sensitive to other load, blind to "
             "waiting).", ""]
    params = per_rank[0]["local_params"]
    lines += md_table(["configuration", "median (s)", "p10 (s)", "p90 (s)", "CPU s (median)", "steps",
                       "loss after step 1", "local params (rank 0)"],
                      [[LABELS[n], f"{st[n]['median']:.3f}", f"{st[n]['p10']:.3f}", f"{st[n]['p90']:.3f}",
                        f"{st[n]['cpu']:.3f}", st[n]["n"], f"{first[n][0]:.6f}" if first.get(n) else "",
                        f"{params[n] / 1e6:.2f} M" if n in params else ""] for n in names])
    rows = []
    if "ours" in st and "dtensor" in st:
        rows += [["autosplit / DTensor (median step)", f"{st['ours']['median'] / st['dtensor']['median']:.3f}",
                  "<= 0.90"],
                 ["autosplit / DTensor, median of per-round ratios",
                  f"{paired_ratio(slowest(per_rank, 'times', 'ours'), slowest(per_rank, 'times', 'dtensor')):.3f}",
                  "<= 0.90"],
                 ["autosplit / DTensor (median CPU s of the busiest rank)",
                  f"{st['ours']['cpu'] / st['dtensor']['cpu']:.3f}", ""]]
    rows += [[f"speed-up over single device: {LABELS[n]}", f"{st['single']['median'] / st[n]['median']:.2f} x",
              "(ideal 2 x)"] for n in ("ours", "dtensor") if n in st and "single" in st]
    for a, b, what in (("ours", "ours_fused", "backward overlapped / not (forward not overlapped)"),
                       ("ours_fwd", "ours", "forward overlapped / not (both with the backward overlapped)")):
        if a in st and b in st:
            rows.append([f"autosplit {what} (median step)", f"{st[a]['median'] / st[b]['median']:.3f}", ""])
    for name in ("ours_fused", "ours", "ours_fwd"):
        for kind, what in (("input_grad", "entries' input-gradient all-reduces (backward)"),
                           ("other", "all other tp collectives")):
            if per_rank[0]["probe"].get(name):
                vals = [statistics.median(e.get(kind, 0.0) for e in r["probe"][name]) for r in per_rank]
                rows.append([f"{LABELS[name]}: exposed wait per step, {what} (s, rank 0 / rank 1)",
                             " / ".join(f"{v:.4f}" for v in vals), ""])
    rows += [[what, value + ("" if ok is None else " (ok)" if ok else " (**FAILED**)"), target]
             for what, value, target, ok in checks(per_rank)]
    lines += ["", *md_table(["comparison", "value", "target"], rows)]
    ar = max(r["allreduce_ms"] for r in per_rank)
    lines += ["", f"A plain gloo all-reduce of one {BATCH}x{N_TOKENS}x{VIT['embed_dim']} fp32 activation "
                  f"({BATCH * N_TOKENS * VIT['embed_dim'] * 4 / 2**20:.1f} MiB), alone: {ar:.2f} ms. Megatron's "
                  f"minimum is 4 per block (2 forward, 2 backward), the same for DTensor's plan."]
    if per_rank[0]["probe"].get("ours_fused") and "single" in st:     # unchunked: whole-activation all-reduces
        n_ar = statistics.median(e["all_reduces"] for e in per_rank[0]["probe"]["ours_fused"])
        floor = st["single"]["median"] / TP + n_ar * ar / 1e3
        lines.append(f"Without overlapping communication and compute, a step cannot beat single-device time / {TP} "
                     f"+ {n_ar:.0f} x {ar:.2f} ms = {floor:.3f} s (replicated layers not even counted).")
    return "\n".join(lines + ["", END]) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=15, help="timed steps per configuration (default 15)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per configuration (default 3)")
    p.add_argument("--block", type=int, default=1, help="consecutive timed steps of one configuration (default 1)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    p.add_argument("--no-naive-check", dest="check_naive", action="store_false",
                   help="skip showing the loss of DTensor's plan without the qkv reordering")
    p.add_argument("--pingpong", type=int, default=50, help="plain all-reduces timed for the reference cost")
    p.add_argument("--profile", action="store_true", help="also cProfile 3 autosplit steps on each rank (printed)")
    p.add_argument("--probe", action="store_true",
                   help="only try a tiny autosplit parallelize with mesh (1, 2, 1); exit 0 if it works")
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for the ranks")
    p.add_argument("--out", default=None, help="markdown file to update (default docs/benchmarks.md when run with "
                                               "the default --steps/--warmup/--configs, else print only)")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.probe:
        per_rank = spawn_ranks(probe_rank, WORLD, args, args.timeout)
        bad = [r["unavailable"] for r in per_rank if r.get("unavailable")]
        print(f"autosplit tp=2: not available: {bad[0]}" if bad else
              f"autosplit tp=2: works (loss {per_rank[0]['loss']:.6f}, single device {per_rank[0]['reference']:.6f})")
        return 1 if bad else 0
    t0, load = time.perf_counter(), os.getloadavg()[0]
    per_rank = spawn_ranks(run_rank, WORLD, args, args.timeout)
    args.load = (load, os.getloadavg()[0])
    command = " ".join(["python benchmarks/bench_tp.py", *(argv if argv is not None else sys.argv[1:])])
    finish(render(per_rank, args, command, time.perf_counter() - t0), args,
           (args.steps, args.warmup, args.configs) == (15, 3, list(CONFIGS)), REPO, START, END)
    for r in per_rank:
        if r.get("cprofile"):
            print(f"--- cProfile, autosplit steps, rank {r['rank']} ---\n{r['cprofile']}")
    return 1 if any(c[3] is False for c in checks(per_rank)) else 0


if __name__ == "__main__":
    sys.exit(main())
