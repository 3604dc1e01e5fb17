"""The kernel model against published GPU timings: fit each GPU's few numbers, then predicted vs published.

Terms (see gpu_table_features.py for the rows and what each ran):
  predicted  -- training row: forward + backward of every op (cost_model/kernels.py ``kernel_parts`` with the
                GPU's profile) + the SGD step (``optimizer_step_time``: timm's SGD, momentum with Nesterov,
                one tensor at a time as PyTorch 1.x ran it: zero_grad, momentum, Nesterov add, update =
                12 parameter-sized reads and writes and 5 kernels per tensor).  Inference row: forward only.
  fit        -- per GPU, least squares on log(predicted / published) over its rows (soft-L1, so a few odd
                rows do not steer it), of five numbers: ``gemm_efficiency``, ``gemm_half_dim``,
                ``attention_efficiency``, ``bandwidth_efficiency``, ``op_overhead`` (kernels.py).  Where a
                GPU's tensor peak is not verified (RTX 5090, RTX PRO 6000 Max-Q) the peak itself is fitted
                with ``gemm_efficiency`` = 1 (still five numbers), and no MFU is shown.  The fit's vectorized
                form mirrors ``kernel_parts``; the reported errors come from ``kernel_parts`` itself, with
                the profiles cost_model/device.py holds (``--fit`` prints new numbers to put there).
  error      -- predicted / published - 1; per table the median of |error| and the worst.
  hybrid     -- a ``vit_`` row whose model puts a ResNet stem before the transformer (a name with ``_r26``,
                ``_r50``, ``_r_`` or ``resnet``): priced like every row, and also reported apart, since its
                convolutions and batch norms are where the model is least accurate.
  MFU        -- the row's counted FLOPs (forward, and backward for training) over published time x the
                datasheet tensor peak: how far from the peak the measured run was.

Run:  python benchmarks/bench_gpu_tables.py [--fit] [--rows]     (first run traces ~330 programs: ~10 min)
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
import statistics

import numpy as np
import torch
from scipy.optimize import least_squares

from gpu_table_features import all_features, at_batch, cached_features, rows

from autosplit.cost_model.device import BUILTIN
from autosplit.cost_model.flops import NodeCost
from autosplit.cost_model.kernels import kernel_parts, optimizer_step_time

SGD_TRAFFIC, SGD_LAUNCHES = 12, 5
MAX_GEMM_EFFICIENCY = 0.85     # the best large GEMMs published on these parts reach 70-85 % of peak
HYBRID = re.compile(r"_r\d|_r_|resnet")   # ResNet-stem hybrids (vit_base_r50_s16, vit_tiny_r_s16_p8, ...)
UNVERIFIED_PEAK = ("rtx5090", "rtx_pro6000_maxq")
_DTYPE = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def predict(profile, recs, train: bool, param_bytes: float, tensors: int) -> float:
    """Seconds of one row on ``profile`` through kernel_parts (see *predicted*)."""
    total = 0.0
    for cls, dt, ff, bf, fb, bb, shape in recs:
        (fa, fw), (ba, bw) = kernel_parts(NodeCost(ff, bf, fb, bb), _DTYPE[dt], profile, cls, shape or None)
        total += fa + fw + ((ba + bw) if train else 0.0)
    if train:
        total += optimizer_step_time(param_bytes, tensors, profile, SGD_TRAFFIC, SGD_LAUNCHES)
    return total


class Arrays:
    """One GPU's rows as flat arrays for the vectorized fit."""

    def __init__(self, items, profile):
        self.rows, cols = [], {k: [] for k in ("row", "gemm", "attn", "half", "ff", "bf", "fb", "bb", "m", "n", "k",
                                                "mm")}
        self.train, self.opt_bytes, self.opt_launch, self.ms = [], [], [], []
        for i, (row, feat) in enumerate(items):
            for cls, dt, ff, bf, fb, bb, shape in at_batch(feat, row.batch):
                m, n, k = (shape[1:] if shape else (0, 0, 0))
                for key, v in (("row", i), ("gemm", cls in ("matmul", "attention")), ("attn", cls == "attention"),
                               ("half", dt != "float32"), ("ff", ff), ("bf", bf), ("fb", fb), ("bb", bb),
                               ("m", m), ("n", n), ("k", k), ("mm", cls == "matmul")):
                    cols[key].append(v)
            self.train.append(row.train)
            self.opt_bytes.append(SGD_TRAFFIC * feat["param_bytes"] if row.train else 0.0)
            self.opt_launch.append(SGD_LAUNCHES * feat["param_tensors"] if row.train else 0.0)
            self.ms.append(row.ms)
        for key, v in cols.items():
            setattr(self, key, np.array(v, dtype=float))
        self.train, self.opt_bytes = np.array(self.train, dtype=float), np.array(self.opt_bytes)
        self.opt_launch, self.ms = np.array(self.opt_launch), np.array(self.ms)
        self.has_shape = self.m > 0
        self.train_rec = self.train[self.row.astype(int)]
        self.n_rows = len(self.ms)
        self.peak16, self.peak32 = profile.flops_for(torch.float16), profile.flops_for(torch.float32)
        self.bw = profile.mem_bandwidth

    def seconds(self, peak16, eff, half, attn, bw_eff, launch) -> np.ndarray:
        shape = np.where(self.has_shape, (self.m / (self.m + half)) * (self.n / (self.n + half))
                         * (self.k / (self.k + half)), 1.0)
        rate = np.where(self.gemm > 0, np.where(self.half > 0, peak16, self.peak32) * eff * shape
                        * np.where(self.attn > 0, attn, 1.0), self.peak32)
        bw = self.bw * bw_eff
        fwd = np.maximum(self.ff / rate, self.fb / bw)
        bwd = np.maximum(self.bf / rate, self.bb / bw)
        per = fwd + (fwd > 0) * launch + self.train_rec * (bwd + (bwd > 0) * launch * np.where(self.mm > 0, 2, 1))
        total = np.bincount(self.row.astype(int), weights=per, minlength=self.n_rows)
        return total + self.opt_bytes / bw + self.opt_launch * launch


