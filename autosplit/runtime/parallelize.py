"""``autosplit.parallelize``: the training entry point, run inside every process of the job.

Terms: see runtime/parallel/world.py (world, backend, groups), runtime/parallel_module.py (replica batch,
microbatch, local params) and options.py (the planning options).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from autosplit.deprecated import positional_keywords
from autosplit.host_memory import keep_freed_host_memory
from autosplit.options import PlanOptions, check_dp_shard
from autosplit.runtime.auto_mesh import auto_arguments
from autosplit.runtime.parallel.world import DEFAULT_TIMEOUT_S, init_world
from autosplit.runtime.parallel_module import ParallelModule, release_orphans
from autosplit.runtime.pipeline.compiled_stages import compile_settings


def parallelize(model: torch.nn.Module, mesh=(1, 1, -1), loss_fn: Callable | None = None,
                num_microbatches: int | None = None, *old_positional,
                tp_mode: str = "1d", schedule: str = "1f1b", chunks_per_rank: int = 1, device=None,
                memory_budget: float | str | None = None, leaf_modules: Sequence = (),
                concrete_args: dict | None = None, stage_bounds: Sequence[int] | None = None,
                sequence_parallel: bool = False, autocast: torch.dtype | None = None, recompute: str | None = None,
                tp_2d_form: str = "auto", tp_depth: int | None = None, dp_shard: bool | str = False,
                tp_overlap_chunks: int = 1, cp_attention: str = "auto", options: PlanOptions | None = None,
                example_input=None, global_batch: int | None = None, seed: int = 0, init_fn: Callable | None = None,
                timeout_s: float = DEFAULT_TIMEOUT_S, bucket_mb: float = 25, compile_stages: bool | dict = False,
                **unknown) -> ParallelModule:
    """Turn ``model`` into this rank's part of a (pp, tp, dp) training program.

    Every rank must build ``model`` identically (same seed) before calling this.  A model built on the
    meta device (``with torch.device("meta"):``) is initialized here, each rank allocating only its own
    stages' shards: with ``init_fn(name, tensor)`` (in place, full shape, torch's generator seeded from
    (seed, name)) or each module's ``reset_parameters()``; the values are those
    ``autosplit.materialize(model, seed, init_fn)`` gives on one device, whatever the mesh.

    Args:
        model: the unchanged model.
        mesh: (pp, tp, dp); dp=-1 takes what the world size leaves (the default: pure data parallelism).
        loss_fn: ``loss_fn(logits, labels)``, a scalar mean; default cross-entropy.
        num_microbatches: microbatches per step; None: 2 * pp, as ``compile``'s None.
        example_input: one microbatch to plan for now; None plans from the model's declared input size
            and re-plans for the first step's microbatch.
        timeout_s: the limit of every distributed wait.
        bucket_mb: size of a data-parallel gradient bucket, in MiB.
        seed, init_fn: how a meta model is initialized (above).
        options: the planning options as a ``PlanOptions``; keyword arguments override its fields.
        global_batch: samples per optimizer step over all replicas; needed by ``mesh="auto"``, which
            replaces mesh, schedule, microbatches, tp mode, sequence parallelism, recomputation and dp
            sharding with the strategy search's fastest configuration (runtime/auto_mesh.py).
        Every argument from tp_mode to options is a planning option (``autosplit.options.PlanOptions``
        documents each), keyword-only, in ``compile``'s order: tp_mode, schedule, chunks_per_rank,
        device (None: the GPU's built-in profile, or on CPU this machine measured by rank 0; ``compile``,
        offline, defaults to "h100"), memory_budget, leaf_modules, concrete_args, stage_bounds,
        sequence_parallel, autocast (torch.bfloat16, or torch.float16 with a loss scaler), recompute
        ("stage" / "block"), tp_2d_form, tp_depth ("2.5d": d in tp = q * q * d), dp_shard (FSDP2 over dp:
        "stage", "layer" or "auto"; True means "auto"), tp_overlap_chunks, cp_attention (with a cp axis:
        "gather", "all_to_all" or "auto").
        old_positional: deprecated for one release (autosplit/deprecated.py): schedule, chunks_per_rank,
            tp_mode and example_input passed positionally after num_microbatches (a DeprecationWarning);
            so is ``checkpoint=`` (now ``recompute=``).
        Any other keyword is refused with the list of valid ones.
    """
    # every parameter named like an option, as given (first statement: locals() holds the parameters only)
    given = {k: v for k, v in locals().items() if k in _OPTION_NAMES}
    moved = positional_keywords("parallelize", POSITIONAL, old_positional, {**given, "example_input": example_input},
                                _POSITIONAL_DEFAULTS)
    example_input = moved.pop("example_input", example_input)
    given.update(moved)
    plan_options = _options(given, options, unknown)
    if isinstance(mesh, str) and mesh == "auto":      # every rank runs the same pure search (auto_mesh.py)
        fixed = {k: getattr(plan_options, k) for k in ("device", "memory_budget", "leaf_modules", "concrete_args")}
        chosen = auto_arguments(model, example_input, global_batch, fixed, plan_options.autocast)
        return parallelize(model, loss_fn=loss_fn, timeout_s=timeout_s, bucket_mb=bucket_mb, seed=seed,
                           init_fn=init_fn, compile_stages=compile_stages, **chosen)
    check_dp_shard(plan_options.dp_shard)     # before any rendezvous: the same error on every rank
    settings = compile_settings(compile_stages)
    release_orphans()         # groups of modules dropped without close() (parallel_module.py *orphan*)
    world = init_world(mesh, timeout_s, plan_options.tp_mode, plan_options.tp_depth)
    if plan_options.num_microbatches is None:        # compile's rule; pp is known once the mesh is parsed
        plan_options = dataclasses.replace(plan_options, num_microbatches=2 * world.mesh.pp)
    if world.device.type == "cpu":     # activations live in host memory: keep it (autosplit/host_memory.py)
        keep_freed_host_memory()
    return ParallelModule(model, world, loss_fn or torch.nn.CrossEntropyLoss(), plan_options, example_input,
                          bucket_bytes=int(bucket_mb * 2**20), seed=seed, init_fn=init_fn,
                          compile_settings=settings)


_SIGNATURE_DEFAULTS = dict(device=None)   # where parallelize's default is not PlanOptions'
_OPTION_NAMES = frozenset(PlanOptions.names())
# parallelize's old positional parameters after num_microbatches, in their old order (keyword-only now)
POSITIONAL = ("schedule", "chunks_per_rank", "tp_mode", "example_input")
_POSITIONAL_DEFAULTS = dict(schedule="1f1b", chunks_per_rank=1, tp_mode="1d", example_input=None)


def _options(given: dict, options: PlanOptions | None, extra: dict) -> PlanOptions:
    """The PlanOptions of a ``parallelize`` call: ``options`` (or parallelize's defaults) with the keyword
    arguments that differ from parallelize's defaults applied.  ``extra``: the keywords the signature does
    not name: a deprecated spelling (renamed, with its warning) or an unknown one (refused by name)."""
    changed = {**PlanOptions(**_SIGNATURE_DEFAULTS).changed(given), **extra}
    if options is None:
        changed = {**_SIGNATURE_DEFAULTS, **changed}
    return PlanOptions.from_kwargs("parallelize", changed, options, stacklevel=4)   # 4: the user's call
