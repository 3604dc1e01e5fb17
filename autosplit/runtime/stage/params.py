"""Parameters of stage modules: their graph order, and keeping the objects an optimizer holds.

Terms:
  graph order -- the order in which a stage graph first reads its parameters; the same on every rank
                 that runs the same graph, whatever order its module registered them in (tensor-parallel
                 ranks build theirs differently), so collectives over flattened gradients line up.
  adopt       -- a re-plan builds new stage modules; the optimizer was given the old Parameter objects,
                 so the new modules take those objects over (same names, same shapes), and the old
                 buffers too (a checkpoint may have loaded them; a meta model's exist only there).
  materialize -- a model built on the meta device: each rank allocates and initializes only the
                 tensors of its own stage modules (its tp slices), see autosplit/meta_init.py; under
                 ``dp_shard`` only its FSDP shards of them (runtime/parallel/fsdp.py), never the whole stage.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from autosplit.meta_init import assign


def adopt_parameters(old: torch.nn.Module, new: torch.nn.Module) -> None:
    """Put ``old``'s Parameter objects and buffers into ``new`` under the same names (same shapes)."""
    for name, tensor in list(old.named_parameters()) + list(old.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        setattr(new.get_submodule(owner) if owner else new, leaf, tensor)


def graph_order_params(module: torch.fx.GraphModule) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) in the order the graph first uses them: the same on every rank that runs
    the same graph, whatever order its module registered them in (tp ranks build theirs differently)."""
    params, seen = dict(module.named_parameters()), set()
    out = []
    for node in module.graph.nodes:
        if node.op == "get_attr":
            names = [node.target]
        elif node.op == "call_module":
            names = [f"{node.target}.{n}" for n, _ in module.get_submodule(node.target).named_parameters()]
        else:
            continue
        for name in names:
            if name in params and name not in seen:
                seen.add(name)
                out.append((name, params[name]))
    return out


def local_values(initializer, sharded: dict, tp_rank: int) -> Callable[[Iterable[str]], Iterator]:
    """``values(names)``: (name, initial value at this tp rank's shape, on the CPU) for meta tensors of
    the model: each full value (``autosplit.meta_init.Initializer``, one owner module at a time) cut to
    this tp rank's slice when it is sharded (``ShardedParam.select``).  Both ways of materializing
    (``materialize_local``, and into FSDP's shards: runtime/parallel/fsdp.py) take their values from here, so a
    rank holds the numbers ``autosplit.materialize`` gives on one device whatever the mesh."""
    def values(names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, full in initializer.values(names):
            yield name, sharded[name].select(full, tp_rank) if name in sharded else full
    return values


def materialize_local(modules: list[torch.nn.Module], values: Callable, device) -> int:
    """Give this rank's stage modules real tensors for their meta ones: ``values`` (``local_values``)
    moved to ``device``.  Nothing outside these modules is allocated, so a rank holds its shards plus
    at most one module's full tensors.  Returns the bytes allocated."""
    holders: dict[str, list[torch.nn.Module]] = {}
    for m in modules:
        for name, t in list(m.named_parameters()) + list(m.named_buffers()):
            if t.is_meta:
                holders.setdefault(name, []).append(m)
    allocated = 0
    for name, value in values(holders):
        value = value.to(device).contiguous()
        allocated += value.numel() * value.element_size()
        for m in holders[name]:
            assign(m, name, value)
    return allocated


def to_device(module: torch.nn.Module, device) -> torch.nn.Module:
    """``module.to(device)`` for the tensors that have values; meta ones stay on the meta device (a meta
    model under ``dp_shard``: FSDP shards them first, then runtime/parallel/fsdp.py allocates only the shards)."""
    if not any(t.is_meta for t in list(module.parameters()) + list(module.buffers())):
        return module.to(device)
    return module._apply(lambda t: t if t.is_meta else t.to(device))
