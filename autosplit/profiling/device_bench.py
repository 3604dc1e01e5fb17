"""Measure one device's kernel model in a bounded time: a GEMM sweep, fused attention, a copy, tiny ops.

Terms (kernel model: cost_model/kernels.py; the fits: kernel_fit.py):
  working dtype -- what the sweep times: bfloat16 on CUDA (float16 where bf16 is not supported), float32 on
                   CPU.  The profile's efficiencies hold for every dtype (each scales its own peak).
  sweep         -- GEMMs from tiny to large, square, skinny (one small dimension) and batched (attention's
                   bmm), and ViT-like projections; each timed alone (``torch.mm`` / ``torch.bmm`` into a
                   preallocated output).  Then F.scaled_dot_product_attention at a few (B, H, L, D), a copy
                   of a large tensor (CUDA 512 MiB, CPU 64 MiB: each copy reads and writes it), and an add on
                   8 elements (the per-kernel cost: ``op_overhead``).
  timing        -- per kernel: one warm-up, one timed call to size the batches, then ``ROUNDS`` batches of
                   back-to-back calls filling the kernel's share of the budget; the median batch's time per
                   call.  On CUDA torch.cuda.Event pairs time the batches on the device; on CPU
                   time.perf_counter.  Inputs come from a private seeded generator: the caller's random
                   streams are left as they were.
  budget        -- ``seconds`` of timed batches (GEMMs 60 %, attention 20 %, copy and tiny ops 10 % each);
                   warm-ups and sizing come on top (a few seconds on a GPU, the largest CPU GEMM's few
                   calls on a CPU).  Default 5 s: well under a minute per device.
  peak          -- the FLOP/s ``gemm_efficiency`` is a fraction of: a known GPU's datasheet peak for the
                   working dtype (its built-in profile: cost_model.profile_for_gpu), and then
                   ``mem_bandwidth`` is the datasheet's too and ``bandwidth_efficiency`` the copy's
                   fraction of it.  Elsewhere (a CPU, an unknown GPU) there is no datasheet: the sweep's
                   largest measured rate starts the fit, the fitted asymptote (the rate of an unboundedly
                   large GEMM) becomes the peak, and ``gemm_efficiency`` is then 1; likewise the measured
                   copy rate becomes ``mem_bandwidth`` with ``bandwidth_efficiency`` 1.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from autosplit.cost_model.device import DeviceProfile
from autosplit.errors import AutosplitError
from autosplit.profiling import kernel_fit

ROUNDS = 5
SHARES = {"gemm": 0.6, "attention": 0.2, "copy": 0.1, "tiny": 0.1}
# (batch, m, n, k); see *sweep*
CUDA_GEMMS = (*[(1, d, d, d) for d in (64, 128, 256, 512, 1024, 2048, 4096, 8192)],
              (1, 16384, 1024, 1024), (1, 8192, 8192, 128), (1, 128, 8192, 8192), (1, 8192, 64, 8192),
              (1, 4096, 16, 4096), (1, 3152, 2304, 768), (1, 3152, 3072, 768), (1, 3152, 768, 3072),
              (96, 197, 197, 64), (96, 197, 64, 197), (256, 256, 256, 64))
CPU_GEMMS = (*[(1, d, d, d) for d in (16, 32, 64, 128, 256, 512, 1024)],
             (1, 2048, 256, 256), (1, 64, 1024, 1024), (1, 1024, 32, 1024), (1, 260, 576, 192),
             (1, 260, 192, 768), (24, 65, 65, 64), (24, 65, 64, 65))
# (B, H, L, D); keys and values as long as the queries
CUDA_ATTENTION = ((8, 12, 197, 64), (16, 12, 256, 64), (4, 16, 1024, 64), (2, 16, 4096, 128), (1, 16, 8192, 128))
CPU_ATTENTION = ((2, 3, 65, 64), (8, 6, 65, 32), (2, 4, 256, 64), (1, 4, 512, 64))
COPY_BYTES = {"cuda": 512 << 20, "cpu": 64 << 20}


@dataclass(frozen=True)
class KernelMeasurement:
    """One device's measured kernel model (see Terms); ``apply`` puts it into a profile."""
    device: str                  # what was measured ("NVIDIA H100 80GB HBM3", "cpu")
    dtype: torch.dtype           # the working dtype
    peak_flops: float            # FLOP/s gemm_efficiency is a fraction of
    datasheet: bool              # peak_flops and mem_bandwidth are a built-in profile's (else measured)
    mem_bandwidth: float         # B/s bandwidth_efficiency is a fraction of
    gemm_efficiency: float
    gemm_half_dim: float
    attention_efficiency: float
    bandwidth_efficiency: float
    op_overhead: float           # s per kernel
    gemm: tuple                  # ((batch, m, n, k), seconds) per GEMM timed
    attention: tuple             # ((B*H, L, S, D), seconds) per SDPA timed
    wall_s: float                # seconds the measurement took, warm-ups included

    def apply(self, profile: DeviceProfile) -> DeviceProfile:
        """``profile`` with this measurement's kernel model (and, where measured, its peak for the working
        dtype and its memory bandwidth)."""
        peak = dict(profile.peak_flops)
        if not self.datasheet:
            peak[self.dtype] = self.peak_flops
        return dataclasses.replace(profile, peak_flops=peak, mem_bandwidth=self.mem_bandwidth,
                                   op_overhead=self.op_overhead, gemm_efficiency=self.gemm_efficiency,
                                   gemm_half_dim=self.gemm_half_dim,
                                   attention_efficiency=self.attention_efficiency,
                                   bandwidth_efficiency=self.bandwidth_efficiency)

    def summary(self) -> str:
        """The fitted numbers, one line each."""
        dt = str(self.dtype).removeprefix("torch.")
        where = "datasheet" if self.datasheet else "measured"
        return "\n".join((
            f"{self.device}: {len(self.gemm)} GEMMs and {len(self.attention)} attention kernels in {dt}, "
            f"{self.wall_s:.1f} s",
            f"  GEMM: {self.gemm_efficiency:.3f} of {self.peak_flops / 1e12:.4g} TFLOP/s ({where} peak), "
            f"half-rate dimension {self.gemm_half_dim:.0f}",
            f"  attention (SDPA): {self.attention_efficiency:.3f} of the GEMM rate of its shape",
            f"  memory-bound kernels: {self.bandwidth_efficiency:.3f} of {self.mem_bandwidth / 1e9:.4g} GB/s "
            f"({where})",
            f"  per-kernel overhead: {self.op_overhead * 1e6:.2f} us"))


