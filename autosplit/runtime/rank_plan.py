"""Planning inside the job: the Plan for one microbatch shape, and this rank's runnable share of it.

Terms (see runtime/parallel_module.py for replica batch and microbatch):
  provisional  -- a plan built before any microbatch was seen (from the model's declared input size,
                  the fewest rows both its traced graph and the tp layout allow, ``provisional_rows``:
                  1; 2 where a BatchNorm would see one value per channel in one row; a grid mode's
                  q, d * q or q * q) so that ``parameters()`` can be
                  handed to an optimizer; the first step re-plans for its real microbatch keeping
                  the same cut (``stage_bounds``), so the parameters the optimizer holds stay the
                  ones this rank trains.
  raw modules  -- this rank's stage GraphModules (tp shards on the device, weight GEMMs split where
                  the schedule defers W), holding the parameters under their original names.
  modules      -- what the executor calls: the raw modules, wrapped for activation checkpointing or
                  for FSDP2 (``dp_shard``).
  partial params -- replicated parameters whose gradients each tp rank holds only a part of
                  (runtime/parallel/gradients.py reduces them; they are not in the dp buckets).
Pure planning is ``autosplit.compile``; this module adds what needs the world: the agreed cost
profile, moving and wrapping modules, and the dp buckets' process group.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from autosplit import validate
from autosplit.compiler import compile_with
from autosplit.cost_model.step_time import plan_deferred_w_stages
from autosplit.errors import AutosplitError
from autosplit.inputs import default_input_shape
from autosplit.meta_init import Initializer
from autosplit.options import PlanOptions
from autosplit.passes.batch_norm import warn_batch_norm
from autosplit.passes.split_backward import split_weight_gemms
from autosplit.passes.tp_random import fork_sharded_random
from autosplit.runtime.parallel import tp_collectives
from autosplit.runtime.parallel import tp2d_collectives  # noqa: F401  (registers linear_2d / sum_stats)
from autosplit.runtime.faults.loss_check import checked_loss
from autosplit.runtime.parallel.buffers import BufferSync
from autosplit.runtime.parallel.data_parallel import GradBuckets
from autosplit.runtime.parallel.fsdp import StageSharding, release_plan_values
from autosplit.runtime.pipeline.compiled_stages import compile_units, unalias_grads
from autosplit.runtime.pipeline.executor import PipelineExecutor
from autosplit.runtime.stage.checkpointing import checkpointed
from autosplit.runtime.stage.params import (adopt_parameters, graph_order_params, local_values, materialize_local,
                                      to_device)
from autosplit.runtime.parallel.tp_collectives import bind_axis_groups, unbind_groups
from autosplit.runtime.profile import agreed_profile, with_node_size
from autosplit.strategy.layout import fewest_microbatch_rows, trace_model
from autosplit.tp.axes import batch_ways, tp_axes

log = logging.getLogger("autosplit")      # the library logs; it never prints


def provisional_rows(model: torch.nn.Module, shape: tuple[int, ...], options: PlanOptions, tp: int) -> int:
    """Rows of a provisional plan's microbatch (one sample of ``shape``, the model's declared input size).

    The fewest rows that both allow: the model's graph (1, or 2 where a batch-statistics layer would
    see one value per channel in one row; traced here, compile traces it again: a trace is cheap next
    to planning, and only a provisional plan needs this one) and the tp layout, whose grid modes split
    every microbatch's rows over some of their axes (tp/axes.py ``batch_ways``: 2D q, 2.5D d * q, 3D
    q * q; 1 for one axis and for "auto", which picks a layout the rows allow).  Why the layout's
    share: a provisional plan of 1 row was refused by 2D / 2.5D / 3D ("1 rows, which do not divide by
    q(2)") before the user sent a microbatch, whatever its size; the first step re-plans for its real
    rows, which get that error only where they do not divide.
    """
    traced = trace_model(model, (torch.empty(1, *shape, device="meta"),),
                         validate.leaf_modules(model, options.leaf_modules), options.concrete_args)
    layout = batch_ways(tp_axes(options.tp_mode, tp, options.tp_depth)) if tp > 1 else 1
    return math.lcm(fewest_microbatch_rows(traced)[0], layout)


class RankPlanner:
    """Builds (and re-builds for a new microbatch shape) the Plan and this rank's modules.

    Args:
        model: the user's model (the parameters' home; a meta model is materialized shard by shard).
        world: runtime/parallel/world.py's World (mesh, coordinates, groups, device).
        watchdog: runtime/faults/deadlines.py's Watchdog (every wait goes through it).
        options: the PlanOptions; ``options.device`` None means the agreed profile of this machine.
        loss_fn: ``loss_fn(logits, labels)``, run on the last stage.
        bucket_bytes: size of a data-parallel gradient bucket.
        initializer: a meta model's Initializer (autosplit/meta_init.py), or None.
        compile_settings: ``torch.compile`` arguments for every stage (runtime/pipeline/compiled_stages.py), or
            None: stages run eagerly.
    """

    def __init__(self, model: torch.nn.Module, world, watchdog, options: PlanOptions, loss_fn: Callable,
                 bucket_bytes: int, initializer: Initializer | None, compile_settings: dict | None = None):
        self.model, self.world, self.watchdog, self.options = model, world, watchdog, options
        self.compile_settings = compile_settings
        self.loss_fn, self.bucket_bytes, self.initializer = loss_fn, bucket_bytes, initializer
        self.plan = None
        self.provisional = False
        self.profile = None
        self.raw_modules: list = []
        self.modules: list = []
        self.partial_params: list = []
        self.sharding: StageSharding | None = None
        self.buckets = None
        self.executor: PipelineExecutor | None = None
        self._buffer_sync: BufferSync | None = None
        self._warned = False           # the BatchNorm warning was given (or was not due on this rank)

    def sharded(self) -> dict:
        """Name -> ShardedParam of the parameters split over tp (empty before planning or at tp = 1)."""
        return self.plan.tp_plan.sharded if self.plan is not None and self.plan.tp_plan is not None else {}

    def require(self) -> None:
        """Plan now if no microbatch was seen yet: a provisional plan from the model's own input size."""
        if self.plan is None:
            shape = default_input_shape(self.model)
            rows = provisional_rows(self.model, shape, self.options, self.world.mesh.tp)
            self.build(torch.empty(rows, *shape, device="meta"), provisional=True)

    def plan_for(self, mb: tuple, agree: Callable[..., None]) -> None:
        """Make the plan fit microbatch ``mb`` (plan, or re-plan a provisional plan keeping its cut),
        check ``mb`` against it, then ``agree()`` with every rank.  A planning error is first told to
        every rank (``agree(error=...)``: they wait in the agreement), then raised here too."""
        try:
            if self.plan is None:
                self.build(mb)
            elif self.provisional and [tuple(x.shape) for x in mb] != [tuple(s) for s in self.plan.example_shapes]:
                self.build(mb, bounds=self.plan.bounds)
        except AutosplitError as exc:
            agree(error=str(exc))
            raise
        self.provisional = False
        self.check_shapes(mb)
        agree()
        self._warn_batch_norm()      # a kept provisional plan is now the step's: its sizes are the real ones
        self.bind()

    def bind(self) -> None:
        """Point the tensor-parallel collectives at this rank's groups.  Their binding is per process,
        so it is renewed before every run: another ParallelModule of the process may have rebound it."""
        bind_axis_groups({a: self.world.group(a) for a in self._axes()}, self.watchdog)

    def _axes(self) -> tuple[str, ...]:
        tp = self.plan.tp_plan if self.plan is not None else None
        return ("tp", *(a for a, _ in tp.axes)) if tp is not None else ("tp",)

    def close(self) -> None:
        """Release the executor's threads and drop what holds the world's groups (the executor, the
        gradient buckets, the buffer sync, the collectives' binding), so that they end with the groups."""
        if self.executor is not None:
            self.executor.close()
        self.executor = self._buffer_sync = None
        if self.sharding is None and self.buckets is not None:   # FSDP2's are its parameters' (they stay)
            self.buckets.close()
            self.buckets = None
        unbind_groups([self.world.group(a) for a in self._axes()])

    def check_shapes(self, mb: tuple) -> None:
        got = [(tuple(x.shape), str(x.dtype).removeprefix("torch.")) for x in mb]
        want = list(zip(map(tuple, self.plan.example_shapes), self.plan.example_dtypes))
        if got != want:
            raise AutosplitError(f"step inputs give microbatches of (shape, dtype) {got}, but the plan was built "
                                 f"for {want}; keep the batch size, image size and dtype of the first step")

    def build(self, microbatch, bounds=None, provisional: bool = False) -> None:
        """Plan for ``microbatch`` (its shapes only) and build this rank's modules, buckets and executor.

        Args:
            microbatch: a tensor or tuple of tensors with one microbatch's shapes and dtypes.
            bounds: keep this cut (a provisional plan's ``plan.bounds``) instead of the options'.
            provisional: a plan made before any microbatch was seen (``require``); the first step
                re-plans it, or keeps it where the shapes agree.
        """
        example = tuple(microbatch) if isinstance(microbatch, (tuple, list)) else (microbatch,)
        example = tuple(torch.empty_like(x, device="meta") for x in example)
        world, opts = self.world, self.options
        changes = {"stage_bounds": bounds} if bounds is not None else {}
        if opts.device is None:                 # measured (CPU) once, then reused for re-planning
            self.profile = self.profile or agreed_profile(world, self.watchdog)
            changes["device"] = with_node_size(self.profile, world)
        elif world.device.type == "cuda":       # the user's profile, with the job's node size
            changes["device"] = with_node_size(opts.device, world)
        mesh = world.mesh
        self.plan = compile_with(self.model, mesh, example, PlanOptions.from_kwargs("parallelize", changes, opts),
                                 warn=False)          # the BatchNorm warning: _warn_batch_norm
        if self.plan.tp_plan is not None:       # tp_mode="auto" learns its grid's axes here (world.py)
            world.add_tp_axes(self.plan.tp_plan.axes)
        self.provisional = provisional
        if world.rank == 0:
            log.info("planned:\n%s", self.plan.summary())
        self._build_modules()
        if not provisional:
            self._warn_batch_norm()

    def _warn_batch_norm(self) -> None:
        """The BatchNorm note as a warning once per parallelize and job (rank 0), from its first plan for
        real microbatches: a provisional plan's microbatch size is not the step's."""
        if not self._warned and self.world.rank == 0:
            warn_batch_norm(self.plan.batch_norm_note(), stacklevel=5)   # at the user's step / parallelize
        self._warned = True

    def _build_modules(self) -> None:
        world, plan, opts = self.world, self.plan, self.options
        coord = world.coord
        modules = plan.stage_modules(coord.pp, coord.tp)
        if self.raw_modules and not plan.dp_shard:   # a re-plan keeps the tensors (the Parameter
            for old, new in zip(self.raw_modules, modules):   # objects the optimizer was given, loaded buffers)
                adopt_parameters(old, new)
        values = local_values(self.initializer, self.sharded(), coord.tp) if self.initializer is not None else None
        # A meta model: this rank's tp shards (all on the first build).  Under dp_shard they stay on the
        # meta device here: StageSharding allocates only this rank's FSDP shards of its copies (a re-plan
        # keeps those and takes only the graphs), so the whole stage never exists, neither in these
        # modules (with tp = 1 the user's model's own, and the plan's cache) nor in a copy.
        if values is not None and not plan.dp_shard:
            materialize_local(modules, values, world.device)
        modules = [to_device(m, world.device) for m in modules]
        modules = [fork_sharded_random(m) for m in modules] if world.mesh.block > 1 else modules
        # I / W schedules defer weight gradients to W, on the stages the cost model prices a W apart for
        # (deferred_w_stages: where some W does not directly follow its I, and on a GPU also where the
        # split only hands the input gradient on earlier; elsewhere it only costs).  Under tp, B
        # overlaps them with the backward all-reduce / reduce-scatter of the entries' input gradients
        # (runtime/parallel/tp_collectives.py), on every stage.  Not under dp_shard: FSDP2 reduce-scatters a
        # module's gradients when its backward ends.
        # Compiled stages defer W where the schedule needs it (autosplit/weight_grad_ops.py); the backward
        # overlap under tp is left to the compiled graph (its collectives are opaque ops, run in order).
        compiled = self.compile_settings is not None
        overlap = world.mesh.block > 1 and tp_collectives.OVERLAP_BACKWARD and not plan.dp_shard and not compiled
        stages = plan.placement.stages(coord.pp)
        deferring = plan_deferred_w_stages(plan)
        modules = [split_weight_gemms(m)[0] if overlap or s in deferring else m for s, m in zip(stages, modules)]
        partial = plan.tp_plan.partial_grads if plan.tp_plan is not None else set()
        if plan.dp_shard:          # FSDP2 units over dp (runtime/parallel/fsdp.py); its grads replace the buckets
            self.sharding = self.sharding or StageSharding(world, self.model, plan.dp_shard, opts.recompute,
                                                           opts.autocast)
            self.raw_modules, self.modules = self.sharding.stages(
                modules, stages, partial, values, plan.tp_plan.whole_grads if plan.tp_plan is not None else set())
            self.buckets = self.sharding.grads
            # the shards are this rank's values now: the plan's copies of whole stages go (fsdp.py)
            del modules
            release_plan_values(plan, self.model)
        else:
            self.raw_modules = modules
            self.modules = [checkpointed(m, self.model, opts.recompute) for m in self.raw_modules]
        if compiled:
            for s, m in zip(stages, self.modules):
                compile_units(m, self.compile_settings, f"rank {world.rank} stage {s}")
        self.bind()
        # in graph order: every rank of a group flattens the same parameters in the same order
        self.partial_params = [p for m in self.raw_modules for n, p in graph_order_params(m) if n in partial]
        if self.buckets is None and (world.mesh.dp > 1 or world.mesh.cp > 1):   # parameters never change owner
            # partial-grad params are reduced over dp by gradients.reduce_partial_grads, after their tp sum;
            # with cp the buckets span dp x cp and sum every cp rank's part (data_parallel.py, *cp*)
            partial_ids = {id(p) for p in self.partial_params}
            whole = plan.tp_plan.whole_grads if plan.tp_plan is not None else set()
            self.buckets = GradBuckets({s: [p for _, p in graph_order_params(m) if id(p) not in partial_ids]
                                        for s, m in zip(stages, self.raw_modules)},
                                       world.group(world.grad_axis), world.mesh.dp, self.watchdog, self.bucket_bytes,
                                       cp=world.mesh.cp, whole={id(p) for m in self.raw_modules
                                                                for n, p in graph_order_params(m) if n in whole})
        if self.executor is not None:     # a re-plan: the old executor's transport thread goes
            self.executor.close()
        self.executor = PipelineExecutor(world, plan, self.modules, checked_loss(self.loss_fn), self.watchdog,
                                         opts.autocast, self.buckets.arm if self.buckets else None,
                                         unalias_grads if compiled else None)

    def sync_buffers(self) -> None:
        """Buffers a forward updated (BatchNorm statistics) become dp rank 0's on every replica
        (runtime/parallel/buffers.py), so replicas never drift and ``full_state_dict`` agrees everywhere."""
        if self.world.mesh.dp == 1:
            return
        if self._buffer_sync is None or self._buffer_sync.modules is not self.raw_modules:
            self._buffer_sync = BufferSync(self.raw_modules, self.world.group("dp"), self.world.rank_at(dp=0),
                                           self.watchdog)
        self._buffer_sync.sync()
