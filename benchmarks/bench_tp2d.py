"""1D (Megatron) vs 2D (SUMMA / Optimus) tensor parallelism: memory, communication and step time.

Three parts, one run:
  memory  -- timm's ViT-B/16 built on the meta device, one microbatch of 32 images, tp = 4, planned
             with tp_mode="1d" and "2d": parameter bytes and saved-activation bytes per tp rank (the
             plan's own accounting), beside single-device (tp = 1), and the cost model's compute and
             tensor-parallel communication times (H100 profile, alpha-beta per group).
  comm    -- collectives per transformer block, counted from tp rank 0's emitted graph (ViT-B/16, tp
             = 4 and 16), with the bytes each rank moves per training step (forward + backward, ring
             algorithms), beside the closed forms: 1D moves 4 x 2(P-1)/P x (B N C) per block (two
             all-reduces forward, two backward); 2D moves, per linear with blocks X (activation) and
             W (weight), 3 (q-1)(X + W) (gathers forward, re-gathers and two reduce-scatters backward),
             i.e. 6(q-1)/q of the (B/q N C + C^2 / q)-sized operands counted once each way.
  time    -- 4 gloo ranks on this CPU, timm ViT (width 192, depth 12, 8 heads so that 1D at tp = 4 divides them, 32 px, patch 4), batch
             64, SGD: mesh (1, 4, 1) with tp_mode="1d" and "2d", rotated step by step (common.rotate), slowest rank.

Run from the repository root:  python benchmarks/bench_tp2d.py [--steps N] [--no-write]
"""
from __future__ import annotations

import datetime
import os
from pathlib import Path

from common import cpu_name, mode_rows, spawn_ranks, step_args, tp_mode_steps, write_section

START, END = "<!-- bench_tp2d:start -->", "<!-- bench_tp2d:end -->"
REPO = Path(__file__).resolve().parent.parent
VIT = dict(img_size=32, patch_size=4, embed_dim=192, depth=12, num_heads=8, num_classes=10)   # 8 heads: tp=4 in 1D
BATCH, LR, WORLD = 64, 0.01, 4
WHY = """Why 2D is slower on CPU: at q = 2 a rank sends about as many bytes as in 1D (the table above), but in
24 collectives per block instead of 4 (each `linear_2d` gathers x and w forward, re-gathers both and
reduce-scatters both gradients backward, since only blocks are saved; plus the norm and bias gathers
and the layer-norm statistics), and gloo has no reduce-scatter (an all-reduce plus a slice: twice the
bytes). 2D pays off where memory does: a quarter of the parameters and saved activations per rank, and
heads divisible by q rather than by tp.
"""


def _vit_b_plan(tp: int, mode: str, batch: int = 32):
    import timm
    import torch
    import autosplit
    with torch.device("meta"):
        model = timm.create_model("vit_base_patch16_224")
    return autosplit.compile(model, mesh=(1, tp, 1), example_input=torch.empty(batch, 3, 224, 224, device="meta"),
                             tp_mode=mode, device="h100")


def _moved(node, q_or_p: int) -> tuple[str, float]:
    """(op, bytes this rank sends per step) for one collective node of an emitted graph."""
    from autosplit.passes.shape_prop import tensor_bytes
    name, n = node.target.__name__, q_or_p
    x = tensor_bytes(node.args[0].meta["val"])
    if name == "linear_2d":
        w = tensor_bytes(node.args[1].meta["val"])
        return name, 3 * (n - 1) * (x + w)
    if name in ("all_reduce", "copy_to_axis"):
        return name, 2 * (n - 1) / n * x
    if name in ("all_gather", "gather"):
        return name, (n - 1) * x * (2 if name == "all_gather" else 1)     # + reduce-scatter backward
    if name == "layer_norm_2d":
        rows = node.meta["val"].numel() // node.meta["val"].shape[-1] * 4
        return name, 2 * 2 * 2 * (n - 1) / n * rows                        # 2 stats, fwd + bwd
    return name, 0.0


