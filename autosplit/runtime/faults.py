"""Waiting with a deadline, and ending every rank when one fails.

Terms:
  failure key -- a key in the default process group's store.  The first rank that fails writes
                 "rank R (pp=.., tp=.., dp=..) failed at ACTION: Cause" there; every other rank,
                 while it waits, checks for the key and raises the same message, so no rank hangs
                 on a peer that is gone.
  deadline    -- every wait gives up after ``timeout_s`` seconds with a RankFailure naming this rank
                 and what it waited for.
  Watchdog.wait -- waits for one handle, watching the store and the deadline from the calling thread:
    NCCL Work   -- ``work.wait()`` does not block the host on NCCL (it only orders the streams), so a
                   deadline around it would never fire: we poll ``work.is_completed()`` (a CUDA event
                   query) on this thread, then call ``wait()`` for the stream ordering.  No thread hop.
    gloo Work   -- gloo's send/recv Work only completes inside ``wait()``, and a timed-out gloo
                   ``wait(timeout)`` marks the Work failed for good, so ``wait()`` runs on a helper
                   thread while this thread polls the result.
    Future      -- (the strict transport's groups) polled directly.
A wait abandoned on failure leaves its helper thread blocked; the threads are daemons, and the
ParallelModule is unusable after a RankFailure anyway.
"""
from __future__ import annotations

import time
from concurrent.futures import Future

from autosplit.runtime.serial_thread import SerialThread

FAILURE_KEY = "autosplit/failure"
_CHECK_EVERY_S = 0.02         # how often a waiting rank looks at the store
_POLL_S = (1e-5, 1e-3)        # first and longest sleep between completion polls


class RankFailure(RuntimeError):
    """A rank of the job failed or timed out; raised on every rank with the original cause."""


class Watchdog:
    def __init__(self, store, rank: int, coord, timeout_s: float, backend: str = "gloo"):
        self.store, self.rank, self.coord, self.timeout_s = store, rank, coord, timeout_s
        self.where = f"rank {rank} (pp={coord.pp}, tp={coord.tp}, dp={coord.dp})"
        self.polled = backend == "nccl"      # NCCL works complete on their own: poll them
        self._waiter = None if self.polled else SerialThread("autosplit-wait")

    def fail(self, doing: str, exc: BaseException) -> RankFailure:
        """Publish this rank's failure (first writer wins) and return the error to raise."""
        if isinstance(exc, RankFailure):
            return exc
        message = f"{self.where} failed at {doing}: {type(exc).__name__}: {exc}"
        try:
            if not self.store.check([FAILURE_KEY]):
                self.store.set(FAILURE_KEY, message)
        except Exception:  # the store itself is gone: still raise locally
            pass
        return RankFailure(message)

    def check(self) -> None:
        """Raise if another rank has failed."""
        if self.store.check([FAILURE_KEY]):
            cause = self.store.get(FAILURE_KEY).decode()
            raise RankFailure(f"{self.where} stopped: {cause}")

    def wait(self, handle, doing: str) -> None:
        """Wait for ``handle`` (a torch.distributed Work or a Future), at most timeout_s, watching
        for failures of other ranks."""
        if handle is None:
            return
        if isinstance(handle, Future):
            return self._until(handle.done, doing, lambda: handle.result())
        if self.polled:
            return self._until(handle.is_completed, doing, handle.wait)
        if handle.is_completed():
            return self._until(lambda: True, doing, handle.wait)
        future = self._waiter.submit(handle.wait)
        return self._until(future.done, doing, future.result)

    def _until(self, done, doing: str, finish) -> None:
        """Poll ``done()`` until true, then ``finish()``; raise on a deadline or another rank's failure."""
        start = time.monotonic()
        deadline, next_check, sleep = start + self.timeout_s, start + _CHECK_EVERY_S, _POLL_S[0]
        while not done():
            now = time.monotonic()
            if now >= next_check:
                self.check()
                next_check = now + _CHECK_EVERY_S
                if now > deadline:
                    raise self.fail(doing, TimeoutError(
                        f"no progress for {self.timeout_s:g} s (set AUTOSPLIT_TIMEOUT or timeout_s to change)"))
            time.sleep(sleep)
            sleep = min(2 * sleep, _POLL_S[1])
        try:
            finish()
        except Exception as exc:
            raise self.fail(doing, exc) from exc
