"""Fit the kernel model's numbers to timed kernels: the arithmetic of device_bench.py, with no device.

Terms (the kernel model: cost_model/kernels.py, cost_model/device.py):
  GEMM shape  -- (batch, m, n, k): ``batch`` products of (m x k) @ (k x n); 2 * batch * m * n * k FLOPs, and
                 batch * (m k + k n + m n) elements read or written.
  rate        -- peak * gemm_efficiency * prod over d in (m, n, k) of d / (d + gemm_half_dim).
  model time  -- max(FLOPs / rate, bytes / bandwidth) + overhead: a kernel is limited by compute or by
                 memory traffic, and every kernel pays ``op_overhead`` (the launch) beside its work.
                 ``bandwidth`` is what memory-bound kernels reach (mem_bandwidth * bandwidth_efficiency).
  attention   -- F.scaled_dot_product_attention on (B, H, L, D) queries and (B, H, S, D) keys and values:
                 the GEMM shape (B*H, L, S, D); cost_model/flops.py's count of its forward FLOPs
                 (2 * B*H * L * S * 2D for QK^T and PV, plus 5 * B*H * L * S for the softmax); its rate is
                 the GEMM rate of that shape times ``attention_efficiency``.
  fit         -- least squares on relative error (model time / measured time - 1), because the times span
                 orders of magnitude (scipy.optimize.least_squares, from a few starting points, the best
                 kept).  gemm_efficiency is bounded to [1e-3, 1.5] (higher where the peak is itself a measured
                 rate: ``max_efficiency``) and gemm_half_dim to [0, 65536] (a
                 dimension beyond anything a sweep times); attention_efficiency to [1e-3, 8].
"""
from __future__ import annotations

import math

import numpy as np
from scipy.optimize import least_squares

MAX_HALF_DIM = 65536.0


def gemm_flops(shape) -> float:
    b, m, n, k = shape
    return 2.0 * b * m * n * k


def gemm_bytes(shape, elem_bytes: int) -> float:
    b, m, n, k = shape
    return float(b * (m * k + k * n + m * n) * elem_bytes)


def shape_factor(shape, half_dim: float) -> float:
    """prod over d in (m, n, k) of d / (d + half_dim): how far a shape's rate falls below a large GEMM's."""
    return math.prod(d / (d + half_dim) for d in shape[1:]) if half_dim > 0 else 1.0


def gemm_seconds(shape, peak: float, efficiency: float, half_dim: float, bandwidth: float, overhead: float,
                 elem_bytes: int) -> float:
    """The kernel model's time of one GEMM of ``shape`` (see *model time*)."""
    rate = peak * efficiency * shape_factor(shape, half_dim)
    return max(gemm_flops(shape) / rate, gemm_bytes(shape, elem_bytes) / bandwidth) + overhead


def attention_flops(shape) -> float:
    """Forward FLOPs of SDPA of GEMM shape (B*H, L, S, D), no mask, no dropout (cost_model/flops.py's count)."""
    bh, length, keys, dim = shape
    scores = bh * length * keys
    return 2.0 * scores * 2 * dim + 5.0 * scores


def attention_bytes(shape, elem_bytes: int) -> float:
    """Bytes SDPA reads and writes: queries, keys, values and output (the scores stay on chip)."""
    bh, length, keys, dim = shape
    return float(bh * (2 * length * dim + 2 * keys * dim) * elem_bytes)


def attention_seconds(shape, peak: float, efficiency: float, half_dim: float, attention_efficiency: float,
                      bandwidth: float, overhead: float, elem_bytes: int) -> float:
    """The kernel model's time of one SDPA forward of GEMM shape (B*H, L, S, D)."""
    rate = peak * efficiency * shape_factor(shape, half_dim) * attention_efficiency
    return max(attention_flops(shape) / rate, attention_bytes(shape, elem_bytes) / bandwidth) + overhead


def _check(samples, what: str) -> None:
    if not samples:
        raise ValueError(f"no timed {what} to fit")
    bad = [(s, t) for s, t in samples if not (t > 0 and math.isfinite(t))]
    if bad:
        raise ValueError(f"{what} timed at a non-positive or non-finite time: {bad[:3]}")


def fit_gemm(samples: list, peak: float, bandwidth: float, overhead: float = 0.0, elem_bytes: int = 2,
             max_efficiency: float = 1.5) -> tuple[float, float]:
    """(gemm_efficiency, gemm_half_dim) that make the model time closest to ``samples`` (see *fit*).

    Args:
        samples: [((batch, m, n, k), seconds)] measured.
        peak: the FLOP/s the efficiency is a fraction of.
        bandwidth: bytes/s memory-bound kernels reach (the copy measured alongside).
        overhead: seconds every kernel adds (the launch measured alongside).
        elem_bytes: bytes per element of the timed dtype.
        max_efficiency: the efficiency's upper bound (larger where ``peak`` is a measured rate, not a
            datasheet's: the asymptote then lies above it).
    """
    _check(samples, "GEMMs")
    shapes = [s for s, _ in samples]
    times = np.array([t for _, t in samples])

    def residuals(x):
        eff, half = x
        return np.array([gemm_seconds(s, peak, eff, half, bandwidth, overhead, elem_bytes) for s in shapes]) / times - 1

    best = None
    start_eff = min(1.0, max(1e-3, max(gemm_flops(s) / max(t - overhead, t * 1e-3) for s, t in samples) / peak))
    high = max(max_efficiency, 2 * start_eff)
    for half in (16.0, 128.0, 1024.0):
        result = least_squares(residuals, x0=(start_eff, half), bounds=((1e-3, 0.0), (high, MAX_HALF_DIM)),
                               x_scale=(0.1, half), xtol=1e-12, ftol=1e-12, gtol=1e-12)
        if best is None or result.cost < best.cost:
            best = result
    eff, half = best.x
    return float(eff), float(half)


def fit_attention(samples: list, peak: float, efficiency: float, half_dim: float, bandwidth: float,
                  overhead: float = 0.0, elem_bytes: int = 2) -> float:
    """attention_efficiency that makes the model time closest to ``samples`` [((B*H, L, S, D), seconds)],
    given the GEMM fit (``efficiency``, ``half_dim``) and the other arguments as for ``fit_gemm``."""
    _check(samples, "attention kernels")
    shapes = [s for s, _ in samples]
    times = np.array([t for _, t in samples])

    def residuals(x):
        return np.array([attention_seconds(s, peak, efficiency, half_dim, x[0], bandwidth, overhead, elem_bytes)
                         for s in shapes]) / times - 1

    result = least_squares(residuals, x0=(0.5,), bounds=((1e-3,), (8.0,)), xtol=1e-12, ftol=1e-12, gtol=1e-12)
    return float(result.x[0])
