"""Keep buffers identical across data-parallel replicas (DDP's ``broadcast_buffers``).

Terms:
  buffer  -- a non-parameter tensor of a stage module (BatchNorm's running_mean / running_var /
             num_batches_tracked, a position-index table ...).  A forward in training mode may update
             it from the replica's own rows, so replicas drift apart.
  source  -- dp rank 0 of this rank's data-parallel group: after every ``step`` (and every
             ``predict``), its buffers are broadcast to the other replicas, as DistributedDataParallel
             does (it broadcasts at the start of each forward; we do it at the end of the step, so
             ``full_state_dict`` is the same on every rank right after the step).

So a model's buffers equal those of single-device training that runs only replica 0's microbatches
through the forward (its parameters still follow the global batch).  We broadcast every buffer, not
only the changed ones: an in-place update inside a kernel (batch norm) does not bump the tensor's
version counter, so "changed" cannot be detected cheaply; buffers are few and small in these models,
and they go as one flat tensor per dtype (one broadcast each).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class BufferSync:
    def __init__(self, modules: list[torch.nn.Module], group, src: int, watchdog):
        """``src``: the global rank of dp rank 0 in ``group``.  Buffers are taken in each module's
        registration order, which is the same on every replica (same graph, same tp rank)."""
        self.modules, self.group, self.src, self.watchdog = modules, group, src, watchdog
        seen, self.buffers = set(), []
        for m in modules:
            for _, b in m.named_buffers():
                if id(b) not in seen:
                    seen.add(id(b))
                    self.buffers.append(b)

    def sync(self) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in self.buffers:
            by_dtype.setdefault(b.dtype, []).append(b)
        for dtype, bufs in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):   # same order everywhere
            flat = torch.cat([b.detach().reshape(-1) for b in bufs])
            work = dist.broadcast(flat, src=self.src, group=self.group, async_op=True)
            self.watchdog.wait(work, f"data-parallel broadcast of {len(bufs)} {dtype} buffers")
            offset = 0
            with torch.no_grad():
                for b in bufs:
                    b.copy_(flat[offset:offset + b.numel()].view_as(b))
                    offset += b.numel()
