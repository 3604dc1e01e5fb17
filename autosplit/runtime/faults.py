"""Waiting with a deadline, and ending every rank when one fails.

Terms:
  failure key -- a key in the default process group's store.  The first rank that fails writes
                 "rank R (pp=.., tp=.., dp=..) failed at ACTION: Cause" there; every other rank,
                 while it waits, checks for the key and raises the same message, so no rank hangs
                 on a peer that is gone.
  Watchdog.wait -- polls a distributed Work object instead of blocking in ``work.wait()``, so it can
                 notice a failure elsewhere and enforce the timeout; it raises RankFailure on
                 either, naming this rank and what it waited for.

We poll rather than use ``work.wait(timeout)`` because a blocked wait cannot also watch the store,
and a timed-out gloo wait leaves the pair unusable anyway.
"""
from __future__ import annotations

import time

FAILURE_KEY = "autosplit/failure"
_CHECK_EVERY_S = 0.02


class RankFailure(RuntimeError):
    """A rank of the job failed or timed out; raised on every rank with the original cause."""


class Watchdog:
    def __init__(self, store, rank: int, coord, timeout_s: float):
        self.store, self.rank, self.coord, self.timeout_s = store, rank, coord, timeout_s
        self.where = f"rank {rank} (pp={coord.pp}, tp={coord.tp}, dp={coord.dp})"

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
        if work is None or work.is_completed():
            return self._finish(work, doing)
        deadline = time.monotonic() + self.timeout_s
        next_check = time.monotonic() + _CHECK_EVERY_S
        while not work.is_completed():
            now = time.monotonic()
            if now > deadline:
                raise self.fail(doing, TimeoutError(
                    f"no progress for {self.timeout_s:.0f} s (set AUTOSPLIT_TIMEOUT or timeout_s to change)"))
            if now > next_check:
                self.check()
                next_check = now + _CHECK_EVERY_S
            time.sleep(0.0002)
        self._finish(work, doing)

    def _finish(self, work, doing: str) -> None:
        if work is None:
            return
        try:
            work.wait()
        except Exception as exc:
            raise self.fail(doing, exc) from exc
