"""Average gradients over the data-parallel axis in buckets, overlapped with the last backward.

Terms:
  bucket -- a group of this rank's parameters (about ``bucket_bytes``, in reverse registration order,
            roughly the order backward produces their gradients), reduced as one flat tensor.
  armed  -- a stage is armed just before its final backward of the step (its last microbatch; with a
            split backward, its last W, when every other gradient of the stage is already complete);
            from then on each parameter's post-accumulate-grad hook means "this gradient is final",
            and a bucket whose gradients are all final is all-reduced at once, asynchronously, while
            the rest of the backward runs.  Buckets with unused parameters are launched at ``finish``.
  no_sync -- gradient accumulation across several steps can skip the reduction until the last one.
  cp      -- with a context-parallel axis the group spans dp x cp ranks: each cp rank holds a part of
            most gradients (its tokens' share), whose sum over the group, divided by dp, is the average
            over dp; a parameter whose gradient is whole on every cp rank (``whole``: passes/sharding/
            lower.py *replicated axis*) is divided by cp too.
  views   -- as DDP's ``gradient_as_bucket_view``: each bucket owns one flat buffer for the whole run,
            and each parameter's ``.grad`` becomes a view of its slot, so the all-reduce and the
            average happen in place.  A gradient autograd created anew (the first backward after
            ``zero_grad(set_to_none=True)``) is copied into its slot once; with ``.grad`` already a
            view, backward accumulates straight into the bucket and nothing is copied at all.

We write the bucketing ourselves instead of wrapping stages in DistributedDataParallel: DDP's reducer
assumes one forward and one backward per iteration, while a pipeline runs m of each per step and only
the last backward of each stage may trigger the reduction.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        self.slots = [self.flat[a:b].view_as(p) for p, a, b in zip(params, offsets, offsets[1:])]
        self.ready: set[int] = set()
        self.had_grad: list[bool] = []
        self.work = None
        self.whole: list[torch.Tensor] = []      # slots divided by the cp size too (module docstring, cp)


class GradBuckets:
    def __init__(self, params_by_stage: dict[int, list[torch.nn.Parameter]], group, dp: int, watchdog,
                 bucket_bytes: int = 25 * 2**20, cp: int = 1, whole: set[int] = frozenset()):
        """``group``: the dp group (dp x cp with a cp axis); ``whole``: ids of the parameters divided by
        ``cp`` too (module docstring, *cp*)."""
        self.group, self.dp, self.watchdog, self.cp = group, dp, watchdog, cp
        self.enabled = True
        self.launched_early = 0
        self.armed: set[int] = set()
        self.buckets: list[_Bucket] = []
        self.where: dict[int, tuple[int, _Bucket]] = {}
        self._handles = []       # the hooks live on the user's parameters: removed by close()
        for stage, params in params_by_stage.items():
            for bucket in self._split([p for p in reversed(params) if p.requires_grad], bucket_bytes):
                self.buckets.append(bucket)
                bucket.whole = [s for p, s in zip(bucket.params, bucket.slots) if id(p) in whole] if cp > 1 else []
                for p in bucket.params:
                    self.where[id(p)] = (stage, bucket)
                    self._handles.append(p.register_post_accumulate_grad_hook(self._hook))

    def close(self) -> None:
        """Take the hooks off the parameters (they outlive this module: they are the user's model's)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @staticmethod
    def _split(params: list[torch.nn.Parameter], limit: int) -> list[_Bucket]:
        """Consecutive runs of about ``limit`` bytes, one dtype and device each (one flat buffer)."""
        buckets, current, size = [], [], 0
        for p in params:
            if current and (p.dtype, p.device) != (current[0].dtype, current[0].device):
                buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= limit:
                buckets.append(_Bucket(current))
                current, size = [], 0
        return buckets + ([_Bucket(current)] if current else [])

    def arm(self, stage: int, final=()) -> None:
        """From now on the stage's gradients are final as they arrive; ``final``: parameters whose
        gradients are already complete (a split backward's last W writes only the weights)."""
        if self.enabled:
            self.armed.add(stage)
            for p in final:
                if id(p) in self.where:
                    self._hook(p)

    def _hook(self, p: torch.nn.Parameter) -> None:
        stage, bucket = self.where[id(p)]
        if stage not in self.armed or bucket.work is not None:
            return
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.had_grad = [p.grad is not None for p in bucket.params]   # unused params keep grad None
        with torch.no_grad():
            for p, slot in zip(bucket.params, bucket.slots):
                if p.grad is None:
                    slot.zero_()
                elif p.grad.data_ptr() != slot.data_ptr():     # a fresh gradient: into its slot, once
                    slot.copy_(p.grad)
                    p.grad = slot
        bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    def finish(self) -> None:
        """Launch what is left, wait for every bucket, write the averages back into .grad."""
        if not self.enabled:
            return
        self.launched_early = sum(b.work is not None for b in self.buckets)   # overlapped with backward
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket)
        for bucket in self.buckets:
            with record_function("autosplit::dp all_reduce"):     # pm.trace_step's communication lane
                self.watchdog.wait(bucket.work, "data-parallel gradient all-reduce")
            bucket.flat.div_(self.dp)                   # the .grad views see the average
            for slot in bucket.whole:
                slot.div_(self.cp)
            bucket.work = None
            bucket.ready.clear()
        self.armed.clear()
