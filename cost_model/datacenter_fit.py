"""Fit the datacenter GPUs' kernel model (H100, A100; H200 shares the H100's) to published training runs.

Terms (rows: datacenter_rows.py; kernel model: kernels.py):
  features   -- what one row's compiled plan says, priced with a reference profile P0: the step's
                ``total0``, the slowest rank's ``compute0`` and ``bubble0``, the optimizer's ``optimizer0``,
                and that rank's ops (class, dtype, forward / backward FLOPs and bytes, GEMM dims, how many
                such ops per microbatch, and whether a recomputed forward runs them again), with ``m``
                microbatches per step (the recomputed share: the stage's priced backward beyond its ops'
                backward, over its ops' forward).  ``features_of`` reads them from a Plan; they are stored as JSON so
                the fit reruns without compiling (benchmarks/datacenter_table.py writes them).
  compute(p) -- the slowest rank's compute seconds on profile p: m x the sum over its ops of
                ``kernels.kernel_parts`` (the same formula, vectorized: ``op_seconds``), the recomputed
                forwards counted again.
  surrogate  -- the step on profile p, as the fit sees it: total0 + (compute0 + bubble0) x (compute(p) /
                compute(P0) - 1) + optimizer0 x (bandwidth_efficiency0 / bandwidth_efficiency - 1).  Compute
                and the pipeline bubble scale together (the bubble is idle time of stages whose computes
                all scale alike); tp / pp / dp communication stays as priced at P0 (its numbers, fitted to
                nccl-tests rows, are not fitted here).  The fit's final numbers are then checked by
                compiling every row again with them (benchmarks/datacenter_table.py).
  fitted     -- per GPU, ``FITTED``: gemm_efficiency, attention_efficiency, bandwidth_efficiency (each at
                most 1: no kernel beats the datasheet peak or the memory bandwidth; attention is no faster
                than a GEMM of its shape).  op_overhead is not fitted: ``LAUNCH`` (4 us, the profile's default;
                no eager op is launched and dispatched faster).  These rows' GPUs are the bottleneck and their
                launches overlap device work, so they cannot pin it: fitted free (4-100 us) it went to 0 on
                all rows (a tiny model's ops free, its stage cut following the boundary bytes alone: a 4-block
                ViT cut after its patch embedding) and to 29 us on the compute-bound ones (standing in for
                slow memory-bound ops; 0.4 point of held-out median either way), which would price 29 us
                per op of a 48-layer model's every microbatch.
                Lower bounds: attention 0.5
                (FlashAttention-2 runs forward and backward at 50-73 % of the A100's peak, Dao 2023, where
                large GEMMs run at 70-85 %), bandwidth 0.5 (copies reach 80-90 % of HBM bandwidth); without
                them the few long-sequence rows let the fit explain a slow row by an attention 10x slower
                than a GEMM (A100: 0.09).  ``gemm_half_dim`` is kept (23,
                the consumer fits' median): these rows' GEMM dims are all >= 768, where it moves a rate
                by <= 3 %, so they cannot pin it.
  loss       -- soft-L1 least squares on log(surrogate / published), scale 0.1 (a row off by more
                than ~10 % pulls linearly, not quadratically), over that GPU's compute-bound rows of the fit half.
  halves     -- the priceable rows shuffled with ``random.Random(seed)`` (seed 0): the first half is
                fitted, the second only scored.
  compute-bound -- a fit-half row is fitted on only where the plan spends at least ``COMPUTE_SHARE`` of
                its step at P0 computing (compute, bubble and optimizer over ``total0``): the surrogate
                holds communication as priced, so a row whose step is mostly exposed collectives cannot
                tell a kernel number, and the fit would bend the kernels to make up for the
                communication (2026-11-29: Megatron's 48-node replicated-dp rows, 36-86 % communication
                at P0, pulled the H100's GEMM efficiency up to 0.535 and every compute-bound H100 row
                11-45 % too fast).  The share comes from the model's own P0 prediction, never from the
                published time, and every row of the held-out half is scored.
"""
from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

from autosplit.cost_model.kernels import gemm_shape
from autosplit.cost_model.measured import op_class
from autosplit.cost_model.roofline import output_dtype

