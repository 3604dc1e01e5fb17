"""Measure this machine's DeviceProfile in a few seconds.

Terms:
  budget      -- wall-clock seconds a measurement may spend on its timed repeats (warm-up excluded).
  matmul rate -- FLOP/s of ``torch.mm`` on square n x n matrices (2 n^3 FLOPs), n grown from 128 until one
                 multiply takes a tenth of the budget (or n hits a cap), median of the repeats.
  copy rate   -- bytes/s of ``dst.copy_(src)`` on a 64 MiB tensor, counting the read and the write.
  link        -- two processes (torch.multiprocessing, "spawn") joined by a gloo process group over
                 127.0.0.1; latency is half a ping-pong of a 4-byte tensor, bandwidth the one-way time
                 of a 16 MiB tensor minus one latency.  This is loopback TCP, a stand-in for an
                 intra-node link; when it cannot run, link bandwidth falls back to the copy rate and
                 latency to 50 us, and the profile name says so.

The thread count is whatever torch uses already (OMP_NUM_THREADS / torch.set_num_threads); we never change it.
"""
from __future__ import annotations

import os
import socket
import statistics
import time

import torch

from autosplit.cost_model.device import DeviceProfile

FALLBACK_LATENCY = 50e-6
_LINK_BYTES = 16 << 20
_PINGS, _SENDS = 200, 5


def _sync(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _timed(fn, sync) -> float:
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def _median_time(fn, sync, budget: float, min_reps: int = 3, max_reps: int = 100) -> float:
    """Median seconds of ``fn()`` after one warm-up, repeated until ``budget`` is spent."""
    _timed(fn, sync)
    times, start = [], time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget and len(times) < max_reps):
        times.append(_timed(fn, sync))
    return statistics.median(times)


def matmul_flops(dtype: torch.dtype, device: torch.device, budget: float) -> float:
    """FLOP/s of torch.mm in ``dtype``: 2 n^3 FLOPs per n x n multiply."""
    sync, n_max = _sync(device), (8192 if device.type == "cuda" else 2048)
    n = 128
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        t = _timed(lambda: torch.mm(a, b), sync)
        if t > budget / 10 or n >= n_max:
            break
        n *= 2
    t = _median_time(lambda: torch.mm(a, b), sync, budget)
    return 2 * n ** 3 / t


def copy_bandwidth(device: torch.device, budget: float, nbytes: int = 64 << 20) -> float:
    """Bytes/s of a large tensor copy (each copy reads and writes ``nbytes``)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), _sync(device), budget)
    return 2 * nbytes / t


def op_overhead(device: torch.device, budget: float) -> float:
    """Seconds per tiny op (dispatch / launch cost): the time of adding two 8-element tensors."""
    a = torch.ones(8, device=device)
    sync = _sync(device)
    reps = 200
    return _median_time(lambda: [a.add(a) for _ in range(reps)], sync, budget) / reps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _link_worker(rank: int, port: int, queue) -> None:
    """Rank 0 pings rank 1; rank 0 reports (latency s, bandwidth B/s) on ``queue``."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    small, big = torch.zeros(1), torch.empty(_LINK_BYTES // 4)
    peer = 1 - rank

    def ping(tensor: torch.Tensor, n: int) -> float:  # seconds per (send tensor, get 4-byte ack)
        t0 = time.perf_counter()
        for _ in range(n):
            if rank == 0:
                dist.send(tensor, peer)
                dist.recv(small, peer)
            else:
                dist.recv(tensor, peer)
                dist.send(small, peer)
        return (time.perf_counter() - t0) / n

    ping(small, 10)                       # warm up the connection
    latency = ping(small, _PINGS) / 2
    ping(big, 1)
    one_way = ping(big, _SENDS) - latency
    if rank == 0:
        queue.put((latency, _LINK_BYTES / max(one_way, 1e-9)))
    dist.barrier()
    dist.destroy_process_group()


def measure_link(timeout: float = 20.0) -> tuple[float, float]:
    """(latency s, bandwidth B/s) between two local gloo processes; raises RuntimeError if they fail."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue, port = ctx.SimpleQueue(), _free_port()
    procs = [ctx.Process(target=_link_worker, args=(r, port, queue), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while queue.empty():
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                why = f"worker exit codes {failed}" if failed else f"no result in {timeout:.0f} s"
                raise RuntimeError(f"link measurement failed: {why}")
            time.sleep(0.01)
        result = queue.get()
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        return result
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def calibrate(seconds: float = 1.0, *, link: bool = True, link_timeout: float = 10.0,
              device="cpu") -> DeviceProfile:
    """Measure matmul FLOP/s (fp32, bf16, fp16), copy bandwidth, per-op overhead and (if ``link``) a
    2-process link.

    ``seconds`` is split over the five timed measurements; warm-ups, process start-up (about a second
    per process for ``import torch``) and small-size probing come on top.  The link measurement gives up
    after ``link_timeout`` seconds.  ``device`` may be a CUDA device (matmul and copy run there; the link
    is still measured between two CPU processes).
    """
    device = torch.device(device)
    share = seconds / 5
    flops = {dt: matmul_flops(dt, device, share) for dt in (torch.float32, torch.bfloat16, torch.float16)}
    mem_bw = copy_bandwidth(device, share)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"cpu, {torch.get_num_threads()} threads"
    name = f"{device.type} (calibrated: {where})"
    latency, link_bw = FALLBACK_LATENCY, mem_bw
    if link:
        try:
            latency, link_bw = measure_link(link_timeout)
        except Exception as exc:  # any failure to start or run the processes: fall back, say so
            name += f" [link not measured ({type(exc).__name__}: {exc}); copy bandwidth and 50 us assumed]"
    else:
        name += " [link not measured; copy bandwidth and 50 us assumed]"
    return DeviceProfile(name=name, peak_flops=flops, mem_bandwidth=mem_bw, link_bandwidth=link_bw,
                         link_latency=latency, memory_bytes=_memory_bytes(device),
                         op_overhead=op_overhead(device, share), device_type=device.type)
