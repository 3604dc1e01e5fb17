"""The sharding engine: its choice beside Megatron's layout, measured on gloo, and its planning time.

Three parts, one run:
  choice   -- timm's ViT-B/16 on the meta device, one microbatch of 32, tp = 4 and 8 (mesh (1, tp, 1)),
              H100 profile: tp_mode="1d" (Megatron's candidate set: every Linear weight split by rows or
              columns, attention by heads) and tp_mode="auto" (the engine's free choice within the
              device's memory): the predicted step (cost_model/step_time.py, the same predictor for
              both), the bytes one rank sends per step (every collective of the emitted graph, ring
              algorithms), beside Megatron's closed form 4 x 2(p-1)/p x B N C x 4 B per block, the
              parameters per rank, and the layers whose split differs.
  measured -- 2 gloo ranks on this CPU, timm ViT (width 192, depth 6, 8 heads, 32 px, patch 4), batch
              32, SGD, mesh (1, 2, 1): tp_mode "1d" and "auto", interleaved steps, slowest rank.
  planning -- ``autosplit.compile`` wall seconds (median of 3, each in a fresh process) of ViT-B/16 at
              (1, 4, 1) and (1, 8, 1) (the tree before refused it: 12 heads) and a ViT-22B-like model (48 x 6144, 48 heads) at (16, 8, 8), both on the meta
              device, by this tree and by the tree before the engine (commit BEFORE, exported with
              ``git archive``), in the same run.

Run from the repository root:  python benchmarks/bench_engine.py [--steps N] [--no-write]
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from common import cpu_name, mode_rows, spawn_ranks, step_args, tp_mode_steps, write_section

START, END = "<!-- bench_engine:start -->", "<!-- bench_engine:end -->"
REPO = Path(__file__).resolve().parent.parent
BEFORE = "5cc2935"                     # main before issue 34: the region finder and the 2D rule walk
VIT = dict(img_size=32, patch_size=4, embed_dim=192, depth=6, num_heads=8, num_classes=10)
BATCH, LR, WORLD = 32, 0.01, 2


# ---- the choice ----------------------------------------------------------------------------------
def _vit_b_plan(tp: int, mode: str):
    import timm
    import torch
    import autosplit
    with torch.device("meta"):
        model = timm.create_model("vit_base_patch16_224")
    return autosplit.compile(model, mesh=(1, tp, 1), example_input=torch.empty(32, 3, 224, 224, device="meta"),
                             tp_mode=mode, device="h100")


def _sent(node, n: int) -> float:
    """Bytes this rank sends for one collective node, forward + backward (ring algorithms)."""
    import torch
    from autosplit.passes.shape_prop import tensor_bytes
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0.0
    full = float(tensor_bytes(val))
    ring = (n - 1) / n
    fwd, bwd = node.target.comm_kind
    per = {"all_reduce": 2 * ring, "all_gather": ring, "reduce_scatter": ring, None: 0.0}
    scale = full if fwd != "reduce_scatter" else full * n          # a reduce-scatter's output is 1/n of it
    return per.get(fwd, 0.0) * scale + per.get(bwd, 0.0) * (full * n if bwd == "reduce_scatter" else full)


def choice_rows() -> list[str]:
    from autosplit.cost_model.step_time import predict_plan
    rows = []
    B, N, C = 32, 197, 768
    for tp in (4, 8):
        plans = {mode: _vit_b_plan(tp, mode) for mode in ("1d", "auto")}
        lines = {m: dict(line.split(": ", 1) for line in p.tp_plan.regions) for m, p in plans.items()}
        differ = sorted(k for k in lines["1d"] if _kind(lines["1d"][k]) != _kind(lines["auto"].get(k, "")))
        for mode, plan in plans.items():
            step = predict_plan(plan)
            sent = sum(_sent(v, tp) for v in plan.stage_modules(0, 0)[0].graph.nodes
                       if getattr(v.target, "comm_kind", None))
            closed = 12 * 4 * 2 * (tp - 1) / tp * B * N * C * 4
            params = plan.stages[0].param_bytes
            where = "" if mode == "1d" else (", ".join(_short(k, lines) for k in differ[:4]) +
                                             (f" (+{len(differ) - 4})" if len(differ) > 4 else "")) or "same"
            rows.append(f"| {tp} | {mode} | {step.total * 1e3:.2f} | {step.compute * 1e3:.2f} | "
                        f"{(step.total - step.compute) * 1e3:.2f} | {sent / 2**20:.0f} | {closed / 2**20:.0f} | "
                        f"{params / 2**20:.1f} | {where} |")
    return rows


def _kind(line: str) -> str:
    """'column', 'row', 'whole', 'by dim 1 ...', 'split on dim 1 ...': how a layer runs, without the why."""
    return line.split(":")[0].split(",")[0].split(" (")[0].strip()


def _short(layer: str, lines: dict) -> str:
    return f"{layer}: {_kind(lines['1d'][layer])} -> {_kind(lines['auto'][layer])}"


# ---- measured ------------------------------------------------------------------------------------
def run_rank(rank: int, args) -> dict:
    from timm.models import VisionTransformer
    return tp_mode_steps(lambda: VisionTransformer(**VIT), (1, WORLD, 1), ("1d", "auto"), args, BATCH, LR)


def measured_rows(args) -> list[str]:
    os.environ["AUTOSPLIT_TIMEOUT"] = "600"
    per_rank = spawn_ranks(run_rank, WORLD, args, timeout=3600)
    first = per_rank[0]["first"]
    assert all(abs(a - b) < 1e-4 for a, b in zip(first["1d"][:2], first["auto"][:2])), first
    return mode_rows(per_rank, ("1d", "auto"))


# ---- planning time -------------------------------------------------------------------------------
PLAN_SCRIPT = r"""
import sys, time, json
root = sys.argv[1]
if root != "-":       # the exported tree first, ahead of the editable install's finder
    sys.meta_path = [f for f in sys.meta_path if "editable" not in type(f).__name__.lower()]
    sys.path.insert(0, root)
