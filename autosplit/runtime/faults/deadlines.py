"""Waiting with a deadline, and ending every rank when one fails.

Terms:
  failure key -- a key in the default process group's store.  The first rank that fails writes
                 "rank R (pp=.., tp=.., dp=..) failed at ACTION: Cause" there; every other rank,
                 while it waits, checks for the key and raises the same message, so no rank hangs
                 on a peer that is gone.
  deadline    -- every wait gives up after ``timeout_s`` seconds with a RankFailure naming this rank
                 and what it waited for.
  Watchdog.wait -- waits for one handle, watching the store and the deadline from the calling thread:
    NCCL Work   -- ``work.wait()`` only makes the stream wait and never blocks the host, so a deadline
                   around it would never fire: ``wait`` orders the stream and *defers* the check
                   (deferred.py: the terms, the run-ahead bounds and their limits).  A host read of a
                   device value (loss, norm, state dict) calls ``wait(..., host=True)``, which first
                   checks every deferred work in order against its deadline, on this thread.
    abort       -- on NCCL, with torch's async error handling off (``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``,
                   which torch's abort API asks for), a failure aborts this module's own groups, never the
                   default one; otherwise NCCL's watchdog (torch's default 3, torchrun's 1) tears a stuck
                   rank down once its timeout, longer than ours, passes.
    gloo Work   -- gloo's send/recv Work only completes inside ``wait()``, and a timed-out gloo
                   ``wait(timeout)`` marks the Work failed for good, so ``wait()`` runs on a helper
                   thread and this thread waits for the helper's Future.
    Future      -- (the strict transport's groups, the helper's) waited for on its condition variable,
                   ``_CHECK_EVERY_S`` at a time, checking the store and the deadline in between: the
                   waiting thread wakes the moment the Future is set, and sleeps otherwise.  Why not
                   poll with sleeps: a poll notices completion up to a sleep late (1 ms at the longest)
                   on every receive a pipeline waits for, and each poll wakes a rank that, on a CPU
                   host with more ranks than cores, takes a core from a rank that computes.
  blame       -- a wait that times out or breaks (a peer's connection reset) asks the heartbeats
                 (heartbeat.py) which rank died, stalled or is part of a deadlock, and the published
                 message names that rank first, so the survivors do not report themselves.
  explain     -- what a timed-out wait adds about its handle: for a transfer of an ordered transport
                 (p2p.py), the earlier group it is queued behind.
  blocking call -- a call that can block the host with no deadline checked inside it: a device value read
                 on the host (``.cpu()`` of the parameter checksums waits for the GPU's queue), or NCCL's
                 first collective on a group (the call creates the communicator and returns only once
                 every rank of the group has joined).  ``Watchdog.blocking`` runs it on the helper thread
                 and waits for it like for a Future: busy (this rank computes; a peer's diagnosis names it
                 as stalled there, and its own timeout blames itself) or waiting (on other ranks).
A wait abandoned on failure leaves its helper thread blocked; the threads are daemons, and the
ParallelModule is unusable after a RankFailure anyway.
"""
from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

import torch.distributed as dist

from autosplit.runtime.faults.deferred import DeferredWorks
from autosplit.runtime.faults.heartbeat import diagnose, heartbeat, store_address
from autosplit.runtime.faults.serial_thread import SerialThread

FAILURE_KEY = "autosplit/failure"
_CHECK_EVERY_S = 0.02         # how often a waiting rank looks at the store
_POLL_S = (1e-5, 1e-3)        # first and longest sleep between completion polls


class RankFailure(RuntimeError):
    """A rank of the job failed or timed out; raised on every rank with the original cause."""


def aborts_on_failure(backend: str) -> bool:
    """Whether a failure aborts this rank's groups: on NCCL with torch's async error handling off only
    (torch: its abort API "should be used with TORCH_NCCL_ASYNC_ERROR_HANDLING turned off"; with it on,
    NCCL's watchdog aborts and tears the rank down itself)."""
    return backend == "nccl" and os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "").strip() == "0"


