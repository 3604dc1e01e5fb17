"""One GPU: autosplit's runtime under CUDA + NCCL against plain PyTorch, and the GPU cost profile against a
measured step.

Needs one CUDA GPU (no test runs this: CI has none).  Every check runs in one process that is an NCCL
world of one rank (MASTER_ADDR / RANK / WORLD_SIZE set here), so no p2p or collective crosses a link:
what it exercises is the executor on CUDA tensors and streams, microbatch accumulation, the split
backward's queued weight gradients, checkpointing and autocast on the device users run.

Terms:
  reference -- the same model (same seed) trained by plain PyTorch on the GPU: the whole batch per
               forward, SGD, TF32 off (so fp32 is fp32 on both sides).
  diff      -- max |loss difference| over the steps, and max |parameter difference| after them
               (``pm.full_state_dict()`` vs the reference's state_dict).
  measured  -- median of ``pm.step`` (or of the reference's forward + backward) over the timed steps,
               each ended by ``torch.cuda.synchronize()``; the optimizer step is not timed.
  predicted -- ``predict_plan(plan, device=profile)`` of the plan compiled with that profile: the
               datasheet (cost_model/device.py), ``calibrate(device="cuda")`` (matmul peaks, copy bandwidth
               and op overhead measured on this GPU in a few seconds), and each of them fitted to the
               model on this GPU (``fit_to_model(..., device="cuda", autocast=...)`` at microbatch 16
               and 64: two factors, per-op overhead and work).

Run:  python benchmarks/bench_gpu.py            (prints Markdown tables; --out FILE writes them too)
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

CHECK_VIT = dict(img_size=32, patch_size=4, embed_dim=96, depth=4, num_heads=4, num_classes=10)
# (label, parallelize keywords)
CHECKS = [
    ("1f1b m4", dict(schedule="1f1b", num_microbatches=4)),
    ("zb-h1 m4 (split backward)", dict(schedule="zb-h1", num_microbatches=4)),
    ("1f1b m4, recompute=block", dict(schedule="1f1b", num_microbatches=4, recompute="block")),
    ("1f1b m2, autocast bf16", dict(schedule="1f1b", num_microbatches=2, autocast=torch.bfloat16)),
]
# (timm model, batch, microbatches, autocast)
SPEED = [("vit_base_patch16_224", 32, 1, None), ("vit_base_patch16_224", 64, 1, torch.bfloat16),
         ("vit_base_patch16_224", 64, 4, torch.bfloat16), ("vit_large_patch16_224", 32, 1, torch.bfloat16)]


FIT_SIZES = (16, 64)      # fit_to_model's two microbatch sizes; (4, 16), launch-bound on an H100, misled it


def _one_rank_world() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29531"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")


def _reference(model, xs, ys, lr: float, autocast):
    import copy
    model = copy.deepcopy(model).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in zip(xs, ys):
        with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
            loss = torch.nn.functional.cross_entropy(model(x.cuda()), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def correctness(steps: int = 3, batch: int = 8, lr: float = 0.1) -> list[str]:
    import timm
    import autosplit
    rows = ["| configuration | max loss diff | max param diff |", "|---|---:|---:|"]
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(steps, batch, 3, 32, 32, generator=g)
    ys = torch.randint(0, 10, (steps, batch), generator=g)
    for label, kw in CHECKS:
        torch.manual_seed(0)
        model = timm.models.VisionTransformer(**CHECK_VIT)
        ref_losses, ref_state = _reference(model, xs, ys, lr, kw.get("autocast"))
        pm = autosplit.parallelize(model, mesh=(1, 1, 1), example_input=xs[0, : batch // kw["num_microbatches"]],
                                   **kw)
        opt = torch.optim.SGD(pm.parameters(), lr=lr)
        losses = []
        for x, y in zip(xs, ys):
            losses.append(pm.step(x, y))
            opt.step()
            opt.zero_grad()
        state = pm.full_state_dict()
        loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        param_diff = max((state[k].float().cuda() - v.float()).abs().max().item() for k, v in ref_state.items())
        rows.append(f"| {label} | {loss_diff:.2e} | {param_diff:.2e} |")
        print(rows[-1], flush=True)
        pm.close()
    return rows


def _timed(fn, steps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _profiles(model, autocast, sizes):
    """label -> profile: the datasheet, this GPU's calibrated peaks, and each fitted to ``model`` here."""
    from autosplit.cost_model import fit_to_model
    from autosplit.cost_model.profiles import profile_for_gpu
    datasheet = profile_for_gpu(torch.cuda.get_device_name())
    calibrated = _calibrated()
    example = torch.empty(1, 3, 224, 224)
    return {"datasheet": datasheet, "calibrated": calibrated,
            "datasheet fitted": fit_to_model(datasheet, model, example, sizes=sizes, autocast=autocast)[0],
            "calibrated fitted": fit_to_model(calibrated, model, example, sizes=sizes, autocast=autocast)[0]}


