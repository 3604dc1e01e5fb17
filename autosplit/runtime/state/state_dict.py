"""The original model's full state dict, from and to one rank's stage shards.

For small models: ``gather_full_state_dict`` gathers EVERY tensor onto EVERY rank (a whole copy of the
model per process).  A model bigger than one device checkpoints with runtime/state/checkpoint.py instead.

Terms:
  owner   -- the pipeline rank whose stages hold a parameter or buffer; ``gather_full_state_dict``
             broadcasts each tensor from its owner over the pp axis.
  sharded -- a tensor split over tp (``plan.tp_plan.sharded``: autosplit/tp/shards.py's ShardedParam,
             each tp rank's indices along the split dims); gathered from the tp ranks and put back in place by those indices.
  local   -- the tensors of the stages this rank runs, under the original names.
Every wait goes through the Watchdog and is read on the host (``host=True``).  A tensor sharded over dp
(``dp_shard``, runtime/parallel/fsdp.py) is all-gathered first (``full_value``): the ranks of a dp group own the
same names and visit them in ``model.state_dict()`` order, so their all-gathers line up.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autosplit.errors import AutosplitError
from autosplit.runtime.parallel.fsdp import copy_full_into, full_value


def _sharded(plan) -> dict:
    return plan.tp_plan.sharded if plan is not None and plan.tp_plan is not None else {}


def local_tensors(modules: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    local = {}
    for m in modules:
        local.update(dict(m.named_parameters()))
        local.update(dict(m.named_buffers()))
    return local


def _owners(plan) -> dict[str, int]:
    owners = {}
    for s, module in enumerate(plan.modules):
        for name, _ in list(module.named_parameters()) + list(module.named_buffers()):
            owners.setdefault(name, plan.placement.rank(s))
    return owners


def _gather_shards(world, watchdog, info, name: str, tensor: torch.Tensor, full_shape) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(world.mesh.block)]
    work = dist.all_gather(parts, tensor.detach().contiguous(), group=world.group("tp"), async_op=True)
    watchdog.wait(work, f"full_state_dict gather of {name}", host=True)
    full = torch.empty(full_shape, dtype=tensor.dtype, device=tensor.device)
    for rank, part in enumerate(parts):
        info.place(full, part, rank)
    return full


def gather_full_state_dict(model, plan, modules, world, watchdog) -> dict[str, torch.Tensor]:
    """``model.state_dict()``'s keys and full shapes, CPU tensors, the same on every rank."""
    owners, local, sharded = _owners(plan), local_tensors(modules), _sharded(plan)
    result = {}
    for name, tensor in model.state_dict().items():
        if name in local and name in sharded:
            buf = _gather_shards(world, watchdog, sharded[name], name, full_value(local[name]), tensor.shape)
        elif name in local:
            buf = full_value(local[name]).detach().clone()
        elif tensor.is_meta and name in owners:   # a meta model's tensor another stage holds: received below
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, device=world.device)
        elif tensor.is_meta:
            raise AutosplitError(f"full_state_dict: '{name}' is on the meta device and no stage uses it, so it "
                                 f"was never initialized; give it a value on every rank before parallelize")
        else:
            buf = tensor.detach().to(world.device).clone()
        if name in owners and world.mesh.pp > 1:
            src = world.rank_at(pp=owners[name])
            work = dist.broadcast(buf, src=src, group=world.group("pp"), async_op=True)
            watchdog.wait(work, f"full_state_dict broadcast of {name}", host=True)
        result[name] = buf.cpu()
    return result


def load_into(model, state_dict: dict[str, torch.Tensor], plan, modules, tp_rank: int) -> None:
    """Copy a full state dict into ``model`` and into this rank's stage tensors (its tp slice of each
    sharded one); the keys and shapes were checked by the caller."""
    local, sharded = (local_tensors(modules), _sharded(plan)) if plan is not None else ({}, {})
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if not tensor.is_meta:            # a meta model keeps no values outside this rank's stages
                tensor.copy_(state_dict[name])
            if name in local:
                value = state_dict[name]
                if name in sharded:
                    value = sharded[name].select(value, tp_rank)
                copy_full_into(local[name], value)
