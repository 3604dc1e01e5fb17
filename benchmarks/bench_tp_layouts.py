"""Tensor-parallel layouts side by side: 1D, 2D, 2.5D and 3D on ViT-B/16, planned (never run).

timm's ``vit_base_patch16_224`` is built on the meta device and planned by ``autosplit.compile`` with
mesh (1, tp, 1), one microbatch of 32 float32 images (3x224x224) and the H100 profile, for every mode
that factors tp: 1d always, 2d where tp = q^2, 2.5d at every depth d >= 2 with tp = q^2 d (q >= 2), 3d
where tp = q^3.  Everything is read off the plan, for tp rank 0:

Terms:
  params/rank  -- bytes of the parameters tp rank 0's stage modules hold (numel x element size).
  act/rank     -- the plan's saved activation bytes per microbatch and tp rank (``activation_bytes``).
  closed form  -- the textbook per-rank share, from the single-device plan (tp = 1) of the same
                  model: parameters W / tp (1d), W / q^2 (2d, and 2.5d, replicated over its d layers),
                  W / q^3 (3d); activations A / tp for every mode (1d: A / tp, 2d: A / q^2, 2.5d:
                  A / (d q^2), 3d: A / q^3).  W is the whole model's parameter bytes, A the
                  single-device saved activations.  NOTES says which of these Colossal-AI's documents
                  state.
  block        -- ``blocks.5`` (a middle transformer block): the graph nodes whose module path lies in it
                  and whose target has ``comm_kind``.
  collectives  -- collective calls per direction: one per node and direction whose kind is not None,
                  except ``linear_2d`` (allgather form: its input gathered over tp_col and its weight
                  over tp_row forward; both re-gathered and both gradients reduce-scattered backward;
                  summa form: q broadcasts each instead of one gather) and ``layer_norm_2d`` (two
                  all-reduces, mean and variance, forward and backward).  ``copy_to_axis`` is an
                  all-reduce backward only.
  MiB          -- the size of each collective's unsharded tensor (the larger of its output and inputs:
                  what ``cost_model.comm.collective_time`` prices), summed; ``linear_2d``: the gathered
                  input and weight, forward, and twice that backward.
  sent         -- bytes rank 0 sends for those collectives, forward + backward, with ring algorithms
                  over an axis of n ranks: all-reduce 2 (n-1)/n, all-gather / reduce-scatter (n-1)/n of
                  the unsharded size.
  predicted    -- the sum of ``collective_time`` over the block's nodes (H100 profile), forward and
                  backward.

  node spans   -- the H100 profile has 8 GPUs per node: a tp group of 64 spans 8 nodes, and a grid's outer
                  axes (tp_row under 2D, tp_dep, tp_x, tp_y) are strided across them, so their
                  collectives are priced over the network (``meta["axis_stride"]``).

Args:
  --tp N [N ...]  tensor-parallel sizes to plan, each with every mode that factors it (default 8 64).
  --no-write      print the section only (default: also write it into docs/benchmarks.md, between
                  the bench_tp_layouts markers).

Run from the repository root:  python benchmarks/bench_tp_layouts.py [--tp 8 64] [--no-write]
"""
from __future__ import annotations

import argparse
import datetime
import time
import warnings
from pathlib import Path

from common import md_table, write_section

BATCH, BLOCK, MiB = 32, "blocks.5", 2 ** 20
START, END = "<!-- bench_tp_layouts:start -->", "<!-- bench_tp_layouts:end -->"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
WARNINGS: dict[str, None] = {}          # the planner's warnings, once each, in order


def layouts(tp: int) -> list[tuple[str, int | None, str]]:
    """(mode, tp_depth, grid) for every mode that factors tp (grid: q x q [x d | x q])."""
    from autosplit.tp.axes import grid_layouts, tp_axes
    return [("1d", None, f"{tp}")] + [(m, d, "x".join(str(n) for _, n in reversed(tp_axes(m, tp, d))))
                                      for m, d in grid_layouts(tp)]


