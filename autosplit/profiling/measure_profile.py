"""Measure this machine's cost-model profile in a live world, agree on it, and cache it on disk.

Terms:
  measured profile -- a DeviceProfile with the device's kernel model (device_bench.py: GEMM efficiency
               and half-rate dimension, attention efficiency, achievable bandwidth, per-kernel overhead;
               rank 0's device), ``comm`` alpha-beta fits per collective kind, group size and node span
               (comm_bench.py; see cost_model/measured.py), the topology (*topology*) and, on CPU,
               ``compute`` fits per op class (cost_model/op_bench.py), ``sharing`` (sharing_bench.py) and
               ``p2p_post`` (comm_bench.py's *post*, the slowest rank's; with 3 or more ranks on the host,
               sharing_bench.py's *loaded post*: a pipeline rank there posts while the others
               compute), ``p2p_wake`` (sharing_bench.py's *wake*: rank 0's host's) and ``resume``
               (resume_bench.py: rank 0's host's), and ``pass_overhead`` (cost_model/pipeline_fit.py, fitted
               last, to pipeline_bench.py's reference pipeline on rank 0's host).  On a known GPU the peaks
               and memory bandwidth stay the datasheet's (its built-in profile) and the kernel model says how
               much of them kernels reach; on an unknown GPU they are measured (device_bench.py *peak*).
  topology   -- ``gpus_per_node``: the ranks per node (LOCAL_WORLD_SIZE) on GPUs or wherever the job spans
               several nodes (a CPU job on one host leaves it None: one node).  On GPUs the intra-node link
               is the ring bus bandwidth of an all-gather over a whole node (``link_bandwidth``; ``link_latency``:
               the intra-node send_recv's alpha) and ``allreduce_bandwidth`` the all-reduce's bus bandwidth
               over a whole node where it beats the link's by more than 10 % (a switch that reduces, NVLS;
               else 0: the link's); on CPU the link is the send_recv fit, as before.  With several nodes the
               network is the send_recv fit between nodes (``network_bandwidth`` = 1 / beta,
               ``network_latency`` = alpha: per GPU, one direction, every pair sending at once).
  alone      -- the compute fits are rank 0's, measured while the other ranks wait in a barrier: one
               process's rates.  How ranks sharing a CPU host slow each other down is measured apart
               (profiling/sharing_bench.py: the profile's ``sharing``) and applied by the step predictor
               to whatever actually runs at once; fits taken with every rank measuring at its own pace
               mixed both and priced every configuration with the same, accidental, contention.
  in step    -- (CPU, where the host has no more ranks than cores) what a collective costs a step beyond
               its back-to-back time (comm_bench.py *in step*): per group size n, the mean over kinds
               and sizes of (in-step - back-to-back) seconds of the slowest rank, at least 0, added to
               the alpha of every collective kind on n ranks (not to send_recv: a pipeline transfer's
               host costs are ``p2p_post`` / ``p2p_wake``).  One constant per group size, not a fit per
               kind: it is lateness and host work, not bytes, and each difference alone is noisy
               (+-0.5 ms on a 2-core VM).
  shared host -- (CPU, more local ranks than cores) every collective kind on n ranks gets one alpha-beta
               fit to the in-step times of all kinds together (the slowest rank's), instead of its own
               back-to-back fit: there a collective waits for its peers to get a core back, and that
               wait, not the kind's algorithm, is its time.  Measured on a 2-core VM with 4 ranks:
               tp2 dp2's collectives waited 2.1-2.8 ms a call in the step, whatever their kind and
               however short the compute before them; the back-to-back fits said 1.3-2.8 ms by kind
               (reduce_scatter, an all_reduce and a slice on gloo, 1.5 ms above all_reduce in one
               measurement), and with them the tensor-parallel rows came out up to 28 % short.
  agreement  -- every rank measures the collectives at the same time, puts its numbers into the job's
               store, and rank 0 builds the profile: its own compute fits and sharing and, per measured
               collective, the SLOWEST rank's time (a collective ends when its last rank does); every
               rank then reads that one profile back.  Every wait is bounded by the Watchdog.
  cache      -- rank 0 writes the profile under cost_model/profile_cache.py's key (host, processor,
               cores, threads, ranks on this machine, torch version); ``parallelize`` without ``device=``
               uses it when present (runtime/profile.py).
  spawn      -- ``measure_here(ranks)`` (and ``python -m autosplit profile --ranks N``, profiling/cli.py)
               starts N gloo processes on this machine to do all of the above; nothing else spawns.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pickle

import torch

from autosplit.cost_model import calibrate, profile_cache, profile_for_gpu
from autosplit.cost_model.measured import comm_key, fit_alpha_beta
from autosplit.cost_model.op_bench import measure_compute
from autosplit.cost_model.pipeline_fit import with_pass_overhead
from autosplit.errors import AutosplitError
from autosplit.host_memory import keep_freed_host_memory
from autosplit.profiling.comm_bench import POST_BYTES, measure_comm, node_count, world_barrier
from autosplit.profiling.device_bench import measure_device
from autosplit.profiling.pipeline_bench import MICROBATCHES, measure_pipeline
from autosplit.profiling.resume_bench import measure_resume
from autosplit.profiling.sharing_bench import measure_sharing, measure_wake
from autosplit.runtime.profile import local_ranks

_CALLS = [0]
NVLS_MARGIN = 1.1       # allreduce_bandwidth is stated where the all-reduce's bus bandwidth beats the link's by this


def measure_profile(world, watchdog, compute_budget: float = 2.0, save: bool = True,
                    device_seconds: float | None = None):
    """The measured profile, the same on every rank (see *agreement*); rank 0 caches it when ``save``.

    Args:
        world: the runtime World; every rank calls this together.
        watchdog: bounds every wait.
        compute_budget: seconds of timed repeats for the compute fits (CPU only).
        save: write the profile to the on-disk cache (rank 0).
        device_seconds: seconds of timed repeats for the kernel model (device_bench.py); None: 5 s on a GPU,
            ``compute_budget`` on CPU.
    """
    cuda = world.device.type == "cuda"
    device_seconds = device_seconds if device_seconds is not None else (5.0 if cuda else compute_budget)
    compute = base = kernels = sharing = loaded_post = None
    wake, resume = 0.0, (1.0, 1.0)
    if not cuda:
        keep_freed_host_memory()                 # measure under the malloc settings training runs with
    world_barrier(world, watchdog)
    if world.rank == 0:                          # alone: the others wait in the barrier below
        with torch.random.fork_rng(devices=[world.device] if cuda else []):   # keep the default streams
            kernels = measure_device(world.device, device_seconds)           # identical on every rank
            if cuda:
                base = gpu_base(world.device)
            else:
                compute = measure_compute(compute_budget, world.device)
                base = calibrate(seconds=0.5, link=False)
    world_barrier(world, watchdog)
    if not cuda:
        sharing = measure_sharing(world, watchdog, local_ranks(world))
        wake, loaded_post = measure_wake(world, watchdog, local_ranks(world))
        resume = measure_resume(world, watchdog, local_ranks(world))
    # in step on every CPU host: the constant on the back-to-back fits where each rank has a core (*in
    # step*), the fit itself on a host with more ranks than cores (*shared host*)
    comm = measure_comm(world, watchdog, in_step=not cuda, local=local_ranks(world))
    reference = None if cuda else measure_pipeline(world, watchdog, local_ranks(world))
    _CALLS[0] += 1
    key = f"autosplit/measured_profile/{_CALLS[0]}/"
    world.store.set(f"{key}{world.rank}", pickle.dumps(comm))
    if world.rank == 0:
        keys = [f"{key}{r}" for r in range(world.size)]
        watchdog.until(lambda: world.store.check(keys), "waiting for every rank's profile measurements")
        slowest = slowest_times([pickle.loads(world.store.get(k)) for k in keys])
        profile = _build(world, base, compute, slowest, sharing, wake, loaded_post, resume,
                         shared=not cuda and local_ranks(world) > (os.cpu_count() or 1),
                         local=local_ranks(world), kernels=kernels)
        profile = with_pass_overhead(profile, local_ranks(world), MICROBATCHES, reference)
        world.store.set(f"{key}profile", pickle.dumps(profile))
        if save:
            profile_cache.save(profile_cache.machine_key(world.device, local_ranks(world)), profile)
        return profile
    watchdog.until(lambda: world.store.check([f"{key}profile"]), "waiting for rank 0's measured profile")
    return pickle.loads(world.store.get(f"{key}profile"))


def slowest_times(per_rank: list[list]) -> dict:
    """{(kind, n, nodes, nbytes): seconds} of the slowest rank, from every rank's comm_bench.measure_comm
    records (see *agreement*)."""
    slowest: dict = {}
    for records in per_rank:
        for kind, n, nodes, nbytes, seconds in records:
            slowest[(kind, n, nodes, nbytes)] = max(seconds, slowest.get((kind, n, nodes, nbytes), 0.0))
    return slowest


def gpu_base(device):
    """The profile a GPU's measurement starts from: its built-in one (datasheet peaks, memory, links), or
    for a GPU without one, peaks and bandwidth measured here (calibrate; device_bench then refines them)."""
    try:
        return profile_for_gpu(torch.cuda.get_device_name(device))
    except AutosplitError:
        return calibrate(seconds=1.0, link=False, device=device)


def in_step_extra(slowest: dict) -> dict[int, float]:
    """Group size -> seconds a step's collective costs beyond back to back (see *in step*), from
    ``{(kind, n, nodes, nbytes): seconds}`` holding both ``kind`` and ``in_step/kind`` entries (one node)."""
    diffs: dict[int, list[float]] = {}
    for (kind, n, nodes, nbytes), seconds in slowest.items():
        plain = (kind[len("in_step/"):], n, nodes, nbytes)
        if kind.startswith("in_step/") and nodes == 1 and plain in slowest:
            diffs.setdefault(n, []).append(seconds - slowest[plain])
    return {n: max(0.0, sum(d) / len(d)) for n, d in diffs.items()}


def shared_host_fits(slowest: dict) -> dict[int, tuple[float, float]]:
    """Group size -> the (alpha, beta) of every collective kind on a host with more ranks than cores (see
    *shared host*): one fit to the ``in_step/<kind>`` times of all kinds, from
    ``{(kind, n, nodes, nbytes): seconds}`` (one node)."""
    samples: dict[int, list] = {}
    for (kind, n, nodes, nbytes), seconds in slowest.items():
        if kind.startswith("in_step/") and nodes == 1:
            samples.setdefault(n, []).append((nbytes, seconds))
    return {n: fit_alpha_beta(v) for n, v in samples.items()}


def _topology(world, comm: dict, local: int) -> dict:
    """The DeviceProfile's topology fields from the collective fits (see *topology*)."""
    cuda, nodes = world.device.type == "cuda", node_count(world.size, local)
    out = {"gpus_per_node": local if cuda or nodes > 1 else None}
    p2p = comm.get(comm_key("send_recv", 2))
    if p2p is not None and p2p[1]:
        out.update(link_latency=p2p[0], link_bandwidth=1 / p2p[1])
    per_node = world.size // nodes
    gather, reduce = comm.get(comm_key("all_gather", per_node)), comm.get(comm_key("all_reduce", per_node))
    if cuda and per_node >= 2 and gather is not None and gather[1]:
        out["link_bandwidth"] = (per_node - 1) / per_node / gather[1]          # ring bus bandwidth
        if reduce is not None and reduce[1]:
            bus = 2 * (per_node - 1) / per_node / reduce[1]
            out["allreduce_bandwidth"] = bus if bus > NVLS_MARGIN * out["link_bandwidth"] else 0.0
    network = comm.get(comm_key("send_recv", 2, 2))
    if network is not None and network[1]:
        out.update(network_latency=network[0], network_bandwidth=1 / network[1])
    return out