def fit(name: str, arrays: Arrays) -> dict:
    """The five fitted numbers of one GPU (see *fit*)."""
    free_peak = name in UNVERIFIED_PEAK

    def unpack(th):
        v = np.exp(th)
        return (v[0], 1.0) if free_peak else (arrays.peak16, v[0]), v[1:]

    def residual(th):
        (peak, eff), (half, attn, bw_eff, launch) = unpack(th)
        return np.log(arrays.seconds(peak, eff, half, attn, bw_eff, launch) * 1e3 / arrays.ms)

    # physical bounds: no kernel beats its peak or the memory; launches between 0.1 and 100 us
    low = [math.log(20e12 if free_peak else 0.05), math.log(1.0), math.log(0.05), math.log(0.2), math.log(1e-7)]
    high = [math.log(2e15 if free_peak else MAX_GEMM_EFFICIENCY), math.log(2048.0), math.log(4.0), math.log(1.0), math.log(1e-4)]
    start = [math.log(arrays.peak16 * 0.6 if free_peak else 0.6), math.log(64), math.log(0.6), math.log(0.8),
             math.log(5e-6)]
    th = least_squares(residual, start, bounds=(low, high), loss="soft_l1", f_scale=0.1).x
    (peak, eff), (half, attn, bw_eff, launch) = unpack(th)
    return {"peak16": peak, "gemm_efficiency": eff, "gemm_half_dim": half, "attention_efficiency": attn,
            "bandwidth_efficiency": bw_eff, "op_overhead": launch}


