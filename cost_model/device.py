"""What a device can do, as the few numbers the cost model needs.

Terms:
  peak FLOP/s     -- dense matrix-multiply throughput per dtype, floating-point operations per second
                     (a multiply-accumulate is 2 FLOPs).  For float32 on NVIDIA parts we use the plain
                     FP32 (CUDA-core, non-tensor-core) figure, not TF32: PyTorch leaves TF32 matmuls off
                     by default (``torch.backends.cuda.matmul.allow_tf32 = False``).
  mem bandwidth   -- bytes per second between the device's main memory (HBM, DRAM) and its compute units.
  link bandwidth  -- bytes per second, ONE direction, between two devices of one node (NVLink here).
  link latency    -- seconds of fixed cost per message on that link (the alpha of the alpha-beta model).
  op overhead     -- seconds of fixed cost per op (a GPU kernel launch, a CPU dispatch): small models are
                     dominated by it, so without it tiny stages would look free.
  device type     -- "cuda" or "cpu": where the profiled device runs, so the planner applies that device's
                     autocast op lists (CUDA keeps layer_norm / softmax in float32 under autocast, CPU does not).
  profile         -- a frozen ``DeviceProfile`` holding the numbers above, plus the memory size.
  sharing         -- on a CPU host running several ranks: ``sharing[n-1]`` is how much slower each compute
                     runs while n processes of the job compute at once (cores, caches and memory
                     bandwidth are shared; 1.0 for n = 1), measured in the live world
                     (profiling/sharing_bench.py); the step predictor stretches computes by it.  Its length
                     is the ranks per host.  None: each device is its own (GPUs).
  p2p post        -- host seconds to post one group of pipeline transfers (profiling/comm_bench.py): on a
                     CPU the host that posts is the one that computes, so the step predictor puts it on
                     the rank's timeline; 0 where the host posts while a device computes (GPUs).
  p2p wake        -- extra seconds a transfer takes to reach a rank that waits for it while the host's other
                     ranks compute (profiling/sharing_bench.py's *wake*: the waiting rank must win a core
                     back); the step predictor adds it to such a rank's next compute.  0 on GPUs and
                     with fewer than 3 ranks per host.
  resume          -- (forward, backward) factors: how much longer a pass takes when it starts after its
                     rank sat idle (a pipeline rank waiting for a transfer) than back to back; measured on
                     a CPU in the live world (profiling/resume_bench.py), 1.0 on GPUs.  The step predictor
                     stretches such computes by it.
  pass overhead   -- seconds a pass takes beyond that when it starts after its rank sat idle: what a real
                     pipeline of the host pays (the scheduler, the other ranks' threads and caches) that the
                     parts measured one at a time miss; fitted so that the step predictor reproduces a
                     reference pipeline measured on a CPU host (cost_model/pipeline_fit.py), 0 on GPUs.
  measured fits   -- optional ``compute`` (per op class) and ``comm`` (per collective kind, group
                     size and node span) fits from a measured profile (measured.py); without them the
                     kernel model (kernels.py) and the topology's collectives (comm.py) price everything.
  kernel model    -- how far real kernels fall short of the peaks (kernels.py): ``gemm_efficiency`` (the
                     fraction of peak a large GEMM reaches), ``gemm_half_dim`` (a GEMM dimension of this
                     size halves the rate: tile and wave quantization of small and skinny matmuls),
                     ``attention_efficiency`` (a fused attention kernel's rate relative to a GEMM of the
                     same shape), ``bandwidth_efficiency`` (the fraction of ``mem_bandwidth`` memory-bound
                     kernels reach).  Defaults 1 / 0: the plain roofline.
  topology        -- ``gpus_per_node`` (None: every rank of the job on one node), the intra-node link
                     (``link_bandwidth``: bus bandwidth of ring collectives, per direction; ``link_latency``;
                     ``allreduce_bandwidth``: the all-reduce bus bandwidth where the switch reduces (NVLink
                     SHARP), else the link's) and the inter-node network (``network_bandwidth``: bytes per
                     second per GPU, one direction; ``network_latency``).

Built-in profiles come from the vendor datasheets (dense figures, i.e. without 2:4 sparsity):
  H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100/):
             BF16/FP16 tensor core 989 TFLOPS dense (1979 with sparsity), FP32 67 TFLOPS,
             HBM3 3.35 TB/s, NVLink 900 GB/s total = 450 GB/s per direction, 80 GB.
  H200 SXM:  NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200/): the H100's
             compute (BF16/FP16 989 TFLOPS dense, FP32 67 TFLOPS), HBM3e 4.8 TB/s, NVLink 900 GB/s total, 141 GB.
  A100 SXM4 80GB: NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100/):
             BF16/FP16 tensor core 312 TFLOPS dense, FP32 19.5 TFLOPS, HBM2e 2,039 GB/s,
             NVLink 600 GB/s total = 300 GB/s per direction, 80 GB.
  Link, network and kernel-model numbers: fitted to published measurements (see the comments below);
  every efficiency of the kernel model is at most 1 (tests/test_datacenter_fit.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


GiB = 1 << 30
_HALF = (torch.bfloat16, torch.float16)
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    peak_flops: dict          # torch.dtype -> FLOP/s (dense matmul)
    mem_bandwidth: float      # B/s, main memory
    link_bandwidth: float     # B/s, one direction, intra-node
    link_latency: float       # s per message
    memory_bytes: int         # device memory size
    op_overhead: float = 4e-6  # s per op launched (CUDA kernel launch + framework dispatch)
    device_type: str = "cuda"  # whose autocast rules apply: "cuda" or "cpu"
    compute: dict | None = None   # measured: op class -> (forward fit, backward fit) (measured.py); None: roofline
    comm: dict | None = None      # measured: "kind/n" -> (alpha s, beta s/B) (measured.py); None: link alpha-beta
    sharing: tuple | None = None  # measured: slowdown with n processes computing on one host, index n-1; None: unshared
    p2p_post: float = 0.0         # measured (CPU): host seconds per posted transfer group; 0: overlapped (GPUs)
    p2p_wake: float = 0.0         # measured (CPU, > 2 ranks per host): extra seconds a transfer takes to reach a
                                  # waiting rank while the host's other ranks compute; 0: not measured / not shared
    resume: tuple = (1.0, 1.0)    # measured (CPU, resume_bench.py): (forward, backward) time of a pass that starts
                                  # after an idle wait over its time back to back; 1: not measured / no such effect
    pass_overhead: float = 0.0    # fitted (CPU, pipeline_fit.py): seconds more such a pass takes; 0: not measured
    # kernel model (kernels.py); the defaults are the plain roofline
    gemm_efficiency: float = 1.0      # fraction of peak_flops a large GEMM reaches
    gemm_half_dim: float = 0.0        # GEMM dim at which the rate halves (per dim: d / (d + half)); 0: none
    attention_efficiency: float = 1.0  # fused attention's rate over a GEMM of the same shape
    bandwidth_efficiency: float = 1.0  # fraction of mem_bandwidth memory-bound kernels reach
    # topology (comm.py)
    gpus_per_node: int | None = None  # ranks per node; None: the whole job on one node
    allreduce_bandwidth: float = 0.0  # B/s intra-node all-reduce bus bandwidth (NVLS); 0: link_bandwidth
    network_bandwidth: float = 0.0    # B/s per GPU, one direction, between nodes; 0: not stated
    network_latency: float = 0.0      # s per message between nodes

    def flops_for(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s for ``dtype``, with fallbacks for dtypes the profile does not list.

        float16 <-> bfloat16 stand in for each other (same tensor-core rate on A100/H100).
        float64 is float32 / 2 (true of A100/H100 FP64 vs FP32 and of CPU SIMD; consumer GPUs are slower).
        float8 uses the 16-bit figure (conservative: Hopper runs FP8 at twice the BF16 rate).
        Anything else (ints, bool, complex) uses float32.
        """
        table = self.peak_flops
        if dtype in table:
            return table[dtype]
        if dtype in _HALF or dtype in _FP8:
            for half in _HALF:
                if half in table:
                    return table[half]
        if dtype == torch.float64:
            return table[torch.float32] / 2
        return table[torch.float32]


