"""Time a reference pipeline on this host: what the step predictor's ``pass_overhead`` is fitted to.

Terms:
  reference pipeline -- the host's local ranks as the stages of a 1F1B pipeline of ``MICROBATCHES``
               microbatches; every stage an encoder stack of ``LAYERS`` layer(s) (profiling/cpu_workload.py:
               a CPU benchmark ViT stage's op mix, no model in particular) on (4, 65, 192) tokens; each
               rank runs its lowered action list (schedule/lower.py) as the executor does: a transfer
               group is posted with the runtime's own transport (p2p.make_transport) where the list has
               it, a forward or backward waits for the group bringing its input, and the sends' groups
               are waited at the end of the step.  Nothing of autosplit's plan or executor is used: the
               profile is measured before any plan exists.
  alone      -- the stage's forward and backward, timed back to back on local rank 0 while the other
               ranks wait in a barrier (medians of ``REPS``): what the step predictor would be given for
               the stage, as cost_model/model_fit.py times a model's passes.
  measured   -- the median over ``STEPS`` steps (each after a barrier) of the slowest local rank's step.
  round      -- alone, then measured, in the same seconds (a 2-core VM's speed moves by 20 % within
               minutes); ``ROUNDS`` rounds after ``WARMUP`` untimed steps.  The result: per round (alone
               forward s, alone backward s, measured s, bytes of one activation), rank 0's host's, the same
               on every rank.  cost_model/pipeline_fit.py fits ``pass_overhead`` to each round and takes
               the median (one round's fit ranged 0.4-2.3 ms on a 2-core host with 4 ranks).
Why a whole pipeline: on a 2-core host with 4 ranks, a ViT's 1F1B and interleaved pipelines ran 13-31 %
longer than the step predictor priced from parts each measured on its own (passes alone, sharing, posting,
wake, resume); in the step every pass ran 0.6-0.9 ms more CPU than alone, and the ranks' other threads
and waits took 20 ms of CPU a step each.  The residual is fitted on a pipeline that is no model's.
Every wait is bounded by the Watchdog; every rank runs the same barriers in the same order (NCCL's rule).
"""
from __future__ import annotations

import os
import pickle
import statistics
import time

import torch

from autosplit.profiling.comm_bench import world_barrier
from autosplit.profiling.cpu_workload import encoder_stack
from autosplit.runtime.pipeline.p2p import make_transport, tag
from autosplit.schedule import Group, build_schedule, lower
from autosplit.schedule.actions import F, RECV_F, SEND_F

MICROBATCHES = 8
LAYERS = 1          # one encoder layer a stage: 3-7 ms passes on a CPU core, as a small ViT's pipeline stages
REPS, WARMUP, ROUNDS, STEPS = 8, 2, 5, 3
_CALLS = [0]


class _Stage:
    """One rank's stage of the reference pipeline and its per-step state."""

    def __init__(self, world, watchdog, local: int, ranks: int, net, x):
        self.world, self.watchdog, self.local, self.ranks, self.net, self.x = world, watchdog, local, ranks, net, x
        self.base = world.rank - local                      # global rank of the host's local rank 0
        self.items = lower(build_schedule("1f1b", ranks, MICROBATCHES, 1))[local]
        self.transport = make_transport(world.backend, None)

    def step(self) -> None:
        inbox, outbox, saved, posted = {}, {}, {}, []
        last = self.local == self.ranks - 1
        for item in self.items:
            if isinstance(item, Group):
                ops, received = [], []
                for a in item.actions:
                    direction = 0 if a.kind in (SEND_F, RECV_F) else 1      # activation / gradient
                    receiver = a.peer_stage if a.kind.is_send else a.stage
                    if a.kind.is_send:
                        t = outbox.pop((a.microbatch, direction))
                    else:
                        t = torch.empty_like(self.x)
                        received.append(((a.microbatch, direction), t))
                    ops.append(("send" if a.kind.is_send else "recv", t, self.base + a.peer_stage,
                                tag(direction, receiver, a.microbatch, 0, MICROBATCHES)))
                group = self.transport.post(ops, f"profile measurement pipeline {item}")
                posted.append(group)
                for key, t in received:
                    inbox[key] = (group, t)
                continue
            i = item.microbatch
            if item.kind is F:
                if self.local == 0:
                    inp = self.x
                else:
                    group, inp = inbox.pop((i, 0))
                    group.wait(self.watchdog)
                    inp.requires_grad_(True)
                out = self.net(inp)                           # (4, 65, 192)
                saved[i] = (inp, out.sum() if last else out)
                if not last:
                    outbox[(i, 0)] = out.detach()
            else:
                inp, out = saved.pop(i)
                if last:
                    out.backward()
                else:
                    group, grad = inbox.pop((i, 1))
                    group.wait(self.watchdog)
                    out.backward(grad)
                if self.local > 0:
                    outbox[(i, 1)] = inp.grad
        for group in posted:
            group.wait(self.watchdog)

    def close(self) -> None:
        self.transport.close()


def _alone(net, x) -> tuple[float, float]:
    fs, bs = [], []
    for _ in range(REPS + 2):
        t0 = time.perf_counter()
        out = net(x).sum()
        t1 = time.perf_counter()
        out.backward()
        fs.append(t1 - t0)
        bs.append(time.perf_counter() - t1)
    return statistics.median(fs[2:]), statistics.median(bs[2:])


def measure_pipeline(world, watchdog, local_ranks: int) -> list[tuple[float, float, float, int]] | None:
    """The reference pipeline's *rounds* on rank 0's host, the same on every rank; None where the host has
    one rank (no pipeline to run).

    Args:
        world: the runtime World; every rank calls this together.
        watchdog: bounds every wait.
        local_ranks: processes of the job per host (consecutive ranks).
    """
    if local_ranks < 2 or world.size % local_ranks:
        return None
    local = int(os.environ.get("LOCAL_RANK", world.rank % local_ranks))
    net, x = encoder_stack(world.device, LAYERS)
    stage = _Stage(world, watchdog, local, local_ranks, net, x)
    alone, times = [], []
    try:
        for k in range(WARMUP + ROUNDS * STEPS):
            if k >= WARMUP and (k - WARMUP) % STEPS == 0:    # a round starts: the stage alone on rank 0
                world_barrier(world, watchdog)
                if world.rank == 0:
                    alone.append(_alone(net, x))
                net.zero_grad(set_to_none=True)
            world_barrier(world, watchdog)      # the others wait here while rank 0 times the stage alone
            t0 = time.perf_counter()
            stage.step()
            times.append(time.perf_counter() - t0)
            net.zero_grad(set_to_none=True)
    finally:
        stage.close()
    _CALLS[0] += 1
    key = f"autosplit/pipeline_bench/{_CALLS[0]}/"
    world.store.set(f"{key}{world.rank}", pickle.dumps(times[WARMUP:]))
    if world.rank == 0:
        host = [f"{key}{r}" for r in range(local_ranks)]
        watchdog.until(lambda: world.store.check(host), "waiting for the host's reference pipeline times")
        slowest = [max(ts) for ts in zip(*(pickle.loads(world.store.get(k)) for k in host))]
        rounds = [(*alone[r], statistics.median(slowest[r * STEPS:(r + 1) * STEPS]), x.numel() * x.element_size())
                  for r in range(ROUNDS)]
        world.store.set(f"{key}result", pickle.dumps(rounds))
    watchdog.until(lambda: world.store.check([f"{key}result"]), "waiting for rank 0's reference pipeline")
    return pickle.loads(world.store.get(f"{key}result"))
