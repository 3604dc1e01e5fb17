"""Point-to-point transfers of stage boundaries between pipeline ranks.

Terms:
  boundary -- the tensors stage s sends to stage s+1 (activations, forward) or receives back from it
              (their gradients, backward), with shapes and dtypes known from the plan: no per-step
              shape handshake.
  tag      -- identifies one tensor of one boundary of one microbatch, so gloo can match transfers that
              are in flight at the same time; NCCL ignores tags and matches in posting order, which the
              schedule keeps consistent between the two ends.
  Transfer -- the Work handles of one boundary's tensors; ``wait`` goes through the Watchdog.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

MAX_TENSORS = 64   # tensors per boundary; tags reserve this many slots


def tag(direction: int, receiver_stage: int, microbatch: int, index: int, n_microbatches: int) -> int:
    """A unique tag: direction 0 = activation, 1 = gradient."""
    return ((direction * 4096 + receiver_stage) * n_microbatches + microbatch) * MAX_TENSORS + index


@dataclass
class Transfer:
    tensors: list[torch.Tensor]
    works: list
    what: str

    def wait(self, watchdog) -> list[torch.Tensor]:
        for w in self.works:
            watchdog.wait(w, self.what)
        return self.tensors


def post(ops: list[tuple[str, torch.Tensor, int, int]], nccl: bool) -> list:
    """Post ('send'|'recv', tensor, peer, tag) operations; NCCL ones as one batch so paired sends and
    receives between two ranks cannot block each other."""
    if not ops:
        return []
    if nccl:
        p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, tag=tg)
               for kind, t, peer, tg in ops]
        return dist.batch_isend_irecv(p2p)
    return [(dist.isend if kind == "send" else dist.irecv)(t, peer, tag=tg) for kind, t, peer, tg in ops]
