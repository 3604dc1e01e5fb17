"""Deferred NCCL works: what the Watchdog has not checked yet, and when it must check it.

Terms:
  deferred work -- an NCCL Work the stream has been ordered after (``work.wait()``, which on NCCL
                   returns at once and never blocks the host) but whose completion is not checked yet.
                   Inside a step the host must not block (it would stop running ahead of the GPU), so
                   the check waits for a host read (``Watchdog.wait(..., host=True)`` checks every one)
                   or for a run-ahead bound (below).  Checks go in deferral order, oldest first.
  since       -- when a deferred work was posted: its deadline counts from there, as NCCL's own
                 timeout does, so ours always fires first (world.py sets NCCL's longer).
  failed work -- NCCL's ``is_completed()`` is true for a work that *failed* too (its exception is set),
                 so completion is followed by a look at the work's error (``work_error``).
  run-ahead   -- how much the host may launch past a deferred work it has not checked.  Why bound it:
                 a receive or collective that never finishes stalls the GPU's stream; a host that only
                 checks at the loss keeps launching kernels until CUDA's launch queue is full, then
                 blocks inside a launch, where no deadline of ours runs, and NCCL's watchdog ends the
                 job with its own message instead.  A work is *due* (checked now, waiting for it if
                 it has not finished) once either bound is reached:
    actions bound -- it was deferred ``RUN_AHEAD_ACTIONS`` or more compute actions ago (checked by
                 ``Watchdog.advance()``, which the executor calls before every compute action);
    works bound -- it was deferred ``RUN_AHEAD_WORKS`` or more deferrals ago (checked at every
                 deferral): a tp stage defers a collective every few layers *inside* one action, and
                 one long action can hold more launches than the queue.
                 Why a check adds no ordering deadlock: it waits for a work no earlier in the host's
                 order than gloo's blocking wait of the same work, which every tested schedule runs.
Limits (docs/design.md, "The NCCL path: failures and deadlines"): the bounds count actions and
deferrals, not launches, and CUDA's launch-queue depth is not documented; a stretch of one action
with more launches than the queue holds and no deferral in it (a long non-tp run of layers) can still
block the host in a launch.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

# Why 2: the host queues action n while the GPU runs n-1, so a work of n-2 has normally finished
# when it is checked (no wait for the GPU in a healthy step).  Behind a stuck work this queues at
# most two actions' launches: few for a stage that defers only its receives (a pp stage without
# tp), unmeasured for a long one; the works bound covers the stages that defer inside an action.
RUN_AHEAD_ACTIONS = 2
# Why 8: behind a stuck work at most 8 gaps between deferrals queue.  The widest gap of a tp ViT
# block is its backward between the two input-gradient all-reduces: ~35 aten ops for timm's
# vit_base block in fp32, ~40 under bf16 autocast (counted on CPU with a dispatch mode; views
# launch nothing, so launches are fewer), so ~320 launches, a third of CUDA's launch queue (on
# the order of a thousand; not documented, not measured here).  And a healthy check of the work 8
# deferrals back waits only when the GPU is 8 collectives behind, and then 7 collectives' kernels
# are still queued, so the poll (1 ms at the longest) does not leave the GPU idle.
RUN_AHEAD_WORKS = 8


def work_error(handle) -> BaseException | None:
    """What a finished work failed with, or None.  ``Work.exception()`` where the work implements it
    (NCCL's and gloo's do; torch marks it deprecated and prints so once per process); else its
    ``wait()`` reports a failure by raising."""
    try:
        return handle.exception()
    except Exception:                # not implemented for this work type
        pass
    try:
        handle.wait()
    except Exception as exc:
        return exc
    return None


@dataclass
class Deferred:
    """An NCCL work whose completion is not checked yet."""
    handle: object
    doing: str
    action: int                  # DeferredWorks.actions when it was deferred
    index: int                   # how many works were deferred before it
    since: float                 # when it was posted (time.monotonic()): its deadline counts from here
    explain: object = None       # () -> str | None, added to a timeout's message

    def finish(self) -> None:
        """Raise what the (completed) work failed with, if anything."""
        error = work_error(self.handle)
        if error is not None:
            raise error


class DeferredWorks:
    """This rank's deferred works, oldest first, and the counts the run-ahead bounds use."""

    def __init__(self):
        self._pending: deque[Deferred] = deque()
        self.actions = 0             # compute actions begun (begin_action)
        self.deferred = 0            # works deferred so far (add)

    def add(self, handle, doing: str, since: float | None = None, explain=None) -> None:
        """Defer ``handle``: posted at ``since`` (default now)."""
        since = time.monotonic() if since is None else since
        self._pending.append(Deferred(handle, doing, self.actions, self.deferred, since, explain))
        self.deferred += 1

    def begin_action(self) -> None:
        """A compute action begins: the actions bound moves on."""
        self.actions += 1

    def pop(self, due_only: bool) -> Deferred | None:
        """The oldest deferred work, taken off the list: any (``due_only`` False), or only one that a
        run-ahead bound says is due; None when there is none.  Both bounds grow with a work's age,
        so once the oldest is not due, no later one is."""
        if not self._pending:
            return None
        oldest = self._pending[0]
        if due_only and not (self.actions - oldest.action >= RUN_AHEAD_ACTIONS
                             or self.deferred - 1 - oldest.index >= RUN_AHEAD_WORKS):
            return None
        return self._pending.popleft()
