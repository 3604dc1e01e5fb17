"""Measure how much slower a pass runs on a CPU rank when it starts after an idle wait, as a pipeline's do.

Terms:
  workload -- forward and backward of an encoder stack of three layers (profiling/cpu_workload.py): a CPU
              benchmark ViT stage's op mix, from torch.nn so it stands for no model in particular.
  back to back -- forward, backward, forward, ... with nothing between: how op benchmarks and
              cost_model/model_fit.py time passes.
  pipelined -- as a pipeline rank runs them: two microbatches in flight (forward, forward, backward,
              backward), each pass started ``RESUME_S`` after the previous one ended, asleep (the rank
              waited for a transfer).
  factor   -- per pass (forward, backward): the median over ``ROUNDS`` of pipelined / back to back seconds,
              each round timing both in turn on each host's local rank 0 while the others wait in a
              barrier (sharing the cores is ``sharing``'s business: profiling/sharing_bench.py), at least 1.
              The profile's ``resume``; cost_model/step_time.py stretches a compute that starts after its
              rank sat idle by it.
Why measured in the live world: on a 2-core VM the same passes ran 9-14 % slower pipelined than back to back
in a process of a gloo world (its other rank waiting in a barrier), and 0-2 % slower in a lone process
(how model_fit.py times them); every 2-rank pipeline was predicted 13-24 % short without the factor.
The cause is not isolated (caches, the virtual CPU, gloo's threads); the factor is what a step sees.
Every wait is bounded by the Watchdog; every rank runs the same barriers in the same order.
"""
from __future__ import annotations

import os
import pickle
import statistics
import time

from autosplit.profiling.comm_bench import world_barrier
from autosplit.profiling.cpu_workload import encoder_stack

RESUME_S = 5e-3   # idle before each pipelined pass: a transfer's wait on a CPU pipeline rank
ROUNDS = 5        # back to back and pipelined in turn, this many times; the median round's ratio counts
REPS = 8          # timed passes (or pairs of passes) per mode and round
_CALLS = [0]


def _back_to_back(net, x) -> tuple[float, float]:
    t0 = time.perf_counter()
    out = net(x).sum()
    t1 = time.perf_counter()
    out.backward()
    return t1 - t0, time.perf_counter() - t1


def _pipelined(net, x) -> tuple[float, float]:
    fwd, bwd, outs = [], [], []
    for _ in range(2):
        time.sleep(RESUME_S)
        t0 = time.perf_counter()
        outs.append(net(x).sum())
        fwd.append(time.perf_counter() - t0)
    for out in outs:
        time.sleep(RESUME_S)
        t0 = time.perf_counter()
        out.backward()
        bwd.append(time.perf_counter() - t0)
    return statistics.fmean(fwd), statistics.fmean(bwd)


def factors(rounds: list[tuple[list, list]]) -> tuple[float, float]:
    """The profile's ``resume`` from rounds of (back-to-back times, pipelined times), each a list of
    (forward s, backward s) (see *factor*)."""
    out = []
    for i in (0, 1):
        ratios = [statistics.median(p[i] for p in piped) / statistics.median(b[i] for b in plain)
                  for plain, piped in rounds]
        out.append(max(1.0, statistics.median(ratios)))
    return out[0], out[1]


def measure_resume(world, watchdog, local_ranks: int) -> tuple[float, float]:
    """The (forward, backward) *factor* of rank 0's host, the same on every rank.

    Args:
        world: the runtime World; every rank calls this together.
        watchdog: bounds every wait.
        local_ranks: processes of the job per host.
    """
    local = int(os.environ.get("LOCAL_RANK", world.rank % local_ranks))
    net, x = encoder_stack(world.device, 3)
    rounds = []
    world_barrier(world, watchdog)
    if local == 0:
        for _ in range(2):
            _back_to_back(net, x)                # warm-up
        for _ in range(ROUNDS):
            plain = [_back_to_back(net, x) for _ in range(REPS)]
            piped = [_pipelined(net, x) for _ in range(REPS)]
            rounds.append((plain, piped))
    _CALLS[0] += 1
    key = f"autosplit/resume/{_CALLS[0]}"
    if world.rank == 0:
        world.store.set(key, pickle.dumps(factors(rounds)))
    world_barrier(world, watchdog)               # why a barrier: the other ranks wait here, idle, meanwhile
    watchdog.until(lambda: world.store.check([key]), "waiting for rank 0's resume measurement")
    return pickle.loads(world.store.get(key))
