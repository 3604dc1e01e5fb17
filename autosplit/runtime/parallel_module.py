"""ParallelModule: what ``autosplit.parallelize`` returns; one rank's share of the training program.

Terms:
  replica batch -- the batch ``step`` receives: this data-parallel replica's rows of the global batch,
                   the same tensors on every rank of the replica.
  microbatch    -- replica batch / num_microbatches rows; the plan is built for its shape.
  local params  -- the parameters of the stages this rank runs (shared with the user's model object,
                   under the original names); ``parameters()`` yields only these.
Collaborators, one idea each: executor.py (the schedule), data_parallel.py (dp buckets),
loss_scaler.py, buffers.py, state_dict.py (full state dicts), checkpoint.py (sharded checkpoints),
call_gate.py / agreement.py (ranks agree), faults.py (bounded waits), params.py (parameter order,
adoption, and materializing a meta model's local shards).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from autosplit.compiler import compile as compile_plan
from autosplit.errors import AutosplitError
from autosplit.inputs import default_input_shape
from autosplit.passes.split_backward import split_weight_gemms
from autosplit.meta_init import Initializer, meta_names
from autosplit.passes.tp_random import fork_sharded_random
from autosplit.runtime.agreement import check_agreement
from autosplit.runtime.buffers import BufferSync
from autosplit.runtime.call_checks import check_call, state_dict_problem
from autosplit.runtime.call_gate import CallGate
from autosplit.runtime.checkpointing import checkpointed
from autosplit.runtime.data_parallel import GradBuckets
from autosplit.runtime.executor import PipelineExecutor
from autosplit.runtime.faults import Watchdog
from autosplit.runtime.gradients import clip_grad_norm, global_mean, reduce_partial_grads
from autosplit.runtime.fsdp import StageSharding
from autosplit.runtime.loss_check import checked_loss, loss_fn_problem
from autosplit.runtime.loss_scaler import LossScaler
from autosplit.runtime.checkpoint import load_checkpoint, save_checkpoint
from autosplit.runtime.params import adopt_parameters, graph_order_params, materialize_local
from autosplit.runtime.profile import agreed_profile
from autosplit.runtime.state_dict import gather_full_state_dict, load_into
from autosplit.runtime.world import World
from autosplit.schedule import SPLIT_BACKWARD
from autosplit.runtime import tp_collectives
from autosplit.runtime import tp2d_collectives  # noqa: F401  (registers linear_2d / sum_stats)
from autosplit.runtime.tp_collectives import bind_axis_groups

log = logging.getLogger("autosplit")      # the library logs; it never prints


class ParallelModule:
    def __init__(self, model: torch.nn.Module, world: World, loss_fn: Callable, num_microbatches: int,
                 schedule: str, chunks_per_rank: int, tp_mode: str, example_input=None, *,
                 autocast: torch.dtype | None = None, checkpoint: str | None = None,
                 bucket_bytes: int = 25 * 2**20, compile_options: dict | None = None, seed: int = 0,
                 init_fn: Callable | None = None):
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise AutosplitError(f"num_microbatches={num_microbatches!r} must be a positive integer")
        if checkpoint not in (None, "stage", "block"):
            raise AutosplitError(f"checkpoint={checkpoint!r}: expected None, 'stage' or 'block'")
        if autocast not in (None, torch.bfloat16, torch.float16):
            raise AutosplitError(f"autocast={autocast!r}: expected None, torch.bfloat16 or torch.float16")
        problem = loss_fn_problem(loss_fn)
        if problem:
            raise AutosplitError(problem)
        self.model, self.world, self.loss_fn = model, world, loss_fn
        self.num_microbatches, self.schedule, self.chunks_per_rank = num_microbatches, schedule, chunks_per_rank
        self.tp_mode, self.autocast, self.checkpoint = tp_mode, autocast, checkpoint
        self.bucket_bytes, self.compile_options = bucket_bytes, compile_options or {}
        self.watchdog = Watchdog(world.store, world.rank, world.mesh, world.timeout_s, world.backend)
        self.scaler = LossScaler(enabled=autocast is torch.float16)
        self.gate = CallGate(world, self.watchdog)
        # a meta model: each rank initializes only its own shards (autosplit/meta_init.py)
        self.initializer = Initializer(model, seed, init_fn) if meta_names(model) else None
        # the plan all ranks agreed on; model checked (a meta model is never whole on a rank, and its
        # values are a function of (seed, name): nothing to compare)
        self._agreed, self._params_agreed = None, self.initializer is not None
        self.step_count = 0                 # completed steps (checkpoint metadata)
        self.plan, self.buckets, self.provisional = None, None, False
        self.sharding: StageSharding | None = None
        self.partial_params: list = []
        self.raw_modules: list = []
        self._buffer_sync: BufferSync | None = None
        self.profile = None
        if example_input is not None:
            self._build(example_input)

    # ---- coordinates ---------------------------------------------------------------------------
    pp_rank = property(lambda self: self.world.coord.pp)
    tp_rank = property(lambda self: self.world.coord.tp)
    dp_rank = property(lambda self: self.world.coord.dp)
    dp_size = property(lambda self: self.world.mesh.dp)

    # ---- planning ------------------------------------------------------------------------------
    def _build(self, microbatch, bounds=None) -> None:
        example = tuple(microbatch) if isinstance(microbatch, (tuple, list)) else (microbatch,)
        example = tuple(torch.empty_like(x, device="meta") for x in example)
        mesh = (self.world.mesh.pp, self.world.mesh.tp, self.world.mesh.dp)
        options = dict(self.compile_options)
        bounds = bounds if bounds is not None else options.pop("stage_bounds", None)
        options.pop("stage_bounds", None)
        if "device" not in options:             # measured (CPU) once, then reused for re-planning
            self.profile = self.profile or agreed_profile(self.world, self.watchdog)
            options["device"] = self.profile
        self.plan = compile_plan(self.model, mesh=mesh, example_input=example, tp_mode=self.tp_mode,
                                 schedule=self.schedule, chunks_per_rank=self.chunks_per_rank,
                                 num_microbatches=self.num_microbatches, stage_bounds=bounds,
                                 autocast=self.autocast, checkpoint=self.checkpoint, **options)
        self.provisional = False
        if self.world.rank == 0:
            log.info("planned:\n%s", self.plan.summary())
        modules = self.plan.stage_modules(self.pp_rank, self.tp_rank)
        if self.raw_modules and not self.plan.dp_shard:   # a re-plan keeps the tensors (the Parameter
            for old, new in zip(self.raw_modules, modules):   # objects the optimizer was given, loaded buffers)
                adopt_parameters(old, new)
        if self.initializer is not None:      # a meta model: this rank's shards (all on the first build)
            materialize_local(modules, self.initializer, self._sharded(), self.tp_rank, self.world.device)
        modules = [m.to(self.world.device) for m in modules]
        modules = [fork_sharded_random(m) for m in modules] if self.world.mesh.tp > 1 else modules
        # I / W schedules defer weight gradients to W; under tp, B overlaps them with the backward
        # all-reduce / reduce-scatter of the entries' input gradients (runtime/tp_collectives.py).
        # Not under dp_shard: FSDP2 reduce-scatters a module's gradients when its backward ends.
        overlap = self.world.mesh.tp > 1 and tp_collectives.OVERLAP_BACKWARD and not self.plan.dp_shard
        if self.schedule in SPLIT_BACKWARD or overlap:
            modules = [split_weight_gemms(m)[0] for m in modules]
        stages = self.plan.placement.stages(self.pp_rank)
        partial = self.plan.tp_plan.partial_grads if self.plan.tp_plan is not None else set()
        if self.plan.dp_shard:          # FSDP2 units over dp (runtime/fsdp.py); its grads replace the buckets
            self.sharding = self.sharding or StageSharding(self.world, self.model, self.plan.dp_shard,
                                                           self.checkpoint, self.autocast)
            self.raw_modules, self.modules = self.sharding.stages(modules, stages, partial)
            self.buckets = self.sharding.grads
        else:
            self.raw_modules = modules
            self.modules = [checkpointed(m, self.model, self.checkpoint) for m in self.raw_modules]
        axes = ("tp", "tp_row", "tp_col") if self.world.grid_mesh is not None else ("tp",)
        bind_axis_groups({a: self.world.group(a) for a in axes}, self.watchdog)
        # in graph order: every rank of a group flattens the same parameters in the same order
        self.partial_params = [p for m in self.raw_modules for n, p in graph_order_params(m) if n in partial]
        if self.buckets is None and self.dp_size > 1:   # parameters never change owner, so build once
            # partial-grad params are reduced over dp by _reduce_partial_grads, after their tp sum
            partial_ids = {id(p) for p in self.partial_params}
            self.buckets = GradBuckets({s: [p for _, p in graph_order_params(m) if id(p) not in partial_ids]
                                        for s, m in zip(stages, self.raw_modules)},
                                       self.world.group("dp"), self.dp_size, self.watchdog, self.bucket_bytes)
        self.executor = PipelineExecutor(self.world, self.plan, self.modules, checked_loss(self.loss_fn), self.watchdog,
                                         self.autocast, self.buckets.arm if self.buckets else None)

    def _require_plan(self, what: str) -> None:
        """Plan now if no microbatch was seen yet: from the model's own input size, batch of 1.

        The first step re-plans for its real microbatch keeping the same cut (``stage_bounds``), so
        the parameters an optimizer was given stay the ones this rank trains.
        """
        if self.plan is None:
            shape = default_input_shape(self.model)
            self._build(torch.empty(1, *shape, device="meta"))
            self.provisional = True

    def parameters(self):
        """This rank's parameters (its stages' shards), for the optimizer."""
        for _, p in self.named_parameters():
            yield p

    def named_parameters(self):
        """This rank's parameters under the original model's names."""
        self._require_plan("named_parameters()")
        for m in self.raw_modules:
            yield from m.named_parameters()

    def train(self, mode: bool = True) -> "ParallelModule":
        """Training mode (dropout on) for this rank's stage modules, like ``nn.Module.train``; the
        user's model object may no longer hold this rank's modules (tensor-parallel shards)."""
        self._require_plan("train()")
        for m in self.raw_modules:
            m.train(mode)
        return self

    def eval(self) -> "ParallelModule":
        return self.train(False)

    # ---- training ------------------------------------------------------------------------------
    def _microbatches(self, tensors: tuple, what: str) -> list[tuple]:
        batch = tensors[0].shape[0]
        m = self.num_microbatches
        if batch % m:
            raise AutosplitError(f"{what}: batch of {batch} rows is not divisible by num_microbatches({m}); "
                                 f"use a batch that is a multiple of {m}")
        parts = [t.to(self.world.device).chunk(m) for t in tensors]
        return list(zip(*parts))

    def _plan_for(self, mb: tuple) -> None:
        try:
            if self.plan is None:
                self._build(mb)
            elif self.provisional and [tuple(x.shape) for x in mb] != [tuple(s) for s in self.plan.example_shapes]:
                self._build(mb, bounds=self.plan.bounds)
        except AutosplitError as exc:   # tell every rank (they wait in the agreement), then fail here too
            self._agree(error=str(exc))
            raise
        self.provisional = False
        self._check_shapes(mb)
        self._agree()

    def _check_shapes(self, mb: tuple) -> None:
        got = [(tuple(x.shape), str(x.dtype).removeprefix("torch.")) for x in mb]
        want = list(zip(map(tuple, self.plan.example_shapes), self.plan.example_dtypes))
        if got != want:
            raise AutosplitError(f"step inputs give microbatches of (shape, dtype) {got}, but the plan was built "
                                 f"for {want}; keep the batch size, image size and dtype of the first step")

    def step(self, images, labels) -> float:
        """Forward and backward of every microbatch; gradients averaged over dp; returns the mean loss."""
        self._enter("step", images, labels)
        inputs = tuple(images) if isinstance(images, (tuple, list)) else (images,)
        xs = self._microbatches(inputs, "step")
        ys = [y[0] for y in self._microbatches((labels,), "step labels")]
        self._plan_for(xs[0])
        self.watchdog.check()
        scale = self.scaler.scale / self.num_microbatches
        earlier = [p.grad for p in self.partial_params]       # already reduced by earlier steps
        for p in self.partial_params:
            p.grad = None
        loss_sum, _ = self.executor.run(xs, ys, loss_scale=scale, train=True)
        if self.buckets is not None:
            self.buckets.finish()
        self._reduce_partial_grads(earlier)
        self._sync_buffers()
        params = list(self.parameters()) if self.scaler.enabled else []
        overflow = self.scaler.unscale(params, self.world.device) if self.scaler.enabled else None
        loss, overflow_anywhere = self._global_mean(loss_sum, overflow)
        if self.scaler.enabled:
            self.scaler.update(overflow_anywhere, params)
        self.step_count += 1
        return loss

    def _reduce_partial_grads(self, earlier: list) -> None:
        reduce_partial_grads(self.partial_params, earlier, self.world, self.watchdog, self._dp_sync())

    def _sync_buffers(self) -> None:
        """Buffers a forward updated (BatchNorm statistics) become dp rank 0's on every replica
        (runtime/buffers.py), so replicas never drift and ``full_state_dict`` agrees everywhere."""
        if self.dp_size == 1:
            return
        if self._buffer_sync is None or self._buffer_sync.modules is not self.raw_modules:
            self._buffer_sync = BufferSync(self.raw_modules, self.world.group("dp"), self.world.rank_at(dp=0),
                                           self.watchdog)
        self._buffer_sync.sync()

    def _dp_sync(self) -> bool:
        """Does this step average gradients over dp (dp > 1 and not inside ``no_sync``)?"""
        return self.buckets is not None and self.buckets.enabled

    def _global_mean(self, loss_sum: torch.Tensor, overflow: torch.Tensor | None = None) -> tuple[float, bool]:
        return global_mean(loss_sum, overflow, self.num_microbatches, self.world, self.watchdog)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients over several ``step`` calls without the dp all-reduce."""
        previous = self.buckets.enabled if self.buckets else None
        if self.buckets:
            self.buckets.enabled = False
        try:
            yield
        finally:
            if self.buckets:
                self.buckets.enabled = previous

    def _sharded(self) -> dict:
        return self.plan.tp_plan.sharded if self.plan.tp_plan is not None else {}

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip every gradient by the global norm over pp, tp and dp, each parameter counted once.

        Args:
            max_norm: the largest norm the gradients may have; larger ones are scaled down to it.
        Returns the norm before clipping (a float, the same on every rank).
        """
        self._enter("clip_grad_norm_", max_norm)
        return clip_grad_norm(list(self.named_parameters()), self._sharded(), max_norm, self.world,
                              self.watchdog, dp_sharded=self.sharding is not None)

    # ---- inference -----------------------------------------------------------------------------
    def predict(self, images) -> torch.Tensor:
        """Forward only; the replica's full output on every rank of the replica."""
        self._enter("predict", images)
        inputs = tuple(images) if isinstance(images, (tuple, list)) else (images,)
        xs = self._microbatches(inputs, "predict")
        self._plan_for(xs[0])
        _, outs = self.executor.run(xs, None, train=False)
        if self.sharding:
            self.sharding.reshard()          # forward only: free the parameters kept for a backward
        self._sync_buffers()                  # a forward in training mode may update BatchNorm statistics
        last = self.world.rank_at(pp=self.plan.placement.rank(self.plan.n_stages - 1))
        info = self.plan.stages[-1].outputs[0]
        result = torch.cat(outs) if outs else torch.empty(
            (info.shape[0] * self.num_microbatches, *info.shape[1:]), dtype=getattr(torch, info.dtype),
            device=self.world.device)
        work = dist.broadcast(result, src=last, group=self.world.group("pp"), async_op=True)
        self.watchdog.wait(work, "predict broadcast", host=True)
        return result

    # ---- checkpoints (runtime/state_dict.py) ---------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's state dict (full shapes, CPU tensors), identical on every rank: it gathers
        EVERY tensor onto every rank, so it is for models that fit one process; bigger ones use
        ``save_checkpoint`` (each rank writes its own shards) and ``python -m autosplit export``."""
        self._enter("full_state_dict")       # before planning: a lazy plan may communicate
        self._require_plan("full_state_dict()")
        self._agree()
        return gather_full_state_dict(self.model, self.plan, self.raw_modules, self.world, self.watchdog)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the original model's state dict (full shapes) on every rank; then every rank checks
        that all ranks loaded the same values."""
        self._enter("load_full_state_dict", state_dict)
        problem = state_dict_problem(state_dict, self.model.state_dict())
        if problem:                          # unreachable after the gate; kept for direct callers
            raise AutosplitError(problem)
        load_into(self.model, state_dict, self.plan, self.raw_modules, self.tp_rank)
        # the whole model was just replaced: compare it again (a meta model is not whole on any rank)
        self._params_agreed = self.initializer is not None
        self._agree()

    def save_checkpoint(self, directory, optimizer=None) -> str:
        """Write a sharded checkpoint (torch.distributed.checkpoint): each rank writes only its shards,
        under the original names and full shapes, plus ``optimizer``'s state; atomic (runtime/checkpoint.py).
        Returns the directory of the committed version."""
        return save_checkpoint(self, directory, optimizer)

    def load_checkpoint(self, directory, optimizer=None) -> dict:
        """Load the latest complete checkpoint in ``directory``, saved on any mesh: each rank reads only
        the chunks it holds; ``optimizer``'s state too.  Returns its metadata (step, mesh, ...)."""
        return load_checkpoint(self, directory, optimizer)

    # ---- agreement between ranks (runtime/call_gate.py, runtime/agreement.py) --------------------
    def _enter(self, call: str, *args) -> None:
        """First thing in every entry point that communicates: check this rank's arguments, then make
        sure every rank entered the same call with the same shapes; raise the same error everywhere
        otherwise.  The plan agreement comes after planning (``_plan_for``, ``full_state_dict``)."""
        plan = None if self.plan is None or self.provisional else self.plan
        text, key, error = check_call(call, args, num_microbatches=self.num_microbatches, plan=plan,
                                      model=self.model)
        self.gate.enter(call, text, key, error)

    def _agree(self, error: str | None = None) -> None:
        """Once per plan (and after a load): all ranks planned the same job and hold the same model.
        The model is compared only while it is whole on every rank (before the first step, after a load)."""
        if error is None and self._agreed is self.plan and self._params_agreed:
            return
        check_agreement(self.world, self.watchdog, self.plan, self.model, not self._params_agreed, error)
        self._agreed, self._params_agreed = self.plan, True

    # ---- measurement (runtime/trace_step.py) ------------------------------------------------------
    def trace_step(self, images, labels, path):
        """One training step under torch.profiler on every rank; rank 0 writes the merged Chrome trace
        to ``path``.  Returns a ``StepTrace`` (measured vs predicted per stage, action kind and step).

        Args:
            images: this replica's batch, as for ``step``.
            labels: its labels.
            path: the Chrome-trace JSON file rank 0 writes (None: no file).
        """
        from autosplit.runtime.trace_step import trace_step
        return trace_step(self, images, labels, path)