class Watchdog:
    """Bounded waits for one rank (see the module docstring).

    Args:
        store: the job's store (the default group's).
        rank, mesh: this rank and the mesh, to name ranks as "rank R (pp=.., tp=.., dp=..)".
        timeout_s: the deadline of every wait.
        backend: "nccl" (works polled, waits deferred) or "gloo".
        groups: () -> the process groups this rank's module owns, the ones a failure may abort.
    """

    def __init__(self, store, rank: int, mesh, timeout_s: float, backend: str = "gloo", groups=None):
        self.store, self.rank, self.mesh, self.timeout_s = store, rank, mesh, timeout_s
        self.groups = groups or (lambda: [])
        self.where = self.describe(rank)
        self.polled = backend == "nccl"      # NCCL works complete on their own: poll them
        self._waiter = None if self.polled else SerialThread("autosplit-wait")
        self.deferred = DeferredWorks()        # NCCL works whose completion is not checked yet
        self.beat = heartbeat(store, rank, mesh.size)

    def describe(self, rank: int) -> str:
        """"rank R (pp=.., tp=.., dp=..)", the way every message names a rank."""
        c = self.mesh.coord_of(rank)
        return f"rank {rank} (pp={c.pp}, tp={c.tp}, dp={c.dp})"

    def at(self, doing: str) -> None:
        """Tell the heartbeat what this rank is doing now (an action, a call)."""
        self.beat.at(doing)

    def fail(self, doing: str, exc: BaseException, blame_others: bool = False) -> RankFailure:
        """Publish this rank's failure (first writer wins) and return the error to raise.

        With ``blame_others`` (a wait that timed out or broke) the heartbeats are asked first which
        other rank is at fault, and that rank is named before this one.
        """
        if isinstance(exc, RankFailure):
            return exc
        message = f"{self.where} failed at {doing}: {type(exc).__name__}: {exc}"
        try:
            if blame_others and not self.store.check([FAILURE_KEY]):
                culprit = diagnose(self.store, self.mesh.size, self.rank, self.describe, self.timeout_s / 2,
                                   device_queues=self.polled)
                if culprit:
                    message = f"{culprit}; {self.where} gave up at {doing}: {type(exc).__name__}: {exc}"
            if not self.store.check([FAILURE_KEY]):
                self.store.set(FAILURE_KEY, message)
            else:            # another rank was first: report its cause, which is the earlier one
                message = f"{self.where} stopped at {doing}: {self.store.get(FAILURE_KEY).decode()}"
        except Exception as store_exc:  # the store itself is gone: say so, and still raise locally
            message = self._store_lost(doing, store_exc, message)
        self._abort()
        return RankFailure(message)

    def _abort(self) -> None:
        """On NCCL with async error handling off, abort this module's own groups: kernels waiting on a
        failed peer would otherwise stay queued on the GPU, and the process could not exit.  Never the
        default group, which the job may still use (as ``World.close``).  Gloo's waits end with the
        process; with NCCL's error handling on, its watchdog ends them (see ``aborts_on_failure``)."""
        if not (self.polled and aborts_on_failure("nccl")):
            return
        for group in self.groups():
            try:
                dist.distributed_c10d._abort_process_group(group)
            except Exception:    # an experimental torch API: the failure is reported all the same
                pass

    def _store_lost(self, doing: str, store_exc: BaseException, message: str) -> str:
        return (f"the job's store at {store_address()} is unreachable ({type(store_exc).__name__}: "
                f"{store_exc}): the process hosting it (rank 0's, unless torchrun's agent hosts the "
                f"store) has probably died; {self.where} was at {doing}; {message}")

    @contextlib.contextmanager
    def guarded(self, doing: str):
        """A section whose errors every rank learns: an exception raised inside (the user's code, a
        collective that raised instead of failing its wait) is published as this rank's failure at
        the action the section last announced (``at``; ``doing`` until then), and re-raised with its
        own type, the job's message attached as a note.  Why publish: the other ranks are (or will be)
        waiting on this one in a collective it never joins; without the failure key they would wait
        out their deadline and then blame the wrong rank, or none."""
        self.at(doing)
        try:
            yield
        except RankFailure:         # published already (by this rank's wait, or by the rank at fault)
            raise
        except Exception as exc:
            failure = self.fail(self.beat.doing or doing, exc)
            if hasattr(exc, "add_note"):
                exc.add_note(str(failure))
            raise

    def check(self, doing: str = "a wait") -> None:
        """Raise if another rank has failed (or the store is gone)."""
        try:
            failed = self.store.check([FAILURE_KEY])
            cause = self.store.get(FAILURE_KEY).decode() if failed else None
        except Exception as exc:
            raise RankFailure(self._store_lost(doing, exc, "")) from exc
        if failed:
            self._abort()
            raise RankFailure(f"{self.where} stopped: {cause}")

    def wait(self, handle, doing: str, host: bool = False, on_host: bool = False, since: float | None = None,
             explain=None) -> None:
        """Wait for ``handle`` (a torch.distributed Work or a Future), at most timeout_s, watching
        for failures of other ranks.  ``host``: the caller reads the result on the host next (on
        NCCL the wait is otherwise deferred; see the module docstring).  ``on_host``: the work is a
        gloo one even though the job runs NCCL (the world's control group).  ``since``: when the
        work was posted (a deferred work's deadline counts from then).  ``explain``: () -> text a
        timeout adds (what the handle is queued behind)."""
        if handle is None:
            return
        if isinstance(handle, Future):
            return self._until(handle.done, doing, lambda: handle.result(), handle, explain=explain)
        if self.polled and not on_host:
            try:
                handle.wait()                       # stream ordering only; returns at once
            except Exception as exc:
                raise self.fail(doing, exc, blame_others=True) from exc
            self.deferred.add(handle, doing, since, explain)
            # why here: a host read checks every work first; any other wait, the due ones (works bound)
            self.settle(due_only=not host)
            return
        if handle.is_completed():
            return self._until(lambda: True, doing, handle.wait)
        future = self._helper().submit(handle.wait)
        return self._until(future.done, doing, future.result, future, explain=explain)

    def blocking(self, fn, doing: str, waiting: bool = False):
        """``fn()``, a call that may block the host (see *blocking call*), bounded by the deadline and ended
        by another rank's failure; returns its result.  An exception of ``fn`` is published as this rank's
        failure at ``doing`` (a RankFailure).  ``waiting``: ``fn`` waits on other ranks (the heartbeat says
        *waiting*, and a timeout asks the heartbeats whom to blame); otherwise this rank is *busy* at
        ``doing``.  A call abandoned at the deadline keeps the helper thread (a daemon); the module is
        unusable after a RankFailure anyway."""
        future = self._helper().submit(fn)
        self._until(future.done, doing, lambda: None, future, waiting=waiting)
        try:
            return future.result()
        except Exception as exc:     # the call itself failed on this rank: no peer to blame
            raise self.fail(doing, exc) from exc

    def _helper(self) -> SerialThread:
        # one helper for gloo's waits and blocking calls: the main thread never runs two at once
        if self._waiter is None:
            self._waiter = SerialThread("autosplit-wait")
        return self._waiter

    def close(self) -> None:
        """End the waiting thread (a later wait starts a new one)."""
        if self._waiter is not None:
            self._waiter.close()
            self._waiter = None

    def settle(self, due_only: bool = False) -> None:
        """Check, each by its deadline, that every deferred NCCL work (``due_only``: every one a run-ahead
        bound makes due) has finished without error (deferred.py; no-op on gloo: nothing is deferred)."""
        while (work := self.deferred.pop(due_only)) is not None:
            self._until(work.handle.is_completed, work.doing, work.finish, start=work.since, explain=work.explain)

    def advance(self) -> None:
        """Called before every compute action: checks the works the actions bound makes due (deferred.py)."""
        self.deferred.begin_action()
        self.settle(due_only=True)

    def until(self, done, doing: str) -> None:
        """Poll ``done()`` (a store key, say) with the same deadline and failure checks as a wait."""
        self._until(done, doing, lambda: None)

    def _until(self, done, doing: str, finish, future: Future | None = None, start: float | None = None,
               explain=None, waiting: bool = True) -> None:
        """Poll ``done()`` until true, then ``finish()``; raise on a deadline or another rank's failure.
        With ``future`` (what ``done`` reports on), block on it between checks instead of sleeping.
        ``start``: when the deadline starts counting (default now).  ``waiting``: what the heartbeat says
        meanwhile, and whether a timeout or error asks it whom to blame (False: a blocking call of this
        rank's own, which is to blame itself)."""
        before = self.beat.doing, self.beat.waiting
        self.beat.at(doing, waiting=waiting)
        now = time.monotonic()
        deadline = (now if start is None else start) + self.timeout_s
        next_check, sleep = now + _CHECK_EVERY_S, _POLL_S[0]
        while not done():
            now = time.monotonic()
            if now >= next_check:
                self.check(doing)
                next_check = now + _CHECK_EVERY_S
                if now > deadline:
                    why = explain() if explain is not None else None
                    what = "no progress for" if waiting else "not finished after"
                    raise self.fail(doing, TimeoutError(
                        f"{what} {self.timeout_s:g} s (set AUTOSPLIT_TIMEOUT or timeout_s to change)"
                        + (f"; {why}" if why else "")), blame_others=waiting)
            if future is not None:
                wait_futures([future], timeout=max(0.0, next_check - time.monotonic()))
                continue
            time.sleep(sleep)
            sleep = min(2 * sleep, _POLL_S[1])
        try:
            finish()
        except Exception as exc:
            raise self.fail(doing, exc, blame_others=waiting) from exc
        self.beat.at(*before)
