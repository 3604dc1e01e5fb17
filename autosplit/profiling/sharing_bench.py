"""Measure how much slower a compute runs while other processes of the job compute on the same host.

Terms:
  workload -- one forward + backward of an encoder stack of four layers (profiling/cpu_workload.py): the op
              mix and size of a CPU benchmark ViT's stage, with 7 MB of weights (more than a core's cache
              holds, as a real stage's weights are: sharing a host costs caches and memory bandwidth as
              well as cores).  (Six MLP blocks, without attention, measured 1.02-1.03 for two ranks on a
              2-core VM where the ViT's own passes slowed 1.04-1.06.)
  level n  -- the host's first n local ranks (LOCAL_RANK < n) run the workload ``reps`` times at once,
              started by a barrier over the world; the other ranks wait in the next barrier (an async
              gloo barrier polled locally: they take next to no core, as a rank waiting in a step does).
  reps     -- how many workloads local rank 0 fits into ``budget`` seconds alone (level 1); every level
              runs that many, so the active ranks stay busy together until the end.
  round    -- level 1, then 2, ..., then n, each after a barrier; ``ROUNDS`` rounds.  Why rounds: one
              pass once gave 1.54 for 2 ranks on a 2-core host where the model's own passes and this
              workload, timed alone and in pairs a minute later, slowed by 0.99-1.01; a moment of
              noise in level 1 or level n sets a one-pass figure, and the profile prices every step with it.
  slowdown -- per level and round, the mean over its active ranks of their mean seconds per workload,
              divided by that round's level 1; the median over the rounds is the profile's ``sharing``
              (cost_model/device.py), made non-decreasing and at least 1 (a level cannot be faster than
              fewer ranks; a smaller figure is noise).
  wake     -- (``measure_wake``) extra seconds a pipeline transfer takes to reach a rank that waits for it
              while the host's other local ranks all compute: local ranks 0 and 1 relay a stamp, each
              computing one workload before it sends (as pipeline stages do), while local ranks 2..n-1
              run the workload until the relay is done; one-way time = receive time - the sender's
              stamp (``time.perf_counter``, CLOCK_MONOTONIC on Linux: one clock for the whole host).
              The mean over the relay's transfers minus the same relay's mean with the others idle.
              With more ranks than cores the waiting rank must win a core back from a computing one
              before it can run: on a 2-core host with 4 ranks this gave 0.07-0.57 ms per transfer
              (the mean moves with rare waits of several ms; a ping-pong of ranks that never compute
              misses it: the scheduler favours a task that has slept).  Needs 3 or more local ranks.
  loaded post -- (``measure_wake`` too) host seconds the relay's sender spends in the ``isend`` call of its
              ``POST_BYTES`` payload (the stamp rides in it) while the other local ranks compute: posting to
              a waiting peer wakes it, and on a host with more ranks than free cores the woken peer
              takes the poster's core before the call returns (a mean of 2.3-3.1 ms on a 2-core host with
              4 ranks, against 0.1 ms with the others idle).  The mean over the busy relay's sends, which is
              what a pipeline rank pays per group on such a host (the profile's ``p2p_post``).
Every host measures its own ranks at the same time (hosts hold consecutive ranks, as torchrun starts
them); the profile takes rank 0's host's.  Every wait is bounded by the Watchdog.
Ordering (NCCL's rule): every rank runs the same barriers in the same order, active or not.
"""
from __future__ import annotations

import os
import pickle
import statistics
import time

import torch
import torch.distributed as dist

from autosplit.profiling.comm_bench import POST_BYTES, world_barrier
from autosplit.profiling.cpu_workload import encoder_stack, train_pass

_CALLS = [0]
_LAYERS = 4      # 7 MB of weights: more than a core's L2, as a stage of a real model has
ROUNDS = 3       # level 1, 2, ..., n in turn, this many times; each level's slowdown is the median round's


def _workload(device):
    net, x = encoder_stack(device, _LAYERS)
    return lambda: train_pass(net, x)


