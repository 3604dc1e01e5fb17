"""Models of the NCCL path on gloo, run on every rank of a test pool (see dist_pool.py).

No GPU runs these tests, so what NCCL does differently is modelled on the host:
  stream work  -- a communication work as NCCL's looks to the host: ``wait()`` only orders the
                  device's stream after it and returns at once; ``is_completed()`` says whether it
                  has finished (a CUDA event query).
  model device -- the device's queue as the host sees it: every launch (a compute action, or one
                  kernel) goes into a queue of ``depth`` of them; once the stream waits on a transfer that never
                  finishes, nothing drains, and the launch that finds the queue full would block
                  the host for good (here it raises ``HostBlocked`` instead).
  scripted transport -- NCCL's transport with no wire: every group finishes at once (received
                  tensors are zeros) except the one whose name contains ``stuck``, which never does.
  send-cycle order -- each send posted as a group of its own right after the compute that produced
                  it, each receive right before the compute that consumes it: two ranks that both
                  send before they receive wait on each other when sends are rendezvous (NCCL's).
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from autosplit.runtime.pipeline.p2p import Posted
from autosplit.schedule import Group, Schedule
from tests.dist_checks import _small, error_of
from tests.schedule_orders import _comm


class HostBlocked(RuntimeError):
    """The host would block inside a kernel launch behind a stuck stream, and never return."""


class ModelDevice:
    def __init__(self, depth: int, unit: str = "actions"):
        self.depth, self.unit, self.blocked_by, self.queued = depth, unit, None, 0

    def stream_waits(self, work) -> None:
        if self.blocked_by is None and not work.is_completed():
            self.blocked_by = work           # nothing queued after this runs until it finishes

    def launch(self, what: str) -> None:
        if self.blocked_by is None:
            return
        self.queued += 1
        if self.queued > self.depth:
            raise HostBlocked(f"the host blocked launching {what}: the launch queue holds {self.depth} "
                              f"{self.unit}, all behind {self.blocked_by.what}, which never finishes")


class StreamWork:
    def __init__(self, device: ModelDevice, done: bool, what: str):
        self.device, self.done, self.what = device, done, what

    def wait(self, timeout=None) -> bool:
        self.device.stream_waits(self)
        return True

    def is_completed(self) -> bool:
        return self.done

    def exception(self):
        return None


class ScriptedTransport:
    def __init__(self, device: ModelDevice, stuck: str | None = None):
        self.device, self.stuck = device, stuck

    def post(self, ops: list[tuple], what: str) -> Posted:
        for kind, t, _, _ in ops:
            if kind == "recv":
                t.zero_()
        done = self.stuck is None or self.stuck not in what
        return Posted([StreamWork(self.device, done, what)], [t for _, t, _, _ in ops], what)

    def close(self) -> None:
        """Nothing to release."""


def hung_receive_run_ahead(depth: int = 4, stuck: str = "0RECV_B1"):
    """Rank 0 runs the NCCL path (deferred waits) and its receive ``stuck`` never arrives: the host must
    stop at our deadline, not run on until a launch blocks.  Rank 1 runs normally (its transfers
    finish) and waits for rank 0 in the step's loss exchange, with a longer timeout, so rank 0's
    message is the one published."""
    rank = dist.get_rank()
    pm = _small(mesh=(2, 1, 1), microbatches=8, example_input=torch.randn(1, 3, 32, 32),
                timeout_s=2 if rank == 0 else 20, device="h100")
    device = ModelDevice(depth)
    ex = pm.executor
    ex.transport = ScriptedTransport(device, stuck if rank == 0 else None)
    pm.watchdog.polled = rank == 0             # the NCCL Watchdog: waits ordered on the stream, checked later
    for name in ("_forward", "_backward"):     # a compute's kernels are launched after its waits are ordered
        run = getattr(ex, name)
        setattr(ex, name, lambda a, run=run: (run(a), device.launch(str(a))))
    dist.barrier()
    start = time.monotonic()
    err = error_of(pm.step, torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))
    return {"error": err, "queued": device.queued, "seconds": time.monotonic() - start}


def collectives_in_one_action(watchdog, depth: int = 64, collectives: int = 100, launches_each: int = 4,
                              stuck: int = 10) -> dict:
    """One long compute action of a tp stage on the NCCL path, in this process (no pool): every
    ``launches_each`` kernel launches end in a collective whose wait ``watchdog`` defers; collective
    ``stuck`` never finishes, and the modelled queue holds ``depth`` launches.  The host must report
    the stuck collective at our deadline before the queue fills, though no action boundary comes."""
    device = ModelDevice(depth, unit="launches")
    start = time.monotonic()
    watchdog.advance()                          # the action begins, as the executor's loop does
    try:
        for i in range(collectives):
            for k in range(launches_each):      # the kernels between two collectives (the last launches it)
                device.launch(f"kernel {k} before all_reduce #{i}")
            what = f"all_reduce over tp #{i}"
            watchdog.wait(StreamWork(device, i != stuck, what), what)
        err = None
    except Exception as exc:
        err = f"{type(exc).__name__}: {exc}"
    return {"error": err, "queued": device.queued, "seconds": time.monotonic() - start}


def send_cycle_order(schedule: Schedule) -> dict[int, list]:
    out = {}
    for r, acts in schedule.actions.items():
        items = []
        for a in acts:
            before, after = _comm(a, schedule.pp, schedule.num_stages)
            items += [Group((x,)) for x in before] + [a] + [Group((x,)) for x in after]
        out[r] = items
    return out


def replay_send_cycle(timeout_s: float = 3.0):
    """1F1B on two ranks in the send-cycle order: plain gloo (every op in flight at once) completes it;
    the strict transport (groups one at a time, sends rendezvous) must hang like NCCL and time out."""
    from tests.dist_checks import replay_order
    return replay_order(send_cycle_order, timeout_s)


def _registered(group) -> bool:
    return group in dist.distributed_c10d._world.pg_map


def abort_after_failure():
    """A failure on the NCCL path with torch's async error handling off (what its abort API asks for):
    this module's groups are aborted, the default group is not (the job may still use it), and
    ``close`` still works.  Gloo groups take torch's abort API as NCCL ones do."""
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    try:
        pm = _small(mesh=(2, 1, 1), microbatches=2, example_input=torch.randn(1, 3, 32, 32), timeout_s=10)
        world = pm.world
        ours = {id(g): g for g in [world.group(a) for a in ("pp", "tp", "dp")] + [world.control_group]
                if g is not None and g is not dist.group.WORLD}
        pm.watchdog.polled = True           # the NCCL Watchdog
        failure = pm.watchdog.fail("a test action", ValueError("injected"))
        out = {"message": str(failure), "default_kept": dist.is_initialized() and _registered(dist.group.WORLD),
               "ours_left": sum(_registered(g) for g in ours.values()), "ours": len(ours)}
        out["barrier"] = error_of(dist.barrier)          # the default group still works
        out["close"] = error_of(pm.close)
        return out
    finally:
        del os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