_CALIBRATED = []


def _calibrated():
    if not _CALIBRATED:
        from autosplit.cost_model import calibrate
        p = calibrate(seconds=2.0, link=False, device="cuda")
        print(f"calibrated: fp32 {p.peak_flops[torch.float32] / 1e12:.0f} TFLOP/s, bf16 "
              f"{p.peak_flops[torch.bfloat16] / 1e12:.0f} TFLOP/s, copy {p.mem_bandwidth / 1e12:.2f} TB/s, "
              f"op overhead {p.op_overhead * 1e6:.1f} us", flush=True)
        _CALIBRATED.append(p)
    return _CALIBRATED[0]


def speed(steps: int) -> list[str]:
    """Plain PyTorch vs autosplit on one GPU, and each profile's prediction of the autosplit step.  The
    fits time the model at microbatch ``FIT_SIZES``, the ends of the range the cases use (so a case at
    microbatch 32 is one the fit did not time)."""
    import timm
    import autosplit
    from autosplit.cost_model.step_time import predict_plan
    labels = ("datasheet", "calibrated", "datasheet fitted", "calibrated fitted")
    rows = ["| model | batch | microbatches | dtype | plain PyTorch ms | autosplit ms | autosplit / plain | "
            + " | ".join(f"predicted ms: {k} (error)" for k in labels) + " |",
            "|---|---:|---:|---|---:|---:|---:|" + "---:|" * len(labels)]
    for name, batch, m, autocast in SPEED:
        torch.manual_seed(0)
        model = timm.create_model(name)
        profiles = _profiles(model, autocast, FIT_SIZES)
        x, y = torch.randn(batch, 3, 224, 224, device="cuda"), torch.randint(0, 1000, (batch,), device="cuda")
        plain = model.cuda()

        def plain_step():
            for xs, ys in zip(x.chunk(m), y.chunk(m)):
                with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
                    loss = torch.nn.functional.cross_entropy(plain(xs), ys) / m
                loss.backward()
            plain.zero_grad(set_to_none=True)
        t_plain = _timed(plain_step, steps)
        plain.cpu()
        torch.cuda.empty_cache()
        example = x[: batch // m].cpu()
        preds = []
        for label in labels:
            plan = autosplit.compile(model, mesh=(1, 1, 1), example_input=example, num_microbatches=m,
                                     autocast=autocast, device=profiles[label])
            preds.append(predict_plan(plan, device=profiles[label]).total)
        pm = autosplit.parallelize(model, mesh=(1, 1, 1), num_microbatches=m, autocast=autocast,
                                   example_input=example)

        def pm_step():
            pm.step(x, y)
            for p in pm.parameters():
                p.grad = None
        t_pm = _timed(pm_step, steps)
        dtype = "fp32" if autocast is None else "bf16 autocast"
        rows.append(f"| {name} | {batch} | {m} | {dtype} | {t_plain * 1e3:.1f} | {t_pm * 1e3:.1f} | "
                    f"{t_pm / t_plain:.3f} | "
                    + " | ".join(f"{p * 1e3:.1f} ({(p - t_pm) / t_pm:+.0%})" for p in preds) + " |")
        print(rows[-1], flush=True)
        for label in labels[2:]:
            print(f"  {label}: {profiles[label].name}", flush=True)
        pm.close()
        del model, plain, pm
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    _one_rank_world()
    head = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, NCCL "
            f"{'.'.join(map(str, torch.cuda.nccl.version()))}, one rank")
    print(head, flush=True)
    text = [head, "", *correctness(), "", *speed(args.steps)]
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