def _mean_time(run, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    return (time.perf_counter() - t0) / reps


def measure_sharing(world, watchdog, local_ranks: int, budget: float = 0.5) -> tuple[float, ...]:
    """The slowdown per number of processes computing at once on this rank's host (see Terms).

    Args:
        world: the runtime World; every rank calls this together.
        watchdog: bounds every wait.
        local_ranks: processes of the job per host (the profile's length).
        budget: seconds local rank 0 spends on level 1's repeats; each level of each round takes about
            that long times its slowdown (4 ranks on 2 cores: about 3 x 5.5 x budget in all).
    """
    if local_ranks == 1:          # one rank per host shares with no one: level 1 is 1.0 by definition
        return (1.0,)
    local = int(os.environ.get("LOCAL_RANK", world.rank % local_ranks))
    host = world.rank // local_ranks
    with torch.random.fork_rng(devices=[]):      # keep the default stream identical on every rank
        run = _workload(world.device)
    run(), run()                                  # warm-up (all at once: not timed)
    _CALLS[0] += 1
    key = f"autosplit/sharing/{_CALLS[0]}/"
    world_barrier(world, watchdog)
    if local == 0:                                # level 1: how many repeats fill the budget alone
        times, start = [], time.perf_counter()
        while len(times) < 5 or time.perf_counter() - start < budget:
            times.append(_mean_time(run, 1))
        world.store.set(f"{key}reps/{host}", pickle.dumps((len(times), statistics.fmean(times))))
    world_barrier(world, watchdog)
    reps, _ = pickle.loads(world.store.get(f"{key}reps/{host}"))
    mine: dict = {}                                    # (round, level) -> this rank's seconds per workload
    for rnd in range(ROUNDS):
        for n in range(1, local_ranks + 1):
            world_barrier(world, watchdog)             # why a barrier: the n ranks must start together
            if local < n:
                mine[rnd, n] = _mean_time(run, reps)
    world_barrier(world, watchdog)
    world.store.set(f"{key}{world.rank}", pickle.dumps(mine))
    keys = [f"{key}{r}" for r in range(host * local_ranks, min(world.size, (host + 1) * local_ranks))]
    watchdog.until(lambda: world.store.check(keys), "waiting for every local rank's sharing measurement")
    return slowdowns([pickle.loads(world.store.get(k)) for k in keys], local_ranks, ROUNDS)


def slowdowns(per_rank: list[dict], local_ranks: int, rounds: int) -> tuple[float, ...]:
    """The profile's ``sharing`` from the host's ranks' {(round, level): seconds} (see *slowdown*)."""
    slowdown = [1.0]
    for n in range(2, local_ranks + 1):
        level = statistics.median(statistics.fmean(r[rnd, n] for r in per_rank[:n]) / per_rank[0][rnd, 1]
                                  for rnd in range(rounds))
        slowdown.append(max(slowdown[-1], level))
    return tuple(slowdown)


def _relay(world, watchdog, local: int, peer: int, run, trips: int) -> tuple[list[float], list[float]]:
    """Local ranks 0 and 1 take turns: compute ``run`` once, stamp, send; the other receives and records
    now - stamp.  Returns this rank's one-way times and the seconds its ``isend`` calls took."""
    payload = torch.zeros(max(1, POST_BYTES // 8), dtype=torch.float64)     # the stamp is its first element
    times, posts = [], []
    for i in range(trips):
        if i % 2 == local:
            run()
            payload[0] = time.perf_counter()
            work = dist.isend(payload, peer)
            posts.append(time.perf_counter() - payload[0].item())
            watchdog.wait(work, "profile measurement relay")
        else:
            watchdog.wait(dist.irecv(payload, peer), "profile measurement relay")
            times.append(time.perf_counter() - payload[0].item())
    return times, posts


def measure_wake(world, watchdog, local_ranks: int, trips: int = 200) -> tuple[float, float | None]:
    """(seconds a transfer to a waiting rank takes longer while every other local rank computes (see
    *wake*), the *loaded post*); (0.0, None) with fewer than 3 local ranks (nobody else to compute).

    Args:
        world: the runtime World; every rank calls this together.
        watchdog: bounds every wait.
        local_ranks: processes of the job per host.
        trips: transfers per relay (half of them received by each of the two relay ranks).
    """
    if local_ranks < 3:
        return 0.0, None
    local = int(os.environ.get("LOCAL_RANK", world.rank % local_ranks))
    host = world.rank // local_ranks
    first = host * local_ranks                     # world rank of the host's local rank 0
    with torch.random.fork_rng(devices=[]):
        run = _workload(world.device)
    _CALLS[0] += 1
    key = f"autosplit/wake/{_CALLS[0]}/{host}"
    means, posts = [], []
    trips += trips % 2                             # even: local rank 0 receives last, then says done
    for busy in (False, True):
        world_barrier(world, watchdog)             # why a barrier: the relay and the busy ranks start together
        if local < 2:
            times, posted = _relay(world, watchdog, local, first + 1 - local, run, trips)
            means.append(statistics.fmean(times))
            posts = posted
            if busy and local == 0:
                world.store.set(f"{key}/done", b"1")
        elif busy:     # compute until the relay is done, watching for failures and the deadline as a wait does
            deadline = time.monotonic() + world.timeout_s
            while not world.store.check([f"{key}/done"]):
                run()
                watchdog.check("profile measurement: computing beside the relay")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {world.rank}: the wake measurement's relay did not end within "
                                       f"{world.timeout_s:g} s")
    world_barrier(world, watchdog)
    if local < 2:
        world.store.set(f"{key}/{local}", pickle.dumps((means[1] - means[0], statistics.fmean(posts))))
    keys = [f"{key}/0", f"{key}/1"]
    watchdog.until(lambda: world.store.check(keys), "waiting for the relay's wake measurement")
    wakes, loaded = zip(*(pickle.loads(world.store.get(k)) for k in keys))
    return max(0.0, statistics.fmean(wakes)), statistics.fmean(loaded)
