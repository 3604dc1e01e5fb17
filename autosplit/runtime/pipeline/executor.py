"""Interpret one pipeline rank's lowered schedule: computes, and communication groups, in order.

Terms:
  lowered list -- this rank's schedule (autosplit.schedule.lower): F / B (or F / I / W) of
                  (stage, microbatch) and Groups of SEND_F / RECV_F / SEND_B / RECV_B.  The
                  executor does what the list says, in order: it posts each group when it reaches
                  it (without waiting), and waits for a receive only inside the compute that
                  consumes it.  Where a group sits, and so what
                  overlaps what, is the lowering's decision, made so that NCCL cannot deadlock.
  inbox        -- tensors a stage will consume: activations (from RECV_F, or handed over locally when
                  stage s+1 lives on this rank) and output gradients (from RECV_B, or local); a
                  received entry is (posted group, buffers) until it is waited on.
  outbox       -- tensors a stage produced for the next SEND of them.
  loss scale   -- each microbatch's loss is multiplied by 1/m (and by the fp16 scaler's factor), so
                  the gradients are those of the replica batch's mean loss.
  I / W        -- zero-bubble schedules: I is B with the split GEMMs' weight gradients deferred
                  (autosplit/weight_grad.py, under the key (stage, microbatch)); W computes them and
                  adds them into .grad.
  armed        -- ``on_last_backward(stage, final)`` tells the dp buckets that the stage's gradients
                  are final from now on: just before its last B; or, when the stage runs split GEMMs,
                  just before the weight gradients of its last B or W run (every I of the stage ran
                  by then), with ``final`` the stage's parameters those do not write (their gradients
                  are complete).  Not before: autograd fires a weight's post-accumulate hook during I
                  although I gave it no gradient (autosplit/weight_grad.py).
  placement    -- which stage each (rank, chunk) runs and where a peer stage lives: the plan's
                  (``plan.placement``: looped, or zb-v's V).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.profiler import record_function

from autosplit.errors import AutosplitError
from autosplit.runtime.pipeline.p2p import Posted, make_transport, tag

from autosplit.schedule import Action, ActionKind, Group, build_schedule, forward_schedule, lower
from autosplit.weight_grad import DEFERRED, uses_split_ops

log = logging.getLogger("autosplit")
F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


class PipelineExecutor:
    def __init__(self, world, plan, modules: list[torch.nn.Module], loss_fn: Callable, watchdog,
                 autocast_dtype: torch.dtype | None = None, on_last_backward: Callable | None = None,
                 after_backward: Callable | None = None):
        self.world, self.plan, self.loss_fn, self.watchdog = world, plan, loss_fn, watchdog
        pp, r = plan.mesh.pp, world.coord.pp
        self.pp, self.n_stages, self.m = pp, plan.n_stages, plan.num_microbatches
        self.place = plan.placement
        self.modules = {self.place.stage(r, c): mod for c, mod in enumerate(modules)}
        self.train_items = lower(build_schedule(plan.schedule, pp, self.m, plan.chunks_per_rank))[r]
        self.predict_items = lower(forward_schedule("gpipe", pp, self.m, plan.chunks_per_rank,
                                                    placement=self.place.kind))[r]
        self.split = {s: uses_split_ops(mod) for s, mod in self.modules.items()}
        # the compute after which a stage's gradients are final: its last B, or its last W; on a stage
        # kept fused under an I / W schedule (rank_plan, deferring_stages) its last I, which runs the
        # whole backward (its W's find nothing queued)
        final = {s: (B, W) if self.split[s] else (B, I) for s in self.modules}
        self.last_grad = {s: [a for a in self.train_items if a.is_compute and a.stage == s and a.kind in final[s]][-1]
                          for s in self.modules}
        self.autocast_dtype = autocast_dtype
        self.on_last_backward = on_last_backward or (lambda stage, final=(): None)
        self.after_backward = after_backward        # (stage module) -> None, after each B / I
        self.transport = make_transport(world.backend, world.group("pp")) if pp > 1 else None
        if self.transport is not None and world.backend == "nccl":
            # NCCL's first operation on a communicator must involve all of its ranks (see
            # batch_isend_irecv's documentation): one all-reduce over pp creates it before any pair talks.
            # Creating it blocks inside the call until every pp rank joins: a blocking call (deadlines.py).
            warm = torch.zeros(1, device=world.device)
            work = watchdog.blocking(lambda: dist.all_reduce(warm, group=world.group("pp"), async_op=True),
                                     "pp group start", waiting=True)
            watchdog.wait(work, "pp group start")

    def close(self) -> None:
        """Release the transport's thread (the strict transport runs one); the executor is unusable after."""
        if self.transport is not None:
            self.transport.close()

    # ---- one step ------------------------------------------------------------------------------
    def run(self, xs: list[tuple], ys: list | None, loss_scale: float = 1.0, train: bool = True):
        """Run the schedule; returns (sum of this rank's microbatch losses, last-stage outputs)."""
        self.xs, self.ys, self.loss_scale, self.train = xs, ys, loss_scale, train
        self.inbox_f: dict = {}
        self.inbox_b: dict = {}
        self.saved: dict = {}
        self.outbox: dict = {}
        self.posted: list[Posted] = []
        self.losses: list[torch.Tensor] = []
        self.outputs: dict[int, torch.Tensor] = {}
        DEFERRED.clear()                  # nothing a failed earlier step queued may reach this one
        run_compute = {F: self._forward, B: self._backward, I: self._backward, W: self._weight_grad}
        debug = log.isEnabledFor(logging.DEBUG)
        for item in self.train_items if train else self.predict_items:
            if debug:                   # the schedule as this rank runs it: computes and transfer groups
                log.debug("rank %d: %s", self.world.rank, item)
            if isinstance(item, Group):
                self._guarded(item, self._post)
            else:
                # NCCL: check the transfers and collectives deferred RUN_AHEAD_ACTIONS computes ago, so
                # that a stuck one ends the step at our deadline, before the host blocks in a launch
                # behind it (deferred.py, *run-ahead*); nothing is pending on gloo
                self.watchdog.advance()
                self._guarded(item, run_compute[item.kind])
        for posted in self.posted:     # sends not yet known done; their buffers live until then
            self._guarded(posted.what, lambda _: posted.wait(self.watchdog))
        total = torch.stack(self.losses).sum() if self.losses else torch.zeros((), device=self.world.device)
        return total.detach(), [self.outputs[k] for k in sorted(self.outputs)]

    def _guarded(self, item, fn) -> None:
        # The user's own error (in their model or loss): every other rank stops with the published
        # message, and this rank raises the original exception, its type kept, with that message
        # attached, so an ``except ValueError`` around ``step`` still sees a ValueError here.
        with self.watchdog.guarded(str(item)):
            # one profiler range per action or transfer group, named as the schedule prints it ("1F3",
            # "0W2", "[SEND_F ...]"): torch.profiler traces and the benchmarks' phase timings read these
            with record_function(f"autosplit::{item}"):
                fn(item)

    # ---- communication -------------------------------------------------------------------------
    def _post(self, group: Group) -> None:
        """Post every transfer of ``group`` as one group of the transport (see the module docstring)."""
        ops, received = [], []
        for a in group.actions:
            peer = self.world.rank_at(pp=self.place.rank(a.peer_stage))
            direction = 0 if a.kind in (ActionKind.SEND_F, ActionKind.RECV_F) else 1
            receiver = a.peer_stage if a.kind.is_send else a.stage
            if a.kind.is_send:
                tensors = [t.contiguous() for t in self.outbox.pop((a.stage, a.microbatch, direction))]
            else:
                tensors = self._buffers(a)
                received.append((a, tensors))
            for k, t in enumerate(tensors):
                ops.append(("send" if a.kind.is_send else "recv", t, peer,
                            tag(direction, receiver, a.microbatch, k, self.m)))
        posted = self.transport.post(ops, str(group))
        self.posted.append(posted)
        for a, tensors in received:
            box = self.inbox_f if a.kind is ActionKind.RECV_F else self.inbox_b
            box[(a.stage, a.microbatch)] = (posted, tensors, f"{a} of {group}" if len(group.actions) > 1 else str(a))

    def _buffers(self, a: Action) -> list[torch.Tensor]:
        infos = self.plan.stages[a.stage].inputs if a.kind is ActionKind.RECV_F else self.plan.stages[a.stage].outputs
        return [torch.empty(t.shape, dtype=getattr(torch, t.dtype), device=self.world.device) for t in infos]

    def _take(self, box: dict, key) -> list[torch.Tensor]:
        item = box.pop(key)
        if isinstance(item, tuple):               # received: wait for its group first
            posted, tensors, what = item
            with record_function(f"autosplit::wait {what}"):
                posted.wait(self.watchdog, what)
            return tensors
        return item                               # handed over on this rank

    # ---- compute -------------------------------------------------------------------------------
    def _forward(self, a: Action) -> None:
        s, i = a.stage, a.microbatch
        if s == 0:
            inputs = list(self.xs[i])
        else:
            inputs = [t.requires_grad_(self.train and t.is_floating_point())
                      for t in self._take(self.inbox_f, (s, i))]
        with torch.set_grad_enabled(self.train), self._autocast():
            outputs = self.modules[s](*inputs)
        if s == self.n_stages - 1:
            self._finish_forward(s, i, inputs, outputs[0])
            return
        infos = self.plan.stages[s].outputs
        self._check_boundary(s, i, outputs, infos)
        outputs = [o.to(getattr(torch, t.dtype)) for o, t in zip(outputs, infos)]  # keep the planned dtype
        if self.train:
            self.saved[(s, i)] = (inputs, outputs)
        handoff = [o.detach() for o in outputs]
        if (s + 1) in self.modules:
            self.inbox_f[(s + 1, i)] = handoff
        else:
            self.outbox[(s, i, 0)] = handoff

    def _check_boundary(self, s: int, i: int, outputs, infos) -> None:
        """Stage ``s``'s outputs must be what the plan says its boundary carries, checked here, on the
        sender, before anything is sent or handed over.  Why the sender: the receiver's buffers are
        allocated from the plan's shapes (``_buffers``: no per-step shape handshake), so a check of what
        arrived would always pass; gloo refuses a size mismatch on the receiving end, but NCCL moves
        bytes by count and would hang (the receive never fills) or hand over another microbatch's
        bytes.  A different number of outputs would make ``zip`` drop sends the peer waits for.
        The dtype is not checked: the cast below makes it the planned one."""
        shapes = [tuple(o.shape) for o in outputs]
        planned = [tuple(t.shape) for t in infos]
        if shapes != planned:
            raise AutosplitError(
                f"stage {s} produced outputs of shapes {shapes} for microbatch {i}, but the plan's boundary to "
                f"stage {s + 1} carries {planned} (the receiving rank's buffers have these shapes): the model's "
                f"forward changed shape between planning and this step (shape-dependent Python, data-dependent "
                f"sizes, or a module changed after parallelize); nothing was sent")

    def _finish_forward(self, s: int, i: int, inputs, output: torch.Tensor) -> None:
        if not self.train:
            self.outputs[i] = output.detach()
            return
        with self._autocast():
            loss = self.loss_fn(output, self.ys[i])
        self.losses.append(loss.detach().float())
        self.saved[(s, i)] = (inputs, loss * self.loss_scale)

    def _backward(self, a: Action) -> None:
        """B, or I: the same backward, with the split GEMMs' weight gradients deferred to W."""
        s, i = a.stage, a.microbatch
        inputs, outputs = self.saved.pop((s, i))
        if a == self.last_grad[s] and not self.split[s]:
            self.on_last_backward(s)
        # B collects eagerly: under tp its split GEMMs' weight gradients overlap the backward
        # collectives (runtime/parallel/tp_collectives.py) and the rest run right after; I leaves them to W
        with DEFERRED.collecting((s, i), eager=a.kind is B):
            if s == self.n_stages - 1:
                outputs.backward()
            else:
                grads = self._take(self.inbox_b, (s, i))
                pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if self.after_backward is not None:
            self.after_backward(self.modules[s])
        if a.kind is B:
            self._weight_grad(a)        # what the collectives left (arms the stage if last)
        if s == 0:
            return
        input_grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]
        if (s - 1) in self.modules:
            self.inbox_b[(s - 1, i)] = input_grads
        else:
            self.outbox[(s, i, 1)] = input_grads

    def _weight_grad(self, a: Action) -> None:
        """W (or the end of a B): the weight gradients deferred for (stage, microbatch), added into .grad."""
        key = (a.stage, a.microbatch)
        if a == self.last_grad[a.stage] and (self.split[a.stage] or a.kind is W):
            # every other gradient of the stage is complete: all its I ran (each before its W), and
            # its other W's ran; only the weights this W writes are still to come
            written = {id(w) for w in DEFERRED.weights(key)}
            self.on_last_backward(a.stage, [p for p in self.modules[a.stage].parameters() if id(p) not in written])
        DEFERRED.run(key)        # on the tensors the forward saw (already in the autocast dtype)

    def _autocast(self):
        if self.autocast_dtype is None:
            return torch.autocast(self.world.device.type, enabled=False)
        return torch.autocast(self.world.device.type, dtype=self.autocast_dtype)
