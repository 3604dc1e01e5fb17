"""Waiting with a deadline, and ending every rank when one fails.

Terms:
  failure key -- a key in the default process group's store.  The first rank that fails writes
                 "rank R (pp=.., tp=.., dp=..) failed at ACTION: Cause" there; every other rank,
                 while it waits, checks for the key and raises the same message, so no rank hangs
                 on a peer that is gone.
  Watchdog.wait -- blocks in ``work.wait()`` on a helper thread while this thread watches the store
                 and the deadline; it raises RankFailure on either, naming this rank and what it
                 waited for.

We wait on a thread rather than poll ``work.is_completed()`` because gloo's send/recv Work only
completes inside ``wait()``, and rather than use ``work.wait(timeout)`` because a timed-out gloo
wait marks the Work failed for good.  A wait abandoned on failure leaves its thread blocked; the
ParallelModule is unusable after a RankFailure anyway.
"""
from __future__ import annotations

import concurrent.futures
import time

FAILURE_KEY = "autosplit/failure"
_CHECK_EVERY_S = 0.02


class RankFailure(RuntimeError):
    """A rank of the job failed or timed out; raised on every rank with the original cause."""


class Watchdog:
    def __init__(self, store, rank: int, coord, timeout_s: float):
        self.store, self.rank, self.coord, self.timeout_s = store, rank, coord, timeout_s
        self.where = f"rank {rank} (pp={coord.pp}, tp={coord.tp}, dp={coord.dp})"
        self._waiter = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="autosplit-wait")

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

    def wait(self, work, doing: str) -> None:
        """Wait for ``work`` (a torch.distributed Work), at most timeout_s, watching for failures."""
        if work is None:
            return
        if work.is_completed():
            return self._finish(work, doing)
        future = self._waiter.submit(work.wait)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                future.result(timeout=_CHECK_EVERY_S)
                return
            except concurrent.futures.TimeoutError:
                pass
            except Exception as exc:
                raise self.fail(doing, exc) from exc
            self.check()
            if time.monotonic() > deadline:
                raise self.fail(doing, TimeoutError(
                    f"no progress for {self.timeout_s:.0f} s (set AUTOSPLIT_TIMEOUT or timeout_s to change)"))

    def _finish(self, work, doing: str) -> None:
        try:
            work.wait()
        except Exception as exc:
            raise self.fail(doing, exc) from exc
