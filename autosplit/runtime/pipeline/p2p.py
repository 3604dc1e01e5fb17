"""Point-to-point transfers of stage boundaries between pipeline ranks, one group at a time.

Terms:
  boundary  -- the tensors stage s sends to stage s+1 (activations, forward) or receives back from it
               (their gradients, backward), with shapes and dtypes known from the plan: no per-step
               shape handshake.
  op        -- one ("send" | "recv", tensor, peer global rank, tag).
  group     -- the ops of one ``schedule.Group``, posted together; ``Posted.wait`` returns when every
               op of the group is done (the schedule's lowering decides what goes together and why).
  tag       -- identifies one tensor of one boundary of one microbatch, so gloo can match transfers
               that are in flight at the same time; NCCL ignores tags and matches in posting order,
               which the lowering keeps consistent between the two ends.
  transport -- how a group reaches the wire (``make_transport`` picks one):
    nccl    -- one ``batch_isend_irecv`` over the pp process group; NCCL coalesces it into one work,
               which is the one thing waited on.
    gloo    -- each op posted at once with ``isend`` / ``irecv``; gloo matches by tag in any order.
    strict  -- gloo with NCCL's ordering (``AUTOSPLIT_STRICT_P2P=1``): one thread runs this rank's
               groups one after another in posting order, each to completion before the next starts,
               and gloo's sends are rendezvous (a send completes only once its receive is posted), so
               an order that would hang on NCCL hangs here too, and times out with the usual message.
  ordered   -- the nccl and strict transports run a rank's groups one after another in posting order,
               so a group can wait behind an earlier one that never finishes (a send whose receive is
               not posted yet: NCCL's sends, and gloo's, complete only once the receive is posted).
               A wait that times out on such a group names the earliest unfinished group posted
               before it (``Posted.explain``), which is where the ranks' orders disagree.
All traffic goes over the pp process group, never WORLD, so it cannot be confused with other axes'.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Future

import torch
import torch.distributed as dist

from autosplit.runtime.faults.serial_thread import SerialThread

MAX_TENSORS = 64   # tensors per boundary; tags reserve this many slots
STRICT_ENV = "AUTOSPLIT_STRICT_P2P"


def tag(direction: int, receiver_stage: int, microbatch: int, index: int, n_microbatches: int) -> int:
    """A unique tag: direction 0 = activation, 1 = gradient."""
    return ((direction * 4096 + receiver_stage) * n_microbatches + microbatch) * MAX_TENSORS + index


class Posted:
    """One posted group: the handles to wait on, and the tensors that must live until then.
    ``posted_at``: when it was posted (on NCCL a deferred wait's deadline counts from there);
    ``earlier``: the groups an ordered transport posted before this one and had not seen finish."""

    def __init__(self, handles: list, tensors: list[torch.Tensor], what: str, earlier: list | None = None):
        self.handles, self.tensors, self.what, self.done = handles, tensors, what, False
        self.posted_at, self.earlier = time.monotonic(), earlier or []

    def wait(self, watchdog, doing: str | None = None) -> None:
        if self.done:
            return
        for handle in self.handles:
            watchdog.wait(handle, doing or self.what, since=self.posted_at, explain=self.explain)
        self.done = True
        self.tensors = []               # sent buffers may be freed now
        self.earlier = []

    def finished(self) -> bool:
        """Whether every handle has finished (without waiting)."""
        return self.done or all(h.done() if isinstance(h, Future) else h.is_completed() for h in self.handles)

    def explain(self) -> str | None:
        """For a timeout: the earliest group posted before this one that has not finished, if any."""
        blocker = next((p for p in self.earlier if not p.finished()), None)
        if blocker is None:
            return None
        return (f"{blocker.what}, posted before {self.what} on this rank, has not finished: this rank's "
                f"transport runs its groups one at a time in posting order (as NCCL does), and a send "
                f"finishes only once its receive is posted")


class _Ordered:
    """What an ordered transport posted and has not yet seen finish, in posting order."""

    def __init__(self):
        self.open: list[Posted] = []

    def before_next(self) -> list[Posted]:
        """The unfinished groups a group posted now runs behind (finished ones are dropped)."""
        self.open = [p for p in self.open if not p.finished()]
        return list(self.open)

    def add(self, posted: Posted) -> Posted:
        self.open.append(posted)
        return posted


class NcclTransport:
    """One ``batch_isend_irecv`` per group: NCCL runs it as one fused group on its p2p stream."""

    def __init__(self, group):
        self.group, self.ordered = group, _Ordered()

    def post(self, ops: list[tuple], what: str) -> Posted:
        p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, group=self.group, tag=tg)
               for kind, t, peer, tg in ops]
        earlier = self.ordered.before_next()
        return self.ordered.add(Posted(dist.batch_isend_irecv(p2p), [t for _, t, _, _ in ops], what, earlier))

    def close(self) -> None:
        """Nothing of its own to release (the pp group belongs to the World)."""


class GlooTransport:
    """Every op posted at once; gloo pairs them by (peer, tag) whatever the order."""

    def __init__(self, group):
        self.group = group

    def post(self, ops: list[tuple], what: str) -> Posted:
        works = [(dist.isend if kind == "send" else dist.irecv)(t, peer, group=self.group, tag=tg)
                 for kind, t, peer, tg in ops]
        return Posted(works, [t for _, t, _, _ in ops], what)

    def close(self) -> None:
        """Nothing of its own to release (the pp group belongs to the World)."""


class StrictTransport(GlooTransport):
    """NCCL's ordering on gloo: groups run one at a time, in posting order, on one thread."""

    def __init__(self, group):
        super().__init__(group)
        self._runner, self.ordered = SerialThread("autosplit-strict-p2p"), _Ordered()

    def post(self, ops: list[tuple], what: str) -> Posted:
        earlier = self.ordered.before_next()
        return self.ordered.add(Posted([self._runner.submit(self._run, ops)], [t for _, t, _, _ in ops], what, earlier))

    def _run(self, ops: list[tuple]) -> None:
        # Post the whole group, then wait for every op: the ops of one group are in flight together,
        # the next group starts only after this one is done (like a fused NCCL group on its stream).
        for work in super().post(ops, "").handles:
            work.wait()

    def close(self) -> None:
        self._runner.close()


def strict_requested() -> bool:
    return os.environ.get(STRICT_ENV, "0") not in ("", "0", "false", "False")


def make_transport(backend: str, group):
    """The transport for ``backend`` over ``group`` (the pp axis); see the module docstring."""
    if backend == "nccl":
        return NcclTransport(group)
    return StrictTransport(group) if strict_requested() else GlooTransport(group)
