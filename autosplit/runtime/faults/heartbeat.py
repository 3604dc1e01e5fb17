"""Per-rank liveness in the job's store, so that a failure names the rank that died or stalled.

Terms:
  beat     -- the key ``autosplit/beat/{rank}``, rewritten every ``interval_for(world)`` seconds (0.5 s up
              to 500 ranks, then longer, so the store sees at most 1000 beats a second) by a thread of
              each rank with "count|state|doing|seconds": a counter, whether the rank's main thread
              is ``waiting`` on another rank or ``busy`` (computing, or in user code), what it is doing
              (an action such as ``1F2``) and for how long, by the rank's own clock.
  dead     -- a rank whose count does not move while an observer watches it for three intervals by the
              observer's clock (no clock agreement between hosts is needed): the process is gone or
              frozen as a whole.
  stalled  -- a rank that beats but has been busy, not waiting, at one action for half the observer's
              timeout or more: the rank the others are waiting for.

  own client -- the beat thread writes through its own store client (``store.clone()``): a TCPStore client
              serves one request at a time, so a ``set`` stuck on a shared client would stall the
              deadline loop's store checks behind it.

What can be told apart: a dead process (from a stale beat, after a peer's connection reset or a
timeout), a rank stuck in computation or user code (busy, beating), and an ordering deadlock (every
rank waiting).  What cannot: a process alive but starved of the GIL for three intervals looks dead.
On GPUs (NCCL) the host waits on its device's queue: a rank whose device is stuck in a kernel (or
whose transfer hangs) reads as *waiting*, exactly like a rank in an ordering deadlock, so the
diagnosis says it cannot tell the two apart (``device_queues``).  When the store's host process dies
(rank 0's process, unless torchrun's agent hosts the store) nothing can be read, and the message
says so.
"""
from __future__ import annotations

import atexit
import os
import threading
import time

INTERVAL_S = 0.5              # between beats, in worlds of up to BEATS_PER_S / 2 ranks
BEATS_PER_S = 1000            # what the whole world may ask of the store (TCPStore serves one thread)
_PREFIX = "autosplit/beat/"


def interval_for(world_size: int) -> float:
    """Seconds between beats: INTERVAL_S, stretched in large worlds so the store sees at most
    BEATS_PER_S beats a second."""
    return max(INTERVAL_S, world_size / BEATS_PER_S)


def watch_s(world_size: int) -> float:
    """How long ``diagnose`` watches the beats: three intervals."""
    return 3 * interval_for(world_size)


def _own_client(store):
    """A client of ``store`` for the beat thread alone (the same store if it cannot be cloned)."""
    try:
        return store.clone()
    except Exception:        # a store type without clone(): share it (a stuck set can then delay a check)
        return store


class Heartbeat:
    """This process's beat: one daemon thread, and the state the main thread updates."""

    def __init__(self, store, rank: int, world_size: int):
        # the job's store, kept so that its id (the key of _BEATS) is never reused while this beats
        self.origin, self.store = store, _own_client(store)
        self.rank, self.interval = rank, interval_for(world_size)
        self.doing, self.waiting, self.since = "start", False, time.monotonic()
        self._count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="autosplit-heartbeat", daemon=True)
        self._thread.start()
        # Stopped before the interpreter finalizes: a daemon thread caught inside a store call while
        # the store's C++ objects are destroyed aborts the process ("terminate called ...").
        atexit.register(self.stop)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def at(self, doing: str, waiting: bool = False) -> None:
        """Called by the main thread when it starts something (cheap: three attribute writes)."""
        if doing != self.doing or waiting != self.waiting:
            self.doing, self.waiting, self.since = doing, waiting, time.monotonic()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._count += 1
            state = "waiting" if self.waiting else "busy"
            value = f"{self._count}|{state}|{self.doing}|{time.monotonic() - self.since:.1f}"
            try:
                self.store.set(f"{_PREFIX}{self.rank}", value)
            except Exception:       # the store is gone (job over, or its host died): stop beating
                return
            self._stop.wait(self.interval)


_BEATS: dict[int, Heartbeat] = {}


def heartbeat(store, rank: int, world_size: int) -> Heartbeat:
    """The process's Heartbeat for ``store`` (one thread per store, however many modules are built)."""
    if id(store) not in _BEATS:
        _BEATS[id(store)] = Heartbeat(store, rank, world_size)
    return _BEATS[id(store)]


def read_beats(store, world_size: int) -> dict[int, tuple[int, str, str, float]]:
    """rank -> (count, state, doing, seconds) for every rank that has beaten."""
    keys = [f"{_PREFIX}{r}" for r in range(world_size)]
    present = [r for r, k in enumerate(keys) if store.check([k])]
    out = {}
    for r in present:
        count, state, doing, seconds = store.get(keys[r]).decode().split("|")
        out[r] = (int(count), state, doing, float(seconds))
    return out


def diagnose(store, world_size: int, me: int, describe, min_busy_s: float = 0.0,
             device_queues: bool = False) -> str | None:
    """Why the job is stuck, naming other ranks, or None when nothing points at one.

    Watches every rank's beat for three intervals; ``describe(rank)`` gives "rank R (pp=.., tp=.., dp=..)";
    a rank counts as stalled when it has been busy at one action for ``min_busy_s`` at least (a rank
    merely computing its microbatch is not to blame).  ``device_queues``: the ranks' hosts wait on
    their GPUs' queues (NCCL), so "every rank waiting" may also be a device stuck in a kernel.
    """
    watch = watch_s(world_size)
    first = read_beats(store, world_size)
    time.sleep(watch)
    second = read_beats(store, world_size)
    dead = [r for r in range(world_size) if r != me and (r not in second or second[r][0] == first.get(r, (0,))[0])]
    if dead:
        return "; ".join(f"{describe(r)} died or froze (no heartbeat for {watch:g} s; its last beat, "
                         f"sent every {watch / 3:g} s, said it was at "
                         f"{second[r][2] if r in second else 'start-up'})" for r in dead)
    stalled = [r for r, (_, state, _, busy) in second.items() if r != me and state == "busy" and busy >= min_busy_s]
    if stalled:
        return "; ".join(f"{describe(r)} is stalled at {second[r][2]} (busy for {second[r][3]:.0f} s, "
                         f"not waiting on another rank)" for r in stalled)
    waits = ", ".join(f"rank {r} at {doing}" for r, (_, _, doing, _) in sorted(second.items()) if r != me)
    if not waits:
        return None
    if device_queues:
        return (f"every rank is waiting on another ({waits}): an ordering deadlock, or a GPU stuck in a kernel "
                f"or a transfer that never completes (a host waits on its device's queue, so a stuck device "
                f"reads as waiting too: the heartbeats cannot tell these apart)")
    return f"every rank is waiting on another ({waits}): an ordering deadlock"


def store_address() -> str:
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