def comm_rows() -> list[str]:
    """Per tp and mode: the block's collectives, MiB moved in all and by the Megatron all-reduces /
    the linear_2d ops alone, and the closed form for the latter."""
    rows = []
    B, N, C = 32, 197, 768
    for tp in (4, 16):
        for mode in ("1d", "2d"):
            try:
                plan = _vit_b_plan(tp, mode)
            except Exception as exc:   # 1D at tp=16: ViT-B's 12 heads do not divide by 16 (2D needs 4)
                rows.append(f"| {tp} | {mode} | refused: {str(exc).split(';')[0]} | | | |")
                continue
            n = tp if mode == "1d" else round(tp ** 0.5)
            counts, total, main = {}, 0.0, 0.0
            for node in plan.stage_modules(0, 0)[0].graph.nodes:
                if getattr(node.target, "comm_kind", None) and \
                        str(node.meta.get("module_path", "")).startswith("blocks.5."):
                    name, moved = _moved(node, n)
                    counts[name] = counts.get(name, 0) + 1
                    total += moved
                    main += moved if name in ("all_reduce", "copy_to_axis", "linear_2d") else 0.0
            if mode == "1d":           # 2 all-reduces forward (g), 2 backward (f) of (B, N, C)
                closed = 4 * 2 * (tp - 1) / tp * B * N * C * 4
            else:                      # per linear (in k, out o): 3 (q-1) (X + W), X = B/q N k/q, W = o/q k/q
                q = n
                closed = sum(3 * (q - 1) * (B * N * k + o * k) / (q * q) * 4
                             for k, o in ((C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)))
            ops = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
            rows.append(f"| {tp} | {mode} | {ops} | {total / 2**20:.1f} | {main / 2**20:.1f} | "
                        f"{closed / 2**20:.1f} |")
    return rows


def memory_rows() -> list[str]:
    rows = []
    for tp, mode in ((1, "1d"), (4, "1d"), (4, "2d")):
        plan = _vit_b_plan(tp, mode)
        s = plan.stages[0]
        rows.append(f"| {'single device' if tp == 1 else f'tp=4, {mode}'} | {s.param_bytes / 2**20:.1f} | "
                    f"{s.activation_bytes / 2**20:.1f} | {s.fwd_time * 1e3:.1f} + {s.bwd_time * 1e3:.1f} | "
                    f"{s.comm_time * 1e3:.1f} |")
    return rows


# ---- step time ------------------------------------------------------------------------------------
def run_rank(rank: int, args) -> dict:
    from timm.models import VisionTransformer
    return tp_mode_steps(lambda: VisionTransformer(**VIT), (1, 4, 1), ("1d", "2d"), args, BATCH, LR)


def time_rows(args) -> list[str]:
    os.environ["AUTOSPLIT_TIMEOUT"] = "600"          # the spawned ranks inherit it
    per_rank = spawn_ranks(run_rank, WORLD, args, timeout=3600)
    first = per_rank[0]["first"]
    assert all(abs(a - b) < 1e-5 for a, b in zip(first["1d"][:2], first["2d"][:2])), first
    return mode_rows(per_rank, ("1d", "2d"))


def main() -> None:
    args = step_args()
    load = os.getloadavg()[0]
    mem, comm, steps = memory_rows(), comm_rows(), time_rows(args)
    section = "\n".join([
        START, "## 1D vs 2D tensor parallelism (`benchmarks/bench_tp2d.py`)", "",
        f"{datetime.date.today()}, {cpu_name()}, load average {load:.1f} at the start.", "",
        "Per tp rank, ViT-B/16 planned on the meta device, one microbatch of 32 (the plan's accounting):", "",
        "| layout | parameters (MiB) | saved activations per microbatch (MiB) | predicted fwd + bwd ms (H100) | "
        "predicted tp comm ms (H100) |", "|---|---|---|---|---|", *mem, "",
        "Collectives in one transformer block (`blocks.5`), counted from tp rank 0's emitted graph, and the bytes "
        "that rank sends per step (forward + backward):", "",
        "| tp | mode | collectives in the block | MiB moved, all | MiB, all-reduces (1d) / linear_2d (2d) | "
        "same, closed form |", "|---|---|---|---|---|---|",
        *comm, "",
        f"Step time, 4 gloo ranks on this CPU, ViT width 192 depth 12, batch {BATCH}, mesh (1, 4, 1), "
        f"{args.steps} steps each, interleaved (ms, slowest rank):", "",
        "| run | median | p10 | p90 | vs 1d |", "|---|---|---|---|---|", *steps, "", WHY, END, ""])
    print(section)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", section, START, END)


if __name__ == "__main__":
    main()