def counted_flops(recs, train: bool) -> float:
    return sum(r[2] + (r[3] if train else 0) for r in recs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="fit each GPU's numbers and print them")
    ap.add_argument("--rows", action="store_true", help="print every row (predicted, published, MFU)")
    ap.add_argument("--cached", action="store_true", help="only the programs already traced (no tracing)")
    ap.add_argument("--roofline", action="store_true",
                    help="the plain roofline instead (datasheet peaks, raw bandwidth, 4 us launches): the model before")
    args = ap.parse_args(argv)
    table = rows()
    keys = sorted({(r.model.split(".")[0], r.img, r.fused) for r in table})
    feats = cached_features(keys) if args.cached else all_features(keys)
    table = [r for r in table if (r.model.split(".")[0], r.img, r.fused) in feats]
    priced = [(r, feats[(r.model.split(".")[0], r.img, r.fused)]) for r in table]
    skipped = [(r, f["error"]) for r, f in priced if "error" in f]
    priced = [(r, f) for r, f in priced if "error" not in f]
    gpus = sorted({r.gpu for r, _ in priced})
    profiles = dict(BUILTIN)
    if args.roofline:
        profiles = {k: dataclasses.replace(p, gemm_efficiency=1.0, gemm_half_dim=0.0, attention_efficiency=1.0,
                                           bandwidth_efficiency=1.0, op_overhead=4e-6) for k, p in BUILTIN.items()}
    if args.fit:
        for gpu in gpus:
            items = [(r, f) for r, f in priced if r.gpu == gpu]
            got = fit(gpu, Arrays(items, BUILTIN[gpu]))
            print(gpu, {k: float(f"{v:.4g}") for k, v in got.items()})
            peak = got.pop("peak16")
            profiles[gpu] = dataclasses.replace(BUILTIN[gpu], **got, peak_flops={
                **BUILTIN[gpu].peak_flops, torch.float16: peak, torch.bfloat16: peak})
    print(f"{len(priced)} rows priced, {len(skipped)} skipped "
          f"({len({r.model for r, _ in skipped})} models: {sorted({e for _, e in skipped})[:3]})\n")
    lines = ["| table | GPU | rows | median abs error | worst | worst row | median implied MFU |",
             "|---|---|---|---|---|---|---|"]
    per_gpu: dict = {}
    per_gpu_hybrid: dict = {}
    for name in sorted({r.table for r, _ in priced}):
        items = [(r, f) for r, f in priced if r.table == name]
        gpu = items[0][0].gpu
        prof = profiles[gpu]
        errs, mfus, worst = [], [], (0.0, "")
        for r, f in items:
            recs = at_batch(f, r.batch)
            pred = predict(prof, recs, r.train, f["param_bytes"], f["param_tensors"])
            err = pred * 1e3 / r.ms - 1
            mfu = counted_flops(recs, r.train) / (r.ms / 1e3 * prof.flops_for(torch.float16))
            errs.append(err)
            mfus.append(mfu)
            if abs(err) > abs(worst[0]):
                worst = (err, f"{r.model} @{r.img} b{r.batch}")
            if args.rows:
                print(f"{name} {r.model} img {r.img} batch {r.batch}: published {r.ms:.2f} ms, predicted "
                      f"{pred * 1e3:.2f} ms ({err:+.1%}), MFU {mfu:.0%}")
        per_gpu.setdefault(gpu, []).extend(errs)
        per_gpu_hybrid.setdefault(gpu, []).extend(HYBRID.search(r.model) is not None for r, _ in items)
        mfu = "n/a (peak unverified)" if gpu in UNVERIFIED_PEAK else f"{statistics.median(mfus):.0%}"
        lines.append(f"| {name} | {gpu} | {len(errs)} | {statistics.median(abs(e) for e in errs):.1%} | "
                     f"{worst[0]:+.1%} | {worst[1]} | {mfu} |")
    lines += ["", "| GPU | rows | median abs error | worst | plain transformer rows | median | worst |",
              "|---|---|---|---|---|---|---|"]
    for gpu, errs in sorted(per_gpu.items()):
        plain = [e for e, hybrid in zip(errs, per_gpu_hybrid[gpu]) if not hybrid]
        lines.append(f"| {gpu} | {len(errs)} | {statistics.median(abs(e) for e in errs):.1%} | "
                     f"{max(errs, key=abs):+.1%} | {len(plain)} | {statistics.median(abs(e) for e in plain):.1%} | "
                     f"{max(plain, key=abs):+.1%} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