import torch, timm
import autosplit
assert root == "-" or autosplit.__file__.startswith(root), autosplit.__file__
name = sys.argv[2]
with torch.device("meta"):
    if name.startswith("vit_b"):
        tp = int(name.split("_tp")[1])
        model, mesh, x = timm.create_model("vit_base_patch16_224"), (1, tp, 1), torch.empty(32, 3, 224, 224)
    else:
        model = timm.models.VisionTransformer(img_size=224, patch_size=14, embed_dim=6144, depth=48, num_heads=48,
                                              mlp_ratio=4, num_classes=1000)
        mesh, x = (16, 8, 8), torch.empty(8, 3, 224, 224)
t = time.perf_counter()
try:
    autosplit.compile(model, mesh=mesh, example_input=x.to("meta"), device="h100")
except autosplit.AutosplitError as exc:
    print(json.dumps(str(exc).splitlines()[0][:120]))
    raise SystemExit(0)
print(json.dumps(time.perf_counter() - t))
"""


def _export_before(dest: Path) -> Path:
    """The tree at BEFORE laid out as the installed package: autosplit/, with passes/ and cost_model/ inside."""
    tar = dest / "before.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(tar), BEFORE], check=True)
    with tarfile.open(tar) as t:
        t.extractall(dest / "src", filter="data")
    pkg = dest / "pkg"
    pkg.mkdir()
    (dest / "src" / "autosplit").rename(pkg / "autosplit")
    for sub in ("passes", "cost_model"):
        (dest / "src" / sub).rename(pkg / "autosplit" / sub)
    return pkg


def planning_rows() -> list[str]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        before = _export_before(Path(tmp))
        for name, label in (("vit_b_tp4", "ViT-B/16, (1, 4, 1)"), ("vit_b_tp8", "ViT-B/16, (1, 8, 1)"),
                            ("vit_22b", "ViT-22B-like, (16, 8, 8)")):
            times = {}
            for tree, root in (("before", str(before)), ("engine", "-")):
                runs = []
                for _ in range(3):
                    out = subprocess.run([sys.executable, "-c", PLAN_SCRIPT, root, name], capture_output=True,
                                         text=True, cwd=tmp, timeout=1800)
                    if out.returncode:
                        raise RuntimeError(out.stderr[-2000:])
                    runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
                    if isinstance(runs[-1], str):       # refused: once is enough
                        break
                times[tree] = runs[-1] if isinstance(runs[-1], str) else statistics.median(runs)
            b, e = times["before"], times["engine"]
            ratio = f"{e / b:.2f}" if isinstance(b, float) and isinstance(e, float) else "-"
            show = lambda t: f"{t:.2f}" if isinstance(t, float) else f"refused: {t}"   # noqa: E731
            rows.append(f"| {label} | {show(b)} | {show(e)} | {ratio} |")
    return rows


def main() -> None:
    args = step_args()
    load = os.getloadavg()[0]
    choice, planning, measured = choice_rows(), planning_rows(), measured_rows(args)
    section = "\n".join([
        START, "## The sharding engine's choice (`benchmarks/bench_engine.py`)", "",
        f"{datetime.date.today()}, {cpu_name()}, load average {load:.1f} at the start.", "",
        "ViT-B/16 planned on the meta device, one microbatch of 32, mesh (1, tp, 1), H100 profile. `1d` is "
        "Megatron's candidate set (every Linear weight split, attention by heads); `auto` is the engine's free "
        "choice within the device's memory. Step: the plan's predicted step (ms); sent: MiB one tp rank sends "
        "per step, every collective of its graph (forward + backward, ring); closed form: Megatron's "
        "4 x 2(p-1)/p x BNC x 4 B per block x 12 blocks:", "",
        "| tp | mode | predicted step | compute | comm + bubble | MiB sent | Megatron closed form | "
        "params per rank (MiB) | where auto differs from 1d |", "|---|---|---|---|---|---|---|---|---|",
        *choice, "",
        "At tp = 8 ViT-B's 12 heads do not divide: under `1d` the attention stays whole (its reason in the "
        "plan's summary) and only the MLPs split, hence half the closed form's bytes. `auto` is never slower "
        "by the predictor; it keeps the classifier head whole (a gather of 32 x 1000 logits costs more than "
        "its quarter of a 768 x 1000 GEMM saves) at 2-3 MiB more parameters per rank.", "",
        f"Step time, {WORLD} gloo ranks on this CPU, ViT width 192 depth 6, batch {BATCH}, mesh (1, {WORLD}, 1), "
        f"{args.steps} steps each, interleaved (ms, slowest rank):", "",
        "| run | median | p10 | p90 | vs 1d |", "|---|---|---|---|---|", *measured, "",
        f"Planning time, `autosplit.compile` on the meta device (s, median of 3 fresh processes), the tree before "
        f"the engine (`{BEFORE}`) and this one:", "",
        "| model, mesh | before | engine | ratio |", "|---|---|---|---|", *planning, "", END, ""])
    print(section)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", section, START, END)


if __name__ == "__main__":
    main()
