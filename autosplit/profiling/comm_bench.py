"""Time each collective kind the runtime uses, on groups of every size, in a live world.

Terms:
  kinds     -- all_reduce, all_gather, reduce_scatter (tp_collectives' own functions: on gloo the
               reduce-scatter is an all-reduce and a slice, and that is what gets timed), broadcast, and
               send_recv (one-way time of a point-to-point transfer: half a ping-pong; within a node
               between ranks 2i and 2i+1 of it, and with several nodes also between the ranks of equal
               local rank on nodes 2j and 2j+1).
  node      -- ``local`` consecutive ranks (torchrun's LOCAL_WORLD_SIZE: a node's ranks are consecutive);
               the job has world size / local nodes.
  span      -- (n, k): a group of n ranks spread evenly over k nodes, n / k consecutive ranks on each
               (k = 1: within one node).  Every span the job can form is measured: n >= 2 dividing the
               world size, k dividing both n and the node count, n / k dividing ``local``.  Its fits go
               under ``comm_key(kind, n, k)`` (cost_model/measured.py).
  groups    -- for a span (n, k), the world is cut into groups of that span that together hold every rank
               (``dist.new_subgroups_by_enumeration``; on one node: consecutive groups of n ranks, as
               tensor-parallel groups are) and every group runs the same collective at the same time, as
               tp or dp groups do in a step, so the ranks compete for the machine's cores, links and
               network as they will in training.
  nbytes    -- the FULL tensor of the collective (comm.py's convention): the gathered result of an
               all_gather, the input of a reduce_scatter.  ``SIZES`` on CPU (gloo), ``CUDA_SIZES`` on GPUs
               (up to 128 MiB: an NVLink ring reaches its bandwidth only for large messages).
  timing    -- per (kind, n, nbytes): a barrier over the world, one warm-up, then ``COMM_REPS`` calls back
               to back, each waited through the Watchdog; a rank's time is the mean per call.  On a
               GPU that is what a step pays (the host launches while the device computes).
  in step   -- (CPU, spans within one node) a step's collective follows compute on every rank of its group,
               and on a CPU that costs more than back to back: the ranks' equal work does not end at the
               same instant, so each call waits out its peers' lateness, and the launch and the first read
               of the result run on the rank's own core after the wait.  So on a CPU each call is also timed as a step
               runs it: every rank runs a *burst* (GEMMs lasting about ``BURST_S`` alone: the compute
               between two tensor-parallel collectives of a small transformer layer on one CPU core),
               then the collective, then reads its result; the time is the mean of (burst + collective +
               read) minus the mean of the same burst and read without the collective, every rank of the
               world doing either at the same time (so both share the cores alike).  Reported as kind
               ``in_step/<kind>``; measure_profile.py turns the difference from back to back into one
               per-call constant per group size where each rank has a core, and fits every kind's price
               to these times where the host has more ranks than cores (its *shared host*).  The burst's
               GEMM count is rank 0's, broadcast, so every rank computes the same.
  post      -- (CPU only) host seconds to post one pipeline transfer group through the runtime's own
               transport (p2p.make_transport): every rank posts a send to the next rank and a receive
               from the previous one, all at once as a pipeline's ranks do, and times only the posting
               call.  With a *burst* (measure_comm's ``in_step``), as a step posts: every rank runs the
               burst, posts, and waits for the group it posted one repetition before (a pipeline waits
               for a group's receive only inside the compute after it), and the time is the mean of
               ``POST_STEP_REPS`` (120: the mean of 60 came out at 0.23-0.93 ms in four measurements on
               one 2-core host): on a 2-core host posting after compute took a median of 0.04-0.34 ms
               but a mean of 0.3-1.3 ms (rare stalls of several ms, when the rank's gloo thread or its
               peer takes the core), a step of pp2 1F1B m8 paid 0.39-0.61 ms a group, and the idle
               median said 0.05-0.07.  Without one: every rank idle, the median of ``POST_REPS``.  On
               a GPU the host posts while the device computes, so it costs the step nothing and is not
               measured.
Ordering (NCCL's rule): every rank runs the same loop in the same order: each group creation, each
barrier and each collective of its own group; pairs for send_recv are fixed by rank parity.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from autosplit.runtime.parallel import tp_collectives as T
from autosplit.runtime.pipeline.p2p import make_transport

SIZES = (4 << 10, 64 << 10, 512 << 10, 4 << 20)
CUDA_SIZES = (64 << 10, 1 << 20, 16 << 20, 128 << 20)
BURST_S, BURST_DIM, IN_STEP_REPS = 2e-3, 192, 40
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
POST_BYTES, POST_REPS, POST_STEP_REPS = 64 << 10, 21, 120
# calls per timing: a gloo call on a 2-core host stalls for several ms now and then, and with 10 calls (20 in
# step) the fitted all_reduce/2 constant moved 1.85 -> 2.49 ms between two measurements minutes apart
COMM_REPS = 30


def group_sizes(world_size: int) -> list[int]:
    return [n for n in range(2, world_size + 1) if world_size % n == 0]


def node_count(world_size: int, local: int) -> int:
    """Nodes of a job of ``world_size`` ranks, ``local`` per node (1 where that does not divide evenly)."""
    return world_size // local if 0 < local <= world_size and world_size % local == 0 else 1


def spans(world_size: int, local: int) -> list[tuple[int, int]]:
    """Every (n, k) the job can form (see *span*), by n then k."""
    nodes = node_count(world_size, local)
    local = world_size // nodes
    return [(n, k) for n in group_sizes(world_size) for k in range(1, nodes + 1)
            if n % k == 0 and nodes % k == 0 and local % (n // k) == 0]


def span_groups(world_size: int, local: int, n: int, k: int) -> list[list[int]]:
    """The groups of span (n, k) that together hold every rank (see *groups*)."""
    nodes = node_count(world_size, local)
    local, per_node = world_size // nodes, n // k
    return [[node * local + start + j for node in range(first, first + k) for j in range(per_node)]
            for first in range(0, nodes, k) for start in range(0, local, per_node)]


def world_barrier(world, watchdog) -> None:
    world.barrier(watchdog, "profile measurement barrier")


def _collective(kind: str, axis: str, group, n: int, nbytes: int, device) -> callable:
    """One call of ``kind`` on ``nbytes`` (the full tensor) over this rank's group of ``n``."""
    elems = max(n, nbytes // 4 // n * n)
    full = torch.ones(elems, device=device)
    part = torch.ones(elems // n, device=device)
    src = dist.get_global_rank(group, 0)
    if kind == "all_reduce":
        return lambda: T._all_reduce(full, axis)
    if kind == "all_gather":
        return lambda: T._all_gather(part, 0, axis, elems)
    if kind == "reduce_scatter":
        return lambda: T._reduce_scatter(full, 0, axis)
    return lambda: T._wait(dist.broadcast(full, src=src, group=group, async_op=True), f"broadcast over {axis}")


def ping_pong_peer(rank: int, world_size: int, local: int, across: bool) -> int | None:
    """This rank's send_recv partner (see *kinds*): within its node (``across`` False) rank 2i's is 2i+1 of
    the same node, across nodes the rank of equal local rank on the paired node; None: it sits out."""
    nodes = node_count(world_size, local)
    local = world_size // nodes
    node, index = divmod(rank, local)
    if across:
        other = node ^ 1
        return other * local + index if other < nodes else None
    other = index ^ 1
    return node * local + other if other < local else None


def _ping_pong(world, watchdog, nbytes: int, peer: int | None):
    """This rank and ``peer`` send ``nbytes`` there and back, the lower rank first; one call = one round
    trip (two transfers).  No peer: a call does nothing."""
    rank = world.rank
    buf = torch.ones(max(1, nbytes // 4), device=world.device)
    if peer is None:
        return lambda: None

    def call():
        first, second = (dist.isend, dist.irecv) if rank < peer else (dist.irecv, dist.isend)
        watchdog.wait(first(buf, peer), "profile measurement ping-pong")
        watchdog.wait(second(buf, peer), "profile measurement ping-pong")
    return call


def measure_post(world, watchdog, nbytes: int = POST_BYTES, reps: int | None = None, burst=None) -> float:
    """Host seconds of posting one ring group (a send and a receive) with the runtime's transport (see
    *post*): with ``burst``, the mean of ``reps`` (default POST_STEP_REPS) posts each after the burst;
    without, the median of ``reps`` (default POST_REPS) posts with every rank idle."""
    reps = reps or (POST_STEP_REPS if burst is not None else POST_REPS)
    transport = make_transport(world.backend, None)          # None: the default group, every rank
    nxt, prev = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    out = torch.ones(max(1, nbytes // 4), device=world.device)
    times, pending = [], None
    try:
        for k in range(reps + 1):                            # the first is a warm-up
            if burst is not None:
                burst()
            into = torch.empty(max(1, nbytes // 4), device=world.device)   # a fresh buffer, as a step's
            t0 = time.perf_counter()
            # a tag per repetition: with a burst two groups are in flight, and gloo pairs them by tag
            posted = transport.post([("send", out, nxt, k), ("recv", into, prev, k)], "profile measurement post")
            times.append(time.perf_counter() - t0)
            if burst is None:
                posted.wait(watchdog)
                continue
            if pending is not None:
                pending.wait(watchdog)
            pending = posted
        if pending is not None:
            pending.wait(watchdog)
    finally:
        transport.close()
    if burst is not None:
        return sum(times[1:]) / reps
    return sorted(times[1:])[reps // 2]


def _timed(fn, reps: int) -> float:
    fn()                                  # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def _burst_count(world, device) -> int:
    """GEMMs of ``BURST_DIM`` square making a burst of about BURST_S on rank 0, the same on every rank."""
    a = torch.full((BURST_DIM, BURST_DIM), 1.0 / BURST_DIM, device=device)   # no RNG: the job's stream stays
    t = _timed(lambda: torch.mm(a, a), 20)
    count = torch.tensor([max(1, round(BURST_S / max(t, 1e-9)))], dtype=torch.int64)
    dist.broadcast(count, src=0)                # CPU only (gloo): a plain blocking broadcast
    return int(count)


def _burst(count: int, device) -> callable:
    a = torch.full((BURST_DIM, BURST_DIM), 1.0 / BURST_DIM, device=device)
    return lambda: [torch.mm(a, a) for _ in range(count)]


def _in_step(call, burst, world, watchdog, reps: int = IN_STEP_REPS) -> float:
    """Mean seconds ``call`` adds after a burst on every rank (see *in step*): (burst, call, read of its
    result) minus (burst, read of the same result) per repetition, every rank of the world doing the
    same thing at the same time."""
    result = call()
    read = (lambda: float(result.sum())) if isinstance(result, torch.Tensor) else (lambda: None)
    world_barrier(world, watchdog)
    plain = _timed(lambda: (burst(), read()), reps)
    world_barrier(world, watchdog)

    def step_like():
        nonlocal result
        burst()
        result = call()
        return read()
    return max(0.0, _timed(step_like, reps) - plain)


def measure_comm(world, watchdog, reps: int = COMM_REPS, sizes=None, in_step: bool = False,
                 local: int | None = None) -> list[tuple[str, int, int, int, float]]:
    """This rank's (kind, n, k, nbytes, seconds per call) for every kind, span (n ranks over k nodes) and
    size (see Terms).

    Args:
        world: the runtime World (every rank of it calls this together).
        watchdog: bounds every wait.
        reps: timed calls per measurement.
        sizes: the full-tensor sizes in bytes; None: ``CUDA_SIZES`` on a GPU, else ``SIZES``.
        in_step: also time each collective *in step* (CPU, spans within one node).
        local: ranks per node (see *node*); None: the whole world on one node.
    """
    out = []
    local = world.size if local is None else local
    sizes = sizes or (CUDA_SIZES if world.device.type == "cuda" else SIZES)
    in_step = in_step and world.device.type == "cpu"
    burst = _burst(_burst_count(world, world.device), world.device) if in_step else None
    for n, k in spans(world.size, local):
        group, _ = dist.new_subgroups_by_enumeration(span_groups(world.size, local, n, k))
        axis = f"measure/{n}@{k}"
        T.bind_axis_groups({axis: group}, watchdog)
        for kind in KINDS:
            for nbytes in sizes:
                call = _collective(kind, axis, group, n, nbytes, world.device)
                world_barrier(world, watchdog)
                out.append((kind, n, k, nbytes, _timed(call, reps)))
                if in_step and k == 1:
                    out.append((f"in_step/{kind}", n, k, nbytes, _in_step(call, burst, world, watchdog)))
        world_barrier(world, watchdog)     # every rank is done with the group before it goes
        T.unbind_groups([group])
        dist.destroy_process_group(group)
    nodes = node_count(world.size, local)
    for k, across in ((1, False), (2, True)):     # point to point, all pairs at once
        if (nodes if across else world.size // nodes) < 2:
            continue                              # no pair: nothing to time
        peer = ping_pong_peer(world.rank, world.size, local, across)
        for nbytes in sizes:
            call = _ping_pong(world, watchdog, nbytes, peer)
            world_barrier(world, watchdog)
            out.append(("send_recv", 2, k, nbytes, _timed(call, reps) / 2))
    if world.device.type == "cpu" and world.size > 1:
        world_barrier(world, watchdog)
        out.append(("post", 2, 1, POST_BYTES, measure_post(world, watchdog, burst=burst)))
    return out