# The data-center parts' collectives, fitted to the published nccl-tests all-reduce rows
# (benchmarks/bench_nccl_tables.py; ../shared/reference/gpu-tables/nccl_busbw.csv): 8 GPUs per node; the
# all-reduce bus bandwidth of NVLink SHARP (H100, H200) or of the ring (A100) and the per-step link latency
# from the one-node rows; the network's per-GPU latency from the two-node rows, its bandwidth the stated
# 400 Gb/s per GPU (H100 at OCI and AWS; H200 assumed the same class), 50 Gb/s per GPU for the A100 rows
# (AWS p4de; a DGX A100 with 200 Gb/s per GPU needs its own profile: ``autosplit profile``).  Ring
# collectives (all-gather, reduce-scatter) on H100 / H200 use the ~370 GB/s effective NVLink bandwidth
# an NCCL maintainer gives (NVIDIA/nccl-tests #212).
#
# Their kernel model is fitted to published datacenter training runs
# (../shared/reference/gpu-tables/transformer_training_datacenter.csv; cost_model/datacenter_fit.py,
# benchmarks/datacenter_table.py --fit): each GPU's compute-bound rows of the table's fit half (a random half
# of the rows autosplit can price, seed 0; compute-bound: at least 80 % of the step computing as first
# priced; ``DATACENTER_FIT_ROWS`` names them), least squares on log(predicted / published) with every
# efficiency bounded by 1.  The H200 has no priceable row (both of its rows run FP8 linears): it takes the
# H100's numbers (the same GH100 compute; its own HBM3e bandwidth).  gemm_half_dim is not fitted (23, the
# consumer fits' median: these rows' GEMM dims are all >= 768), nor op_overhead (4 us: datacenter_fit.py).
# >>> datacenter fit: the lines up to the closing marker are written by benchmarks/datacenter_table.py --fit
DATACENTER_FIT = {
    "h100": dict(gemm_efficiency=0.4858, attention_efficiency=0.5, bandwidth_efficiency=0.9755, op_overhead=4.0e-6),
    "a100": dict(gemm_efficiency=0.6811, attention_efficiency=1, bandwidth_efficiency=0.5, op_overhead=4.0e-6),
}
DATACENTER_FIT_ROWS = {
    "h100": ("tt-05", "tt-15", "ao-01", "ibm-05", "ibm-06", "ibm-08", "mos-04", "mos-06", "mos-11"),
    "a100": ("tt-04", "meg-10", "ibm-01", "ibm-04", "bert-02", "bert-06", "bert-09", "mos-13", "mos-14",
              "mos-16", "mos-17", "mos-19"),
}
# <<< datacenter fit
DATACENTER_FIT["h200"] = DATACENTER_FIT["h100"]
DATACENTER_FIT_ROWS["h200"] = DATACENTER_FIT_ROWS["h100"]