def _build(world, base, compute, slowest: dict, sharing, wake: float = 0.0, loaded_post: float | None = None,
           resume: tuple[float, float] = (1.0, 1.0), shared: bool = False, local: int | None = None,
           kernels=None):
    """The profile from rank 0's fits and the slowest rank's collective times ``{(kind, n, nodes, nbytes):
    seconds}``; ``p2p_post`` is the *loaded post* where the host has 3 or more ranks, else comm_bench's
    *post* (after compute where each rank has a core, with every rank idle where not).  ``shared``: the
    host has more ranks than cores (*shared host*); else the *in step* constant goes on the back-to-back
    fits.  ``local``: ranks per node (None: the world); ``kernels``: device_bench.py's measurement, or None."""
    local = world.size if local is None else local
    samples: dict = {}
    post = slowest.pop(("post", 2, 1, POST_BYTES), 0.0)
    post = post if loaded_post is None else loaded_post
    extra, pooled = in_step_extra(slowest), shared_host_fits(slowest) if shared else {}
    for (kind, n, nodes, nbytes), seconds in slowest.items():
        if not kind.startswith("in_step/"):
            samples.setdefault(comm_key(kind, n, nodes), []).append((nbytes, seconds))
    comm = {k: fit_alpha_beta(v) for k, v in samples.items()}
    for k, (a, b) in comm.items():
        if not k.startswith("send_recv/") and "@" not in k:       # one node: the in-step costs apply
            n = int(k.split("/")[1])
            comm[k] = pooled[n] if n in pooled else (a + extra.get(n, 0.0), b)
    if world.device.type == "cuda":
        base = base if base is not None else gpu_base(world.device)
        gpu = torch.cuda.get_device_name(world.device)
        name = f"{gpu} (measured: kernels and NCCL collectives, {world.size} ranks, {local} per node)"
    else:
        name = f"cpu (measured: {profile_cache.machine_key('cpu')['processor']}, {torch.get_num_threads()} " \
               f"threads x {local} ranks)"
    if kernels is not None:
        base = kernels.apply(base)
    return dataclasses.replace(base, name=name, compute=compute, comm=comm or None, sharing=sharing, p2p_post=post,
                               p2p_wake=wake, resume=tuple(resume), **_topology(world, comm, local))


