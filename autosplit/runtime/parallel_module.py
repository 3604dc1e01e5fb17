"""ParallelModule: what ``autosplit.parallelize`` returns; one rank's share of the training program.

Terms:
  replica batch -- the batch ``step`` receives: this data-parallel replica's rows of the global batch,
                   the same tensors on every rank of the replica.
  microbatch    -- replica batch / num_microbatches rows; the plan is built for its shape.
  local params  -- the parameters of the stages this rank runs (shared with the user's model object,
                   under the original names); ``parameters()`` yields only these.
The module runs calls; each idea lives in its own file: rank_plan.py (planning and re-planning, this
rank's modules, buckets and executor), gradients.py (partial-gradient reduction, clipping, the loss
scaler's calls, the mean loss), model_state.py / state_dict.py (full state dicts), checkpoint.py
(sharded checkpoints), call_gate.py / agreement.py (ranks agree), faults/deadlines.py (bounded waits),
executor.py (the schedule), loss_scaler.py, buffers.py, params.py.
  owned         -- what a module holds that outlives it unless released: the world's process groups
                   (torch keeps every group in its registries until destroyed: their connections and,
                   on gloo, three threads each, which wake even when idle), the checkpoint group, the
                   watchdog's and executor's threads, and the gradient buckets' hooks on the user's
                   parameters (which would keep firing in a later backward of the same model).
  orphan        -- the owned part of a module that was garbage-collected without ``close()`` (a dropped
                   module, or one whose construction raised): ``release_orphans()`` releases it at the next
                   ``parallelize`` in the process, a point every rank reaches in the same order, in build
                   order.  Not at collection time: a finalizer runs wherever the collector happens to run,
                   possibly inside torch.distributed's own bookkeeping of another group.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from autosplit.errors import AutosplitError
from autosplit.meta_init import Initializer, meta_names
from autosplit.options import PlanOptions
from autosplit.runtime.faults.agreement import check_agreement
from autosplit.runtime.faults.call_checks import check_call
from autosplit.runtime.faults.call_gate import CallGate
from autosplit.runtime.faults.deadlines import RankFailure, Watchdog
from autosplit.runtime.faults.loss_check import loss_fn_problem
from autosplit.runtime.parallel.gradients import begin_step, clip_grad_norm, finish_step
from autosplit.runtime.parallel.world import World
from autosplit.runtime.pipeline.compiled_stages import compile_seconds
from autosplit.runtime.rank_plan import RankPlanner
from autosplit.runtime.state import model_state
from autosplit.runtime.state.checkpoint import load_checkpoint, save_checkpoint
from autosplit.runtime.state.loss_scaler import LossScaler

log = logging.getLogger("autosplit")


_OPEN: "weakref.WeakSet[ParallelModule]" = weakref.WeakSet()    # built and not closed, in this process
_BUILT = itertools.count()
_ORPHANS: list["_Owned"] = []          # see *orphan*
_log = logging.getLogger("autosplit")


class _Owned:
    """See *owned*; filled in as ``ParallelModule.__init__`` creates each part."""

    def __init__(self, world: World, serial: int):
        self.world, self.serial = world, serial
        self.watchdog = self.planner = self.dcp_group = None

    def release(self) -> None:
        if self.planner is not None:
            self.planner.close()
        if self.watchdog is not None:
            self.watchdog.close()
        if self.dcp_group is not None:                      # runtime/state/checkpoint.py's
            dist.destroy_process_group(self.dcp_group)
        self.world.close()
        self.planner = self.watchdog = self.dcp_group = None


def release_orphans() -> int:
    """Release what ParallelModules collected without ``close()`` held (see *orphan*); the number released.
    ``parallelize`` calls it before it builds; a process that drops modules without building new ones can
    call it at a point where every rank is done with them."""
    gc.collect()                       # modules in reference cycles: their finalizers run now
    orphans = sorted(_ORPHANS, key=lambda o: o.serial)
    _ORPHANS.clear()
    for owned in orphans:
        _log.debug("releasing the groups of ParallelModule #%d, dropped without close()", owned.serial)
        owned.release()
    return len(orphans)


def open_modules() -> list["ParallelModule"]:
    """This process's ParallelModules that are not closed, oldest first (the order is the same on
    every rank that built the same modules)."""
    return sorted(_OPEN, key=lambda pm: pm._serial)


def _planner_attr(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.planner, name), doc=doc)


class ParallelModule:
    """One rank's share of a (pp, tp, dp) training program; built by ``autosplit.parallelize``.

    Args:
        model: the user's model (every rank builds it identically; it may live on the meta device).
        world: the initialized World (runtime/parallel/world.py).
        loss_fn: ``loss_fn(logits, labels)``, a scalar mean over the microbatch.
        options: the PlanOptions (``options.num_microbatches`` an int; ``options.device`` None: the
            agreed profile of this machine).
        example_input: one microbatch to plan for now, or None (planned at the first call).
        bucket_bytes: size of a data-parallel gradient bucket.
        seed, init_fn: how a meta model's shards are initialized (autosplit/meta_init.py).
        compile_settings: ``torch.compile`` arguments for every stage module (runtime/pipeline/compiled_stages.py),
            or None: eager stages.
    """

    def __init__(self, model: torch.nn.Module, world: World, loss_fn: Callable, options: PlanOptions,
                 example_input=None, *, bucket_bytes: int = 25 * 2**20, seed: int = 0,
                 init_fn: Callable | None = None, compile_settings: dict | None = None):
        self._closed, self._serial = False, next(_BUILT)
        # first: whatever raises below, the world's groups are released (as an orphan) once this goes
        self._owned = _Owned(world, self._serial)
        self._orphaned = weakref.finalize(self, _ORPHANS.append, self._owned)
        options.check(world.mesh)
        problem = loss_fn_problem(loss_fn)
        if problem:
            raise AutosplitError(problem)
        self.model, self.world, self.options = model, world, options
        self.watchdog = Watchdog(world.store, world.rank, world.mesh, world.timeout_s, world.backend,
                                 groups=world.own_groups)
        self.scaler = LossScaler(enabled=options.autocast is torch.float16)
        self.gate = CallGate(world, self.watchdog)
        # a meta model: each rank initializes only its own shards (autosplit/meta_init.py)
        self.initializer = Initializer(model, seed, init_fn) if meta_names(model) else None
        self.planner = RankPlanner(model, world, self.watchdog, options, loss_fn, bucket_bytes, self.initializer,
                                   compile_settings)
        self.compile_seconds = 0.0          # torch.compile's time for this module's stages on this rank
        self._owned.watchdog, self._owned.planner = self.watchdog, self.planner
        # the plan all ranks agreed on; model checked (a meta model is never whole on a rank, and its
        # values are a function of (seed, name): nothing to compare)
        self._agreed, self._params_agreed = None, self.initializer is not None
        self.step_count = 0                 # completed steps (checkpoint metadata)
        _OPEN.add(self)
        if example_input is not None:
            self.planner.build(example_input)

    # ---- coordinates and the plan --------------------------------------------------------------
    pp_rank = property(lambda self: self.world.coord.pp, doc="this rank's pipeline coordinate")
    tp_rank = property(lambda self: self.world.mesh.tp_of(self.world.coord.tp),
                       doc="this rank's tensor-parallel coordinate")
    tp_size = property(lambda self: self.world.mesh.tp, doc="the number of tensor-parallel ranks")
    cp_rank = property(lambda self: self.world.mesh.cp_of(self.world.coord.tp),
                       doc="this rank's context-parallel coordinate (its share of the tokens)")
    cp_size = property(lambda self: self.world.mesh.cp, doc="the number of context-parallel ranks")
    block_rank = property(lambda self: self.world.coord.tp,
                          doc="this rank's position in its cp x tp block (autosplit/mesh.py): the plan's tp rank")
    dp_rank = property(lambda self: self.world.coord.dp, doc="this rank's data-parallel replica")
    dp_size = property(lambda self: self.world.mesh.dp, doc="the number of data-parallel replicas")
    num_microbatches = property(lambda self: self.options.num_microbatches)
    schedule = property(lambda self: self.options.schedule)
    chunks_per_rank = property(lambda self: self.options.chunks_per_rank)
    tp_mode = property(lambda self: self.options.tp_mode)
    plan = _planner_attr("plan", "the Plan this rank runs (None before the first plan)")
    profile = _planner_attr("profile", "the cost profile measured here (None when options.device was given)")
    raw_modules = _planner_attr("raw_modules", "this rank's stage GraphModules (runtime/rank_plan.py)")
    executor = _planner_attr("executor", "the PipelineExecutor of the current plan")
    buckets = _planner_attr("buckets", "the dp gradient buckets (or FSDP2's), None at dp = 1")

    @property
    def loss_fn(self) -> Callable:
        return self.planner.loss_fn

    @loss_fn.setter
    def loss_fn(self, fn: Callable) -> None:
        self.planner.loss_fn = fn

    def _sharded(self) -> dict:
        return self.planner.sharded()

    def _require_plan(self, what: str) -> None:
        self._require_open(what)
        self.planner.require()

    def _require_open(self, what: str) -> None:
        if self._closed:
            raise AutosplitError(f"{what} on a closed ParallelModule ({self.watchdog.where}): close() "
                                 f"released its process groups; build a new one with autosplit.parallelize")

    # ---- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Release this module's process groups and threads; every rank calls it, and nothing else
        on the module works afterwards.  A process that builds several ParallelModules (re-planning
        with other options, evaluation copies) would otherwise keep every one's groups (and their
        connections and threads) until it exits.  ``with autosplit.parallelize(...) as pm:`` closes
        on leaving the block.  After a failed step (a RankFailure) the ranks do not meet first."""
        if self._closed:
            return
        try:
            self.watchdog.check("close")
            # Every rank must be done with the groups before any rank destroys them: an operation a
            # peer still has in flight on a destroyed gloo group fails, and on NCCL it can hang.
            self.world.barrier(self.watchdog, "close")
        except RankFailure:          # the job has failed already and said so: release without meeting
            pass
        finally:
            self.release()

    def release(self) -> None:
        """``close`` without meeting the other ranks: for a caller that knows every rank is done with
        this module's groups (e.g. each has returned from a call that waits for the others)."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        self._orphaned.detach()
        self._owned.release()

    def __enter__(self) -> "ParallelModule":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
        """Training mode (dropout on) for this rank's stage modules, like ``nn.Module.train``.

        Args:
            mode: True for training, False for evaluation.  The user's model object may no longer
                hold this rank's modules (tensor-parallel shards), so set the mode here.
        """
        self._require_plan("train()")
        for m in self.raw_modules:
            m.train(mode)
        return self

    def eval(self) -> "ParallelModule":
        """Evaluation mode: ``train(False)``."""
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

    def step(self, images, labels) -> float:
        """Forward and backward of every microbatch; gradients averaged over dp.

        Args:
            images: this replica's batch (a tensor, or a tuple of tensors for a multi-input model),
                the same on every rank of the replica; its rows divide by num_microbatches.
            labels: the batch's targets for ``loss_fn``.
        Returns the global batch's mean loss (a float, the same on every rank).
        """
        self._enter("step", images, labels)
        inputs = tuple(images) if isinstance(images, (tuple, list)) else (images,)
        xs = self._microbatches(inputs, "step")
        ys = [y[0] for y in self._microbatches((labels,), "step labels")]
        self.planner.plan_for(xs[0], self._agree)
        self.watchdog.check()
        compiled_before = compile_seconds()
        earlier = begin_step(self.planner.partial_params)
        loss_sum, _ = self.executor.run(xs, ys, loss_scale=self.scaler.scale / self.num_microbatches, train=True)
        # inside a guarded section like the schedule's actions: an error here (a reduction that
        # raises, the user's buffers) must reach the peers waiting in these collectives (deadlines.py)
        with self.watchdog.guarded("step end"):
            loss = finish_step(self.planner, self.scaler, loss_sum, earlier, self.num_microbatches)
        self.step_count += 1
        self._report_compile(compiled_before)
        return loss

    def _report_compile(self, before: float) -> None:
        """One log line per rank when its stages compiled (the first step, a new shape or grad mode).
        ``before``: the process's compile seconds when this step began (torch's timers are per
        process; steps of two modules never interleave, so the growth is this module's)."""
        if self.planner.compile_settings is None:
            return
        took = compile_seconds() - before
        if took > 0:
            self.compile_seconds += took
            log.info("rank %d: torch.compile of its stages took %.1f s (%.1f s in all so far)", self.world.rank,
                     took, self.compile_seconds)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients over several ``step`` calls without the dp all-reduce."""
        buckets = self.buckets
        previous = buckets.enabled if buckets else None
        if buckets:
            buckets.enabled = False
        try:
            yield
        finally:
            if buckets:
                buckets.enabled = previous

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip every gradient by the global norm over pp, tp and dp, each parameter counted once.

        Args:
            max_norm: the largest norm the gradients may have; larger ones are scaled down to it.
        Returns the norm before clipping (a float, the same on every rank).
        """
        self._enter("clip_grad_norm_", max_norm)
        return clip_grad_norm(list(self.named_parameters()), self._sharded(), max_norm, self.world,
                              self.watchdog, dp_sharded=self.planner.sharding is not None)

    # ---- inference -----------------------------------------------------------------------------
    def predict(self, images) -> torch.Tensor:
        """Forward only.

        Args:
            images: this replica's batch, as for ``step``.
        Returns the replica's full output, on every rank of the replica.
        """
        self._enter("predict", images)
        inputs = tuple(images) if isinstance(images, (tuple, list)) else (images,)
        xs = self._microbatches(inputs, "predict")
        self.planner.plan_for(xs[0], self._agree)
        compiled_before = compile_seconds()
        _, outs = self.executor.run(xs, None, train=False)
        self._report_compile(compiled_before)
        if self.planner.sharding:
            self.planner.sharding.reshard()   # forward only: free the parameters kept for a backward
        self.planner.sync_buffers()           # a forward in training mode may update BatchNorm statistics
        last = self.world.rank_at(pp=self.plan.placement.rank(self.plan.n_stages - 1))
        info = self.plan.stages[-1].outputs[0]
        result = torch.cat(outs) if outs else torch.empty(
            (info.shape[0] * self.num_microbatches, *info.shape[1:]), dtype=getattr(torch, info.dtype),
            device=self.world.device)
        work = dist.broadcast(result, src=last, group=self.world.group("pp"), async_op=True)
        self.watchdog.wait(work, "predict broadcast", host=True)
        return result

    # ---- state (runtime/state/model_state.py, runtime/state/checkpoint.py) ---------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's state dict (full shapes, CPU tensors), identical on every rank.

        It gathers EVERY tensor onto every rank, so it is for models that fit one process; bigger ones
        use ``save_checkpoint`` (each rank writes its own shards) and ``python -m autosplit export``.
        """
        return model_state.full_state_dict(self)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the original model's state dict on every rank; then all ranks check they hold the same.

        Args:
            state_dict: ``model.state_dict()``'s keys with full shapes (e.g. ``full_state_dict()``'s).
        """
        model_state.load_full_state_dict(self, state_dict)

    def save_checkpoint(self, directory, optimizer=None, extra=None) -> str:
        """Write a sharded checkpoint (torch.distributed.checkpoint), atomically: everything an exact
        resume needs (runtime/state/checkpoint.py).

        Args:
            directory: where versions are kept; each rank writes only its shards, under the original
                names and full shapes.
            optimizer: also save its state (any torch optimizer over ``parameters()``), in torch's
                layout by parameter name, or None.
            extra: ``{"name": stateful}``, any ``torch.distributed.checkpoint.stateful.Stateful`` (an LR
                scheduler, a stateful data loader), saved under its name; None for none.
        The fp16 loss scale and every rank's random state are always saved.
        Returns the directory of the committed version.
        """
        return save_checkpoint(self, directory, optimizer, extra)

    def load_checkpoint(self, directory, optimizer=None, extra=None, missing_ok: bool = False) -> dict | None:
        """Load the latest complete checkpoint in ``directory``, saved on any mesh.

        Args:
            directory: the directory given to ``save_checkpoint``; each rank reads only its chunks.
            optimizer: also load its state, or None.
            extra: ``{"name": stateful}`` to restore with ``load_state_dict``, by the names they were saved
                under (a subset is fine).
            missing_ok: when ``directory`` holds no committed checkpoint yet, return None (on every rank)
                instead of raising: resume if present, else start afresh.
        Returns the checkpoint's metadata (step, mesh, ...).  The loss scale and random states are
        restored too: exactly per rank on the same mesh; on another mesh every rank takes rank 0's.
        """
        return load_checkpoint(self, directory, optimizer, extra, missing_ok)

    # ---- agreement between ranks (runtime/faults/call_gate.py, runtime/faults/agreement.py) --------------------
    def _enter(self, call: str, *args) -> None:
        """First thing in every entry point that communicates: check this rank's arguments, then make
        sure every rank entered the same call with the same shapes; raise the same error everywhere
        otherwise.  The plan agreement comes after planning (``plan_for``, ``full_state_dict``)."""
        self._require_open(f"{call}()")
        plan = None if self.plan is None or self.planner.provisional else self.plan
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

    # ---- measurement (runtime/pipeline/trace_step.py) ------------------------------------------------------
    def trace_step(self, images, labels, path):
        """One training step under torch.profiler on every rank; rank 0 writes the merged Chrome trace
        to ``path``.  Returns a ``StepTrace`` (measured vs predicted per stage, action kind and step).

        Args:
            images: this replica's batch, as for ``step``.
            labels: its labels.
            path: the Chrome-trace JSON file rank 0 writes (None: no file).
        """
        from autosplit.runtime.pipeline.trace_step import trace_step
        return trace_step(self, images, labels, path)