H100 = DeviceProfile(
    name="h100",
    peak_flops={torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
    mem_bandwidth=3.35e12, link_bandwidth=370e9, link_latency=1.22e-6, memory_bytes=80 * GiB,
    gpus_per_node=8, allreduce_bandwidth=543e9, network_bandwidth=50e9, network_latency=35.8e-6,
    gemm_half_dim=23.0, **DATACENTER_FIT["h100"])

A100 = DeviceProfile(
    name="a100",
    peak_flops={torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12},
    mem_bandwidth=2.039e12, link_bandwidth=242e9, link_latency=1.51e-6, memory_bytes=80 * GiB,
    gpus_per_node=8, network_bandwidth=6.25e9, network_latency=82.5e-6, gemm_half_dim=23.0,
    **DATACENTER_FIT["a100"])

H200 = DeviceProfile(
    name="h200",
    peak_flops={torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
    mem_bandwidth=4.8e12, link_bandwidth=370e9, link_latency=1.02e-6, memory_bytes=141 * 10**9,
    gpus_per_node=8, allreduce_bandwidth=536e9, network_bandwidth=50e9, network_latency=35.8e-6,
    gemm_half_dim=23.0, **DATACENTER_FIT["h200"])

# Consumer and workstation GPUs of the published timm tables (../shared/reference/gpu-tables/README.md):
# datasheet tensor peaks (FP16 inputs, FP32 accumulate: what autocast matmuls use) and memory bandwidths;
# FP32 is the non-tensor vector rate.  One GPU per machine in those runs: no link, no network.
#   RTX 3090: GA102 whitepaper: 71 TFLOPS FP16 tensor (FP32 acc.), 35.6 TFLOPS FP32, 936 GB/s, 24 GB.
#   RTX 4090: Ada whitepaper v2.1: 165.2 TFLOPS FP16 tensor (FP32 acc.), 82.6 TFLOPS FP32, 1008 GB/s, 24 GB.
#   RTX 5090, RTX PRO 6000 Blackwell Max-Q: 1792 GB/s (spec listings); no verified tensor peak, so the
#             kernel model's fit stands for it (bench_gpu_tables.py); 32 GB and 96 GB.
_SINGLE = dict(link_bandwidth=32e9, link_latency=10e-6)     # PCIe 4.0 x16 per direction, if ever used


def _consumer(name, fp16, fp32, bandwidth, memory, **kernel):
    return DeviceProfile(name=name, peak_flops={torch.float16: fp16, torch.bfloat16: fp16, torch.float32: fp32},
                         mem_bandwidth=bandwidth, memory_bytes=memory, **_SINGLE, **kernel)


# The kernel model of each, fitted to its published rows by benchmarks/bench_gpu_tables.py --fit (2026-11-26;
# soft-L1 least squares on log(predicted / published), large-GEMM efficiency bounded at 0.85 where the peak
# is verified; 353 / 404 / 230 / 231 rows).  The RTX 3090 rows ran unfused attention (PyTorch 1.x), so its
# attention_efficiency is not fitted: the 4090's is used.  The 5090 and Pro 6000 peaks are the fitted
# large-GEMM rates (efficiency 1), not datasheet figures.
RTX3090 = _consumer("rtx3090", 71e12, 35.6e12, 936e9, 24 * GiB, gemm_efficiency=0.85, gemm_half_dim=44.7,
                    attention_efficiency=1.15, bandwidth_efficiency=0.609, op_overhead=11.6e-6)
RTX4090 = _consumer("rtx4090", 165.2e12, 82.6e12, 1008e9, 24 * GiB, gemm_efficiency=0.85, gemm_half_dim=1.0,
                    attention_efficiency=1.15, bandwidth_efficiency=1.0, op_overhead=61.6e-6)
RTX5090 = _consumer("rtx5090", 177.2e12, 104.8e12, 1792e9, 32 * GiB, gemm_efficiency=1.0, gemm_half_dim=1.0,
                    attention_efficiency=0.829, bandwidth_efficiency=0.742, op_overhead=18.7e-6)
RTX_PRO6000_MAXQ = _consumer("rtx_pro6000_maxq", 247.2e12, 104.8e12, 1792e9, 96 * GiB, gemm_efficiency=1.0,
                             gemm_half_dim=73.9, attention_efficiency=1.36, bandwidth_efficiency=0.826,
                             op_overhead=80.4e-6)

# every built-in profile by its name (profiles.py looks names up here)
BUILTIN = {p.name: p for p in (H100, H200, A100, RTX3090, RTX4090, RTX5090, RTX_PRO6000_MAXQ)}