PARAMS = ("gemm_efficiency", "attention_efficiency", "bandwidth_efficiency", "op_overhead")
FITTED = PARAMS[:3]             # see *fitted*
LOWER = (0.05, 0.5, 0.5)
UPPER = (1.0, 1.0, 1.0)
LAUNCH = 4e-6
SEED = 0
COMPUTE_SHARE = 0.8      # see *compute-bound*
_CLASS = {"matmul": 1, "attention": 2}
_HALF = (torch.bfloat16, torch.float16)


@dataclasses.dataclass
class RowFeatures:
    """One row's plan, priced at P0 (see *features*)."""
    id: str
    gpu: str
    published_s: float
    total0: float
    compute0: float
    bubble0: float
    optimizer0: float
    m: int
    base: dict         # PARAMS of P0, the profile the plan was priced with
    ops: list          # [class code, half?, fwd flops, bwd flops, fwd bytes, bwd bytes, m, n, k, count, recomputed]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _stage_ops(plan, stage: int) -> list[list]:
    """The op rows of one stage's nodes (those ``roofline.graph_time`` prices), identical ones merged."""
    table: dict[tuple, int] = {}
    for n in plan.graph.graph.nodes:
        cost = n.meta.get("cost")
        if n.meta.get("stage") != stage or cost is None:
            continue
        if not any(isinstance(x, torch.Tensor) for x in tree_leaves(n.meta.get("val"))):
            continue
        shape = gemm_shape(n) or (0, 0, 0, 0)
        key = (_CLASS.get(op_class(n, cost), 0), int(output_dtype(n) in _HALF), float(cost.fwd_flops),
               float(cost.bwd_flops), float(cost.fwd_bytes), float(cost.bwd_bytes), *map(float, shape[1:]))
        table[key] = table.get(key, 0) + 1
    return [[*k, c] for k, c in sorted(table.items())]


def features_of(plan, row, profile) -> RowFeatures:
    """The features of ``row`` (datacenter_rows.Row) from its compiled ``plan``, priced with ``profile``
    (the profile the plan was compiled with).  A stage's recomputed forward is read off its priced
    backward: the seconds beyond its ops' backward, as a fraction of its ops' forward."""
    pred = plan.predicted_step(profile)
    ops = []
    for s in plan.stages:
        if s.pp_rank != pred.rank:
            continue
        rows = _stage_ops(plan, s.index)
        fwd, bwd = op_seconds(np.asarray(rows, dtype=float)[:, :9], profile)
        count = np.asarray(rows, dtype=float)[:, 9]
        f, b = float(np.sum(count * fwd)), float(np.sum(count * bwd))
        again = min(max((s.bwd_time - b) / f, 0.0), 2.0) if f > 0 and plan.recompute else 0.0
        ops += [[*r, again] for r in rows]
    return RowFeatures(row.id, row.gpu, row.published_s, pred.total, pred.compute, pred.bubble,
                       getattr(pred, "optimizer", 0.0), plan.num_microbatches,
                       {k: getattr(profile, k) for k in PARAMS}, ops)


def op_seconds(ops: np.ndarray, profile) -> tuple[np.ndarray, np.ndarray]:
    """Per op row (see RowFeatures.ops), (forward s, backward s) with launches: kernels.kernel_parts,
    vectorized (tests/test_datacenter_fit.py checks the two agree)."""
    cls, half, ff, bf, fb, bb = (ops[:, i] for i in range(6))
    dims = ops[:, 6:9]
    bandwidth = profile.mem_bandwidth * profile.bandwidth_efficiency
    half_rate = profile.flops_for(torch.bfloat16)
    fp32 = profile.flops_for(torch.float32)
    eff = np.full(len(ops), profile.gemm_efficiency)
    if profile.gemm_half_dim > 0:
        shaped = dims[:, 0] > 0
        eff = np.where(shaped, eff * np.prod(dims / (dims + profile.gemm_half_dim), axis=1), eff)
    gemm_rate = np.where(half > 0, half_rate, fp32) * eff * np.where(cls == 2, profile.attention_efficiency, 1.0)
    rate = np.where(cls > 0, gemm_rate, fp32)
    fwd = np.maximum(ff / rate, fb / bandwidth)
    bwd = np.maximum(bf / rate, bb / bandwidth)
    fwd = fwd + np.where(fwd > 0, profile.op_overhead, 0.0)
    bwd = bwd + np.where(bwd > 0, np.where(cls == 1, 2, 1) * profile.op_overhead, 0.0)
    return fwd, bwd


