"""``parallelize(model, mesh="auto", global_batch=...)``: the strategy search's first choice, on every rank.

Terms: see autosplit/strategy (Candidate, options).
  agreement -- no communication: every rank runs the same deterministic, pure search on the same model,
               batch and cost-model profile, so every rank reaches the same configuration.  That needs a
               profile that is the same everywhere: ``device=`` (a name or a DeviceProfile), or the GPU's
               built-in profile; a CPU measured by each rank could differ, so on CPU ``device=`` is
               required (e.g. ``autosplit.cost_model.calibrate()`` measured once and passed to all).
"""
from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.distributed as dist

from autosplit.cost_model import get_profile, profile_for_gpu
from autosplit.errors import AutosplitError
from autosplit.inputs import default_input_shape

log = logging.getLogger("autosplit")


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    if "WORLD_SIZE" not in os.environ:
        raise AutosplitError("mesh='auto' needs the world size: run under torchrun (WORLD_SIZE is not set) or call "
                             "torch.distributed.init_process_group first")
    return int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0"))


def auto_arguments(model, example_input, global_batch, compile_options: dict, autocast) -> dict:
    """``parallelize`` keywords of the search's first candidate: mesh (a MeshShape, with the cp axis the
    search may choose: strategy/space.py), its options (``autocast`` among them: the search prices the
    dtypes it gives), and an example microbatch of the chosen size; the table is logged at INFO on rank 0."""
    from autosplit.strategy import search
    if global_batch is None:
        raise AutosplitError("mesh='auto' needs global_batch=<samples per optimizer step over all replicas>: the "
                             "search chooses dp and the microbatch count from it")
    device = compile_options.get("device")
    if device is None:
        if not torch.cuda.is_available():
            raise AutosplitError("mesh='auto' on CPU needs device= (a profile name or a DeviceProfile measured once, "
                                 "e.g. autosplit.cost_model.calibrate(), passed to every rank): each rank measuring "
                                 "its own CPU could choose a different configuration")
        device = profile_for_gpu(torch.cuda.get_device_name())
    if torch.cuda.is_available() and os.environ.get("LOCAL_WORLD_SIZE"):     # the job's node size (profile.py)
        device = dataclasses.replace(get_profile(device), gpus_per_node=int(os.environ["LOCAL_WORLD_SIZE"]))
    world, rank = _world()
    if example_input is None:
        # one row: the search reads only the per-sample shape and dtype, and takes the fewest rows a
        # microbatch may have (BatchNorm) from the model's traced graph
        example_input = torch.empty(1, *default_input_shape(model), device="meta")
    inputs = example_input if isinstance(example_input, (tuple, list)) else (example_input,)
    ranked = search(model, world, example_input, global_batch=global_batch, device=device,
                    memory_budget=compile_options.get("memory_budget"),
                    leaf_modules=compile_options.get("leaf_modules", ()),
                    concrete_args=compile_options.get("concrete_args"), autocast=autocast)
    if not ranked:
        raise AutosplitError(f"mesh='auto': no configuration of {world} ranks fits; the search rejected:\n"
                             f"{ranked.table()}")
    if rank == 0:
        log.info("mesh='auto': strategy search, fastest predicted first\n%s", ranked.table())
    best = ranked[0]
    options = dict(best.options)
    micro = global_batch // best.mesh.dp // options["num_microbatches"]
    example = tuple(torch.empty(micro, *x.shape[1:], dtype=x.dtype, device="meta") for x in inputs)
    return {**compile_options, **options, "autocast": autocast, "device": device, "mesh": best.mesh,
            "example_input": example if len(example) > 1 else example[0]}