def working_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def _datasheet(device: torch.device) -> DeviceProfile | None:
    """A known GPU's built-in profile; None on CPU or an unknown GPU (see *peak*)."""
    if device.type != "cuda":
        return None
    from autosplit.cost_model import profile_for_gpu
    try:
        return profile_for_gpu(torch.cuda.get_device_name(device))
    except AutosplitError:
        return None


class _Timer:
    """Seconds per call of a kernel on ``device`` (see *timing*)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _batch(self, fn, reps: int) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps

    def per_call(self, fn, budget: float) -> float:
        fn()
        self._sync()
        first = self._batch(fn, 1)
        rounds = ROUNDS if first * ROUNDS <= budget else 3
        reps = max(1, min(100_000, int(budget / rounds / max(first, 1e-7))))
        return statistics.median(self._batch(fn, reps) for _ in range(rounds))


def _randn(shape, dtype, device, generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator, device=generator.device).to(device=device, dtype=dtype)


def _gemm_time(timer, shape, dtype, device, budget: float, generator) -> float:
    b, m, n, k = shape
    lead = () if b == 1 else (b,)
    x, w = _randn((*lead, m, k), dtype, device, generator), _randn((*lead, k, n), dtype, device, generator)
    y = torch.empty(*lead, m, n, dtype=dtype, device=device)
    mul = torch.mm if b == 1 else torch.bmm
    return timer.per_call(lambda: mul(x, w, out=y), budget)


def _attention_time(timer, shape, dtype, device, budget: float, generator) -> float:
    q, k, v = (_randn(shape, dtype, device, generator) for _ in range(3))
    with torch.no_grad():
        return timer.per_call(lambda: F.scaled_dot_product_attention(q, k, v), budget)


def _copy_bandwidth(timer, device, budget: float) -> float:
    """Bytes/s of a large copy: each reads and writes ``COPY_BYTES``."""
    nbytes = COPY_BYTES[device.type]
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timer.per_call(lambda: dst.copy_(src), budget)


def measure_device(device="cpu", seconds: float = 5.0) -> KernelMeasurement:
    """Time this device's kernels and fit its kernel model (see Terms).

    Args:
        device: "cpu", "cuda" or a CUDA device ("cuda:1").
        seconds: the budget of timed batches (see *budget*); more gives steadier medians.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise AutosplitError(f"seconds={seconds!r}: expected a positive number of seconds for the device measurement")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise AutosplitError(f"device={device!r}: expected 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type not in ("cpu", "cuda"):
        raise AutosplitError(f"device={str(device)!r}: the device measurement runs on 'cpu' or a CUDA device")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise AutosplitError(f"device={str(device)!r}: no CUDA device is available here")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    start = time.perf_counter()
    cuda = device.type == "cuda"
    dtype, timer = working_dtype(device), _Timer(device)
    elem = torch.finfo(dtype).bits // 8
    generator = torch.Generator(device=device)
    generator.manual_seed(0)
    shapes = CUDA_GEMMS if cuda else CPU_GEMMS
    gemms = [(s, _gemm_time(timer, s, dtype, device, seconds * SHARES["gemm"] / len(shapes), generator))
             for s in shapes]
    shapes = CUDA_ATTENTION if cuda else CPU_ATTENTION
    attention = [((b * h, length, length, d),
                  _attention_time(timer, (b, h, length, d), dtype, device, seconds * SHARES["attention"] / len(shapes),
                                  generator))
                 for b, h, length, d in shapes]
    copy_bw = _copy_bandwidth(timer, device, seconds * SHARES["copy"])
    tiny = torch.ones(8, device=device)
    overhead = timer.per_call(lambda: tiny.add_(1.0), seconds * SHARES["tiny"])
    datasheet = _datasheet(device)
    if datasheet is not None:
        peak, mem_bw = datasheet.flops_for(dtype), datasheet.mem_bandwidth
        eff, half = kernel_fit.fit_gemm(gemms, peak, copy_bw, overhead, elem)
    else:            # no datasheet: the fitted asymptote is the peak (see *peak*)
        largest = max(kernel_fit.gemm_flops(s) / t for s, t in gemms)
        eff, half = kernel_fit.fit_gemm(gemms, largest, copy_bw, overhead, elem, max_efficiency=1e3)
        peak, eff, mem_bw = largest * eff, 1.0, copy_bw
    attention_eff = kernel_fit.fit_attention(attention, peak, eff, half, copy_bw, overhead, elem)
    name = torch.cuda.get_device_name(device) if cuda else f"cpu ({torch.get_num_threads()} threads)"
    return KernelMeasurement(device=name, dtype=dtype, peak_flops=peak, datasheet=datasheet is not None,
                             mem_bandwidth=mem_bw, gemm_efficiency=eff, gemm_half_dim=half,
                             attention_efficiency=attention_eff, bandwidth_efficiency=copy_bw / mem_bw,
                             op_overhead=overhead, gemm=tuple(gemms), attention=tuple(attention),
                             wall_s=time.perf_counter() - start)