def compute_seconds(feat: RowFeatures, profile) -> float:
    """compute(p) of a row (see Terms)."""
    ops = np.asarray(feat.ops, dtype=float)
    fwd, bwd = op_seconds(ops, profile)
    count, again = ops[:, 9], ops[:, 10]
    return feat.m * float(np.sum(count * (fwd * (1 + again) + bwd)))


def surrogate(feat: RowFeatures, profile, base) -> float:
    """The step's seconds on ``profile`` as the fit sees it (see *surrogate*); ``base`` is P0."""
    c0 = compute_seconds(feat, base)
    scale = compute_seconds(feat, profile) / c0 - 1 if c0 > 0 else 0.0
    return (feat.total0 + (feat.compute0 + feat.bubble0) * scale
            + feat.optimizer0 * (base.bandwidth_efficiency / profile.bandwidth_efficiency - 1))


def halves(ids, seed: int = SEED) -> tuple[list[str], list[str]]:
    """(fitted ids, held-out ids): the ids shuffled with ``seed``, cut in two (see *halves*)."""
    order = sorted(ids)
    random.Random(seed).shuffle(order)
    cut = (len(order) + 1) // 2
    return sorted(order[:cut]), sorted(order[cut:])


def with_params(base, values) -> object:
    return dataclasses.replace(base, **dict(zip(PARAMS, (float(v) for v in values))))


def fit_gpu(features: list[RowFeatures], base) -> dict[str, float]:
    """The PARAMS of one GPU fitted to ``features`` (its fit-half rows) from profile ``base`` (P0)."""
    from scipy.optimize import least_squares
    if not features:
        raise ValueError(f"no rows to fit {base.name} on")

    def residuals(x):
        p = with_params(base, (*x, LAUNCH))
        return [math.log(max(surrogate(f, p, base), 1e-12) / f.published_s) for f in features]

    start = np.clip([getattr(base, k) for k in FITTED], LOWER, UPPER)
    res = least_squares(residuals, start, bounds=(LOWER, UPPER), loss="soft_l1", f_scale=0.1, x_scale="jac")
    return {**{k: float(v) for k, v in zip(FITTED, res.x)}, "op_overhead": LAUNCH}


def errors(features: list[RowFeatures], profile, base) -> dict[str, float]:
    """Per row id, surrogate / published - 1 on ``profile``."""
    return {f.id: surrogate(f, profile, base) / f.published_s - 1 for f in features}


def base_profile(feat: RowFeatures):
    """P0 of a row: its GPU's built-in profile with the kernel numbers it was priced with."""
    from autosplit.cost_model.device import BUILTIN
    return dataclasses.replace(BUILTIN[feat.gpu], **feat.base)


def compute_share(feat: RowFeatures) -> float:
    """The share of a row's step at P0 that is computing (see *compute-bound*)."""
    return (feat.compute0 + feat.bubble0 + feat.optimizer0) / feat.total0 if feat.total0 > 0 else 0.0


def fit_all(features: list[RowFeatures], gpus=("h100", "a100"), seed: int = SEED) -> tuple[dict, dict]:
    """({gpu: fitted PARAMS}, {gpu: the row ids fitted on}): each GPU on its compute-bound rows of the
    fit half (see *compute-bound*)."""
    fit_ids, _ = halves([f.id for f in features], seed)
    fitted, rows = {}, {}
    for gpu in gpus:
        mine = [f for f in features if f.gpu == gpu and f.id in fit_ids and compute_share(f) >= COMPUTE_SHARE]
        bases = {tuple(sorted(f.base.items())) for f in mine}
        if len(bases) != 1:
            raise ValueError(f"{gpu}: the fit half's rows were priced with {len(bases)} different profiles")
        fitted[gpu] = fit_gpu(mine, base_profile(mine[0]))
        rows[gpu] = [f.id for f in mine]
    return fitted, rows
