"""Interpret one pipeline rank's action list: forward, backward, sends and receives per microbatch.

Terms:
  action list -- this rank's lowered schedule (autosplit.schedule): F / B of (stage, microbatch) and
                 SEND_F / RECV_F / SEND_B / RECV_B.  The executor does what the list says, in order.
  inbox       -- tensors a stage will consume: activations (from RECV_F, or handed over locally when
                 stage s+1 lives on this rank) and output gradients (from RECV_B, or local).
  early post  -- before running a compute action, the receives listed after it (up to the next compute)
                 are posted, so the transfer overlaps the compute.
  loss scale  -- each microbatch's loss is multiplied by 1/m (and by the fp16 scaler's factor), so
                 the gradients are those of the replica batch's mean loss.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from autosplit.runtime.p2p import Transfer, post, tag
from autosplit.schedule import Action, ActionKind, build_schedule, lower

F, B = ActionKind.F, ActionKind.B


def forward_only(lists: dict[int, list[Action]]) -> dict[int, list[Action]]:
    """The forward half of a lowered schedule (for predict)."""
    keep = (ActionKind.F, ActionKind.SEND_F, ActionKind.RECV_F)
    return {r: [a for a in acts if a.kind in keep] for r, acts in lists.items()}


class PipelineExecutor:
    def __init__(self, world, plan, modules: list[torch.nn.Module], loss_fn: Callable, watchdog,
                 autocast_dtype: torch.dtype | None = None, on_last_backward: Callable | None = None):
        self.world, self.plan, self.loss_fn, self.watchdog = world, plan, loss_fn, watchdog
        pp, r = plan.mesh.pp, world.coord.pp
        self.pp, self.n_stages, self.m = pp, plan.n_stages, plan.num_microbatches
        self.modules = {c * pp + r: mod for c, mod in enumerate(modules)}
        lists = lower(build_schedule(plan.schedule, pp, self.m, plan.chunks_per_rank))
        self.train_actions = lists[r]
        self.predict_actions = forward_only(lower(build_schedule("gpipe", pp, self.m, plan.chunks_per_rank)))[r]
        self.last_b = {s: max(a.microbatch for a in self.train_actions if a.kind is B and a.stage == s)
                       for s in self.modules}
        self.autocast_dtype = autocast_dtype
        self.on_last_backward = on_last_backward or (lambda stage: None)
        self.nccl = world.backend == "nccl"

    # ---- one step ------------------------------------------------------------------------------
    def run(self, xs: list[tuple], ys: list | None, loss_scale: float = 1.0, train: bool = True):
        """Run the schedule; returns (sum of this rank's microbatch losses, last-stage outputs)."""
        self.xs, self.ys, self.loss_scale, self.train = xs, ys, loss_scale, train
        self.inbox_f: dict = {}
        self.inbox_b: dict = {}
        self.saved: dict = {}
        self.outbox: dict = {}
        self.sends: list[Transfer] = []
        self.losses: list[torch.Tensor] = []
        self.outputs: dict[int, torch.Tensor] = {}
        actions = self.train_actions if train else self.predict_actions
        i = 0
        while i < len(actions):
            a = actions[i]
            if a.kind.is_compute:
                self._post_receives(actions, i + 1)
                self._guarded(a, self._forward if a.kind is F else self._backward)
                i += 1
            else:
                j = i
                while j < len(actions) and not actions[j].kind.is_compute:
                    j += 1
                self._guarded(a, lambda _: self._communicate(actions[i:j]))
                i = j
        for t in self.sends:
            t.wait(self.watchdog)
        total = torch.stack(self.losses).sum() if self.losses else torch.zeros((), device=self.world.device)
        return total.detach(), [self.outputs[k] for k in sorted(self.outputs)]

    def _guarded(self, action: Action, fn) -> None:
        try:
            fn(action)
        except Exception as exc:
            raise self.watchdog.fail(str(action), exc) from exc

    # ---- communication -------------------------------------------------------------------------
    def _post_receives(self, actions: list[Action], start: int) -> None:
        end = start
        while end < len(actions) and not actions[end].kind.is_compute:
            end += 1
        self._communicate([a for a in actions[start:end] if a.kind.is_recv])

    def _communicate(self, actions: list[Action]) -> None:
        ops, pending = [], []
        for a in actions:
            box = self.inbox_f if a.kind is ActionKind.RECV_F else self.inbox_b
            if a.kind.is_recv and (a.stage, a.microbatch) in box:
                continue                                          # posted early
            peer = self.world.rank_at(pp=a.peer_stage % self.pp)
            direction = 0 if a.kind in (ActionKind.SEND_F, ActionKind.RECV_F) else 1
            receiver = a.peer_stage if a.kind.is_send else a.stage
            if a.kind.is_send:
                tensors = [t.contiguous() for t in self.outbox.pop((a.stage, a.microbatch, direction))]
            else:
                tensors = self._buffers(a)
            base = len(ops)
            for k, t in enumerate(tensors):
                ops.append(("send" if a.kind.is_send else "recv", t, peer,
                            tag(direction, receiver, a.microbatch, k, self.m)))
            pending.append((a, tensors, base, len(ops)))
        works = post(ops, self.nccl)
        for a, tensors, lo, hi in pending:
            transfer = Transfer(tensors, works[lo:hi] if works else [], str(a))
            if a.kind.is_send:
                self.sends.append(transfer)
            else:
                (self.inbox_f if a.kind is ActionKind.RECV_F else self.inbox_b)[(a.stage, a.microbatch)] = transfer

    def _buffers(self, a: Action) -> list[torch.Tensor]:
        infos = self.plan.stages[a.stage].inputs if a.kind is ActionKind.RECV_F else self.plan.stages[a.stage].outputs
        return [torch.empty(t.shape, dtype=getattr(torch, t.dtype), device=self.world.device) for t in infos]

    def _take(self, box: dict, key) -> list[torch.Tensor]:
        item = box.pop(key)
        return item.wait(self.watchdog) if isinstance(item, Transfer) else item

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
        outputs = [o.to(getattr(torch, t.dtype)) for o, t in zip(outputs, infos)]  # keep the planned dtype
        if self.train:
            self.saved[(s, i)] = (inputs, outputs)
        handoff = [o.detach() for o in outputs]
        if (s + 1) in self.modules:
            self.inbox_f[(s + 1, i)] = handoff
        else:
            self.outbox[(s, i, 0)] = handoff

    def _finish_forward(self, s: int, i: int, inputs, output: torch.Tensor) -> None:
        if not self.train:
            self.outputs[i] = output.detach()
            return
        with self._autocast():
            loss = self.loss_fn(output, self.ys[i])
        self.losses.append(loss.detach().float())
        self.saved[(s, i)] = (inputs, loss * self.loss_scale)

    def _backward(self, a: Action) -> None:
        s, i = a.stage, a.microbatch
        inputs, outputs = self.saved.pop((s, i))
        if i == self.last_b[s]:
            self.on_last_backward(s)
        if s == self.n_stages - 1:
            outputs.backward()
        else:
            grads = self._take(self.inbox_b, (s, i))
            pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if s == 0:
            return
        input_grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]
        if (s - 1) in self.modules:
            self.inbox_b[(s - 1, i)] = input_grads
        else:
            self.outbox[(s, i, 1)] = input_grads

    def _autocast(self):
        if self.autocast_dtype is None:
            return torch.autocast(self.world.device.type, enabled=False)
        return torch.autocast(self.world.device.type, dtype=self.autocast_dtype)