def _worker(rank: int, ranks: int, port: int, threads: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(ranks),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(ranks), OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    from autosplit.runtime.faults.deadlines import Watchdog
    from autosplit.runtime.parallel.world import init_world
    try:
        world = init_world((1, 1, ranks))
        profile = measure_profile(world, Watchdog(world.store, rank, world.mesh, world.timeout_s, world.backend))
        if rank == 0:
            results.put(("ok", profile_cache.to_dict(profile)))
    except BaseException as exc:          # report it to the parent, whatever it is
        results.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))


def measure_here(ranks: int, threads: int = 1, timeout: float = 300.0):
    """Spawn ``ranks`` gloo processes with ``threads`` threads each, measure and cache the profile for
    that layout, and return it.

    Args:
        ranks: processes to start on this machine (the ranks a job will run here).
        threads: torch threads per process (the cache key has it: use what the job will use).
        timeout: seconds to wait for the result.
    """
    import torch.multiprocessing as mp
    from autosplit.cost_model.calibrate import _free_port
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, ranks, port, threads, results), daemon=True) for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        status, value = results.get(timeout=timeout)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise RuntimeError(f"profile measurement failed: {value}")
    return profile_cache.from_dict(value)


def run_local(ranks: int, threads: int, out=None) -> int:
    """``autosplit profile --ranks N`` (profiling/cli.py): spawn the local gloo world (``measure_here``),
    which caches the profile for (ranks, threads); print where, and write ``out`` too when given."""
    from autosplit.cost_model import profile_file
    profile = measure_here(ranks, threads)
    key = profile_cache.machine_key("cpu", ranks)
    key["threads"] = threads
    where = f"cached in {profile_cache.path_for(key)}" if profile_cache.enabled() else \
        "not cached (AUTOSPLIT_PROFILE_CACHE is off)"
    print(f"{profile.name}\n{where}")
    if out is not None:
        profile_file.write(out, profile)
        print(f"wrote {os.path.abspath(out)}")
    return 0


def main(argv=None) -> None:
    """The old entry point, kept for one release: ``autosplit profile --ranks N`` does the same."""
    from autosplit.deprecated import deprecated_entry_point
    parser = argparse.ArgumentParser(description="Deprecated: use python -m autosplit profile --ranks N.")
    parser.add_argument("--ranks", type=int, default=2, help="processes a job runs on this machine")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args(argv)
    deprecated_entry_point("python -m autosplit.profiling.measure_profile --ranks N",
                           f"python -m autosplit profile --ranks {args.ranks} --threads {args.threads}")
    run_local(args.ranks, args.threads)


if __name__ == "__main__":
    main()
