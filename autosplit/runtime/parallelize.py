"""``autosplit.parallelize``: the training entry point, run inside every process of the job.

Terms: see runtime/world.py (world, backend, groups) and runtime/parallel_module.py (replica batch,
microbatch, local params).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from autosplit.runtime.auto_mesh import auto_arguments
from autosplit.runtime.fsdp import check_dp_shard
from autosplit.runtime.parallel_module import ParallelModule
from autosplit.runtime.world import DEFAULT_TIMEOUT_S, init_world


def parallelize(model: torch.nn.Module, mesh=(1, 1, -1), loss_fn: Callable | None = None,
                num_microbatches: int = 8, schedule: str = "1f1b", chunks_per_rank: int = 1,
                tp_mode: str = "1d", example_input=None, *, autocast: torch.dtype | None = None,
                checkpoint: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                bucket_mb: float = 25, dp_shard: bool | str = False, seed: int = 0,
                init_fn: Callable | None = None, global_batch: int | None = None, **compile_options) -> ParallelModule:
    """Turn ``model`` into this rank's part of a (pp, tp, dp) training program.

    ``mesh``: (pp, tp, dp); dp=-1 takes what the world size leaves.  ``loss_fn(logits, labels)``
    defaults to cross-entropy.  ``autocast``: torch.bfloat16 or torch.float16 (with a loss scaler).
    ``checkpoint="stage"`` recomputes each stage's forward in its backward, ``"block"`` each layer's.  ``compile_options`` go
    to ``autosplit.compile`` (e.g. ``memory_budget=...``, ``sequence_parallel=True``); the cost model's
    ``device`` defaults to the GPU's built-in profile, or on CPU to this machine measured by rank 0.
    ``dp_shard``: shard parameters, gradients and optimizer state over dp with FSDP2
    (runtime/fsdp.py): ``"stage"`` or ``"layer"`` units, or True to let the cost model choose.
    Every rank must build ``model`` identically (same seed) before calling this.
    ``mesh="auto"`` (with ``global_batch``): the strategy search's fastest configuration (mesh, schedule,
    microbatches, tp mode, sequence parallelism, checkpointing, dp sharding) replaces those arguments.

    A model built on the meta device (``with torch.device("meta"):``) is initialized here, each rank
    allocating only its own stages' shards: with ``init_fn(name, tensor)`` (in place, full shape, torch's
    generator seeded from (seed, name)) or each module's ``reset_parameters()``; the values are those
    ``autosplit.materialize(model, seed, init_fn)`` gives on one device, whatever the mesh.
    """
    if isinstance(mesh, str) and mesh == "auto":      # every rank runs the same pure search (auto_mesh.py)
        chosen = auto_arguments(model, example_input, global_batch, compile_options, autocast)
        return parallelize(model, loss_fn=loss_fn, timeout_s=timeout_s, bucket_mb=bucket_mb, seed=seed,
                           init_fn=init_fn, **chosen)
    check_dp_shard(dp_shard)                # before any rendezvous: the same error on every rank
    world = init_world(mesh, timeout_s, tp_mode)
    return ParallelModule(model, world, loss_fn or torch.nn.CrossEntropyLoss(), num_microbatches, schedule,
                          chunks_per_rank, tp_mode, example_input, autocast=autocast, checkpoint=checkpoint,
                          bucket_bytes=int(bucket_mb * 2**20),
                          compile_options={**compile_options, "dp_shard": dp_shard}, seed=seed, init_fn=init_fn)