def closed_form_divisors(mode: str, tp: int, d: int | None) -> tuple[int, int]:
    """(parameter divisor, activation divisor) of the closed forms (see Terms)."""
    return (tp // d if mode == "2.5d" else tp), tp


def plan(tp: int, mode: str, depth: int | None):
    """(plan, planning seconds) of ViT-B/16 on the meta device."""
    import timm
    import torch

    import autosplit
    with torch.device("meta"):
        model = timm.create_model("vit_base_patch16_224", pretrained=False)
    x = torch.empty(BATCH, 3, 224, 224, device="meta")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        p = autosplit.compile(model, mesh=(1, tp, 1), example_input=x, tp_mode=mode, device="h100",
                              num_microbatches=1, **({"tp_depth": depth} if depth else {}))
        secs = time.perf_counter() - start
    WARNINGS.update((str(w.message), None) for w in caught)
    return p, secs


def param_bytes(p) -> int:
    return sum(t.numel() * t.element_size() for m in p.stage_modules(0, 0) for t in m.parameters())


def traffic(node, tp: int) -> list[tuple[int, float, float]]:
    """[(collectives, unsharded bytes, bytes sent)] forward and backward, for one collective node."""
    from autosplit.cost_model.comm import axis_size
    from autosplit.passes.shape_prop import tensor_bytes
    fwd, bwd = node.target.comm_kind
    if fwd == "linear_2d":
        x, w = (tensor_bytes(a.meta["val"]) for a in node.args[:2])
        q, form = node.args[4], node.args[5]
        calls = 1 if form == "allgather" else q
        one = (2 * calls, q * (x + w), (q - 1) * (x + w))
        return [one, tuple(2 * v for v in one)]
    axis = next(a for a in node.args if isinstance(a, str))
    n = node.meta.get("axis_size") or axis_size(axis, tp)
    if hasattr(node.target, "comm_bytes"):                      # layer_norm_2d: mean and variance
        calls, nbytes = 2, node.target.comm_bytes(node)
    else:
        values = [node.meta.get("val")] + [a.meta.get("val") for a in node.all_input_nodes]
        calls, nbytes = 1, max(tensor_bytes(v) for v in values)
    ring = lambda kind: (2 if kind == "all_reduce" else 1) * (n - 1) / n    # noqa: E731
    return [(calls, nbytes, ring(k) * nbytes) if k and n > 1 else (0, 0.0, 0.0) for k in (fwd, bwd)]


def block_comm(p, tp: int) -> dict:
    """Collectives of ``BLOCK`` in tp rank 0's graph: counts, MiB, sent MiB, predicted ms, ops."""
    from autosplit.cost_model.comm import collective_time
    from autosplit.cost_model.profiles import get_profile
    profile = get_profile("h100")
    calls, nbytes, sent, ms, ops = [0, 0], [0.0, 0.0], 0.0, [0.0, 0.0], {}
    for node in p.stage_modules(0, 0)[0].graph.nodes:
        path = str(node.meta.get("module_path", ""))
        if not (getattr(node.target, "comm_kind", None) and (path == BLOCK or path.startswith(BLOCK + "."))):
            continue
        for i, ((c, b, s), t) in enumerate(zip(traffic(node, tp), collective_time(node, tp, profile))):
            calls[i], nbytes[i], sent, ms[i] = calls[i] + c, nbytes[i] + b, sent + s, ms[i] + t * 1e3
        if any(node.target.comm_kind):
            axis = next(a for a in node.args if isinstance(a, str))
            key = f"{node.target.__name__}({axis})"
            ops[key] = ops.get(key, 0) + 1
    return dict(calls=calls, mib=[b / MiB for b in nbytes], sent=sent / MiB, ms=ms,
                ops=", ".join(f"{k} x{v}" for k, v in sorted(ops.items())))


def measure(tps: list[int]) -> tuple[list[list], list[list], dict]:
    """The memory and communication tables' rows, and the single-device W and A."""
    base, base_s = plan(1, "1d", None)
    W, A = param_bytes(base), base.stages[0].activation_bytes
    memory = [["single device (tp=1)", "1", f"{W / MiB:.1f}", "W", f"{A / MiB:.1f}", "A", f"{base_s:.1f}"]]
    comm = []
    for tp in tps:
        for mode, depth, grid in layouts(tp):
            name = f"tp={tp} {mode}" + (f" d={depth}" if depth else "")
            try:
                p, secs = plan(tp, mode, depth)
            except Exception as exc:                           # report a refusal, go on with the rest
                memory.append([name, grid, f"failed: {type(exc).__name__}: {str(exc)[:160]}", "", "", "", ""])
                continue
            pdiv, adiv = closed_form_divisors(mode, tp, depth)
            ours_p, ours_a = param_bytes(p), p.stages[0].activation_bytes
            memory.append([name, grid, f"{ours_p / MiB:.1f}",
                           f"{W / pdiv / MiB:.1f} (W/{pdiv}), x{ours_p / (W / pdiv):.2f}",
                           f"{ours_a / MiB:.1f}", f"{A / adiv / MiB:.1f} (A/{adiv}), x{ours_a / (A / adiv):.2f}",
                           f"{secs:.1f}"])
            c = block_comm(p, tp)
            comm.append([name, f"{c['calls'][0]} / {c['calls'][1]}", f"{c['mib'][0]:.1f} / {c['mib'][1]:.1f}",
                         f"{c['sent']:.1f}", f"{c['ms'][0]:.3f} / {c['ms'][1]:.3f}", c["ops"]])
    return memory, comm, dict(W=W, A=A)


NOTES = """\
What Colossal-AI's documents say (`../shared/reference/`), and what they do not:

- 000_cc2e78753ae91ef1.txt:141: "Tensor parallelism partitions each weight parameter across multiple
  devices in order to reduce memory load. Colossal-AI support 1D, 2D, 2.5D and 3D tensor parallelism."
  Its ViT config (lines 108-117) is ours but for NUM_CLASSES = 10: HIDDEN_SIZE 768, DEPTH 12, NUM_HEADS 12,
  MLP_RATIO 4, SEQ_LENGTH (224 // 16)^2 + 1 = 197.
- 003_901e3a68d8d3e925.txt:80-83 (2D): "splits the input data, model weights and layer outputs along two
  different dimensions. The tensor chunks are distributed over a 2D mesh of $P = N^2$ devices".
- 003_901e3a68d8d3e925.txt:85-88 (2.5D): "An amount of $P = N^2 ∗ d$ processors are arranged into $d$
  layers, where each layer performs matrix multiplication operations independently with a dimension $N$."
- 003_901e3a68d8d3e925.txt:90-93 (3D): "achieves the optimal, $O(P^{1/3})$ communication overhead on $P$
  processors, while both computation and memory usage are evenly distributed through optimized load
  balancing of parameters as well as activations."
- 003_901e3a68d8d3e925.txt:78 (1D) only cites Megatron-LM; 002_54f69c081cef0116.txt:541-544 repeats
  000:141-144 in Chinese.  None of the documents writes a per-rank formula for parameters, activations
  or bytes per linear: the closed forms in the table (W/tp, W/q^2, W/q^3; A/tp, A/q^2, A/(d q^2), A/q^3)
  are the layouts those sentences describe, worked out here, not quoted.  The one stated quantity,
  3D's O(P^{1/3}) communication, is an order, not a number.

W is ViT-B/16's 86.6 M parameters x 4 bytes.  A agrees with a count by hand: per block 17 B S H floats
(B = 32, S = 197, H = 768: 12 x 17 x 18.5 MiB = 3768 MiB): the attention's q, k, v and output (4), the
MLP's hidden activation as fc1's output and as fc2's input (4 + 4), the two norms' inputs (2) and the
inputs of qkv, proj and fc1 (3); plus the images the patch embedding saves and the final norm's input.

Where ours differs from the closed form, and why:

- 1d parameters: ViT-B's 12 heads divide by neither 8 nor 64, so qkv, the attention and proj stay whole
  on every rank and only the MLP (fc1 column, fc2 row) is split, with the head where 1000 classes divide
  (8 yes, 64 no); the patch embedding, class token, position embedding and norms are replicated, as in
  Megatron.
- 1d activations: only the MLP's hidden activations are split; the whole attention, the norms and the
  (B, S, H) residual stream between blocks are saved on every rank.
- 2d at q = 8: 12 heads do not divide by q, so scaled_dot_product_attention runs whole over tp_col and
  saves all heads of its B/q rows, q times its 1/q^2 block (the parameters still split q^2 ways).
- 2.5d: parameters are exactly W/q^2 (every one, biases and norms too, split q^2 ways and replicated over
  the d layers); the 1-2 % over A/(d q^2) is the patch embedding's saved input, the images split by
  rows only (B/(d q)): 3 colour channels do not split.
- 3d parameters: linear weights are split q^3 ways, but biases, norms, the class token, the position
  embedding and the patch embedding's convolution only q^2 ways (the head's bias less), hence 1-3 % over
  W/q^3; each rank also gathers every weight, bias and norm parameter over tp_x for every microbatch
  (the 12 all_gather(tp_x) of a block), which costs traffic, not stored bytes.
- 3d activations: each linear saves its input gathered over one cube axis (B/q rows where the block
  holds B/q^2), q times the 1/q^3 share, for the weight gradient: x1.4 at q = 2, x2.2 at q = 4.

What the times say: at tp = 8 (one node) 2.5D and 3D send about as many bytes per block as 1D
(76-81 vs 65 MiB) in 20-40 collectives instead of 2, for 1/4 and 1/8 of the parameters and 1/5 and
1/3 of 1D's saved activations.  At tp = 64 (8 nodes) a grid's outer axes cross nodes: 1D's one
all-reduce each way (1.0 ms) is still the cheapest, 3D the cheapest grid (about 2 ms each way), and
2.5D at d = 16 pays 7.4 ms backward for the 12 parameter gradients it sums over the 16 depth layers
every microbatch; the grids hold 5-83 MiB of parameters where 1D holds 118.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[8, 64], metavar="N",
                    help="tensor-parallel sizes to plan, each with every mode that factors it")
    ap.add_argument("--no-write", action="store_true", help="print only; do not update docs/benchmarks.md")
    args = ap.parse_args()
    import timm
    import torch
    start = time.perf_counter()
    memory, comm, wa = measure(args.tp)
    text = "\n".join([
        "## Tensor-parallel layouts: 1D, 2D, 2.5D, 3D (`benchmarks/bench_tp_layouts.py`)", "",
        f"{datetime.date.today()}, torch {torch.__version__}, timm {timm.__version__}; "
        f"`python benchmarks/bench_tp_layouts.py --tp {' '.join(map(str, args.tp))}` "
        f"({time.perf_counter() - start:.0f} s, planning only, on the CPU).  ViT-B/16 on the meta device, mesh "
        f"(1, tp, 1), one microbatch of {BATCH} float32 images, H100 profile; per tp rank 0.  "
        f"W = {wa['W'] / MiB:.1f} MiB of parameters, A = {wa['A'] / MiB:.1f} MiB of saved activations "
        f"(single-device plan).", "",
        *md_table(["layout", "grid", "params/rank MiB", "closed form MiB, ours/closed", "act/rank MiB",
                   "closed form MiB, ours/closed", "plan s"], memory), "",
        f"Collectives of one transformer block (`{BLOCK}`) in tp rank 0's graph: calls forward / backward, "
        "unsharded MiB forward / backward, MiB rank 0 sends (ring, forward + backward), and the cost "
        "model's time:", "",
        *md_table(["layout", "collectives fwd / bwd", "MiB fwd / bwd", "sent MiB", "predicted ms fwd / bwd",
                   "graph nodes"], comm), "",
        *(f"Planner warning: {w}\n" for w in WARNINGS), NOTES])
    print(text)
    if not args.no_write:
        write_section(DOCS, f"{START}\n{text}\n{END}\n", START, END)
        print(f"wrote {DOCS}")


if __name__ == "__main__":
    main()
