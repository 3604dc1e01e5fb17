"""The optimizer in a checkpoint, in torch's own layout, each rank writing and reading only its chunks.

Terms:
  torch's layout  -- what ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, opt)``
                     gives for the original model on one device, under the key ``optimizer``:
                     ``{"state": {param name: {"exp_avg": ..., "step": ...}}, "param_groups": [{"lr": ...,
                     ..., "params": [param names]}]}``.  DCP flattens it to ``optimizer.state.<name>.<key>``
                     and ``optimizer.param_groups.<i>.<key>`` and keeps the paths in its metadata, so
                     ``dcp_to_torch_save`` gives that dict back and ``set_optimizer_state_dict`` takes it.
                     Tensors are DCP tensors (sharded like their parameter); Python values (``lr``,
                     ``betas``, the name lists) are DCP's own byte entries.
  per-element state -- an optimizer state tensor with the parameter's shape (sharded like it) or a
                     scalar (replicated, e.g. Adam's ``step``).  Other shapes cannot be resharded: refused.
  merged group    -- a rank's optimizer holds only its parameters, so its group ``i`` lists only those;
                     the saved group ``i`` lists the names of every rank's group ``i`` (model order), with
                     the hyperparameters every rank agrees on.  Ranks must build the same number of groups.
Loading maps by name: each local parameter takes its saved state, and each local group the
hyperparameters of the saved group that holds its first parameter.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from autosplit.errors import AutosplitError
from autosplit.runtime.faults.exchange import who
from autosplit.runtime.state.checkpoint_chunks import entry, sharded
from autosplit.runtime.state.checkpoint_files import entry_paths

KEY = "optimizer"


def param_names(pm, optimizer) -> tuple[dict[int, str], str | None]:
    """id(parameter) -> name, and a problem if the optimizer holds a tensor that is not this rank's.
    Reads the stage modules directly: no lazy planning (which communicates) before the call gate."""
    names = {id(p): n for m in pm.raw_modules for n, p in m.named_parameters()}
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in names:
                return names, (f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not one of "
                               f"pm.parameters(); build it as torch.optim.X(pm.parameters(), ...)")
    return names, None


def state_entries(pm, optimizer, names: dict[int, str]) -> tuple[dict, str | None]:
    """``{param name: {key: entry}}`` of this rank's parameters, or a problem (before the call gate)."""
    info, out = sharded(pm), {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            name, values = names[id(p)], {}
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    values[key] = value                      # replicated: a scalar or a Python value
                elif value.shape == p.shape:
                    e = entry(value, info.get(name), pm.block_rank)
                    if e is not None:
                        values[key] = e
                else:
                    return out, (f"optimizer state '{key}' of '{name}' has shape {tuple(value.shape)}, neither the "
                                 f"parameter's {tuple(p.shape)} nor a scalar; only per-element optimizer state "
                                 f"(SGD momentum, Adam moments) can be saved for resharding")
            if values:
                out[name] = values
    return out, None


def merged_groups(pm, optimizer, names: dict[int, str], group) -> list[dict]:
    """Every rank's groups merged (see *merged group*); one all_gather_object on ``group`` (the checkpoint's
    gloo group), after the call gate.  Every rank sees every rank's groups, so a mismatch raises the same
    error on every rank."""
    mine = [([names[id(p)] for p in g["params"]], {k: v for k, v in g.items() if k != "params"})
            for g in optimizer.param_groups]
    everyone: list = [None] * pm.world.size
    dist.all_gather_object(everyone, mine, group=group)
    counts = [len(r) for r in everyone]
    if len(set(counts)) > 1:
        raise AutosplitError(
            "save_checkpoint: the ranks' optimizers have different numbers of parameter groups ("
            + ", ".join(f"{who([r], pm.world)}: {n}" for r, n in enumerate(counts))
            + "); every rank must build the same groups (by the same rule over pm.named_parameters())")
    order = {n: i for i, (n, _) in enumerate(pm.model.named_parameters())}
    merged = []
    for i, (_, hyper) in enumerate(everyone[0]):
        for r, groups in enumerate(everyone):
            if repr(groups[i][1]) != repr(hyper):
                differs = sorted(k for k in set(hyper) | set(groups[i][1])
                                 if repr(hyper.get(k)) != repr(groups[i][1].get(k)))
                raise AutosplitError(f"save_checkpoint: parameter group {i} has other hyperparameters on "
                                     f"{who([r], pm.world)} than on rank 0 ({', '.join(differs)}); every rank must "
                                     f"use the same values for group {i}")
        params = sorted({n for groups in everyone for n in groups[i][0]}, key=lambda n: (order.get(n, len(order)), n))
        merged.append({**hyper, "params": params})
    return merged


def saved_problem(metadata) -> str | None:
    if not any(p[:1] == (KEY,) for p in entry_paths(metadata).values()):
        return "load_checkpoint: the checkpoint holds no optimizer state (it was saved without optimizer=)"
    return None


def load_targets(pm, optimizer, names: dict[int, str], metadata, root: dict) -> dict:
    """Put into ``root`` (the DCP state dict) the targets DCP fills: this rank's chunks of each of its
    parameters' saved state and every saved group.  Returns {(name, key): the tensor the optimizer gets}
    (a DTensor whose local part is the entry, for an FSDP-sharded parameter)."""
    info, targets = sharded(pm), {}
    mine = {names[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
    for key, path in entry_paths(metadata).items():
        md = metadata.state_dict_metadata[key]
        if path[:2] == (KEY, "param_groups"):
            set_element(root, path, None if isinstance(md, BytesStorageMetadata) else
                        torch.empty(md.size, dtype=md.properties.dtype))
        elif path[:2] == (KEY, "state") and len(path) == 4 and path[2] in mine:
            if isinstance(md, BytesStorageMetadata):
                set_element(root, path, None)
            elif len(md.size) == 0:
                set_element(root, path, torch.empty((), dtype=md.properties.dtype))
            else:                       # like the parameter: a DTensor for an FSDP-sharded one
                target = torch.empty_like(mine[path[2]], dtype=md.properties.dtype)
                targets[path[2], path[3]] = target
                e = entry(target, info.get(path[2]), pm.block_rank)
                if e is not None:
                    set_element(root, path, e)
    return targets


def load_into(optimizer, names: dict[int, str], loaded: dict, targets: dict) -> None:
    """Hand the loaded state to ``optimizer.load_state_dict`` (its own device and dtype rules)."""
    saved_state = loaded.get("state", {})
    group_of = {n: g for g in loaded.get("param_groups", []) for n in g.get("params", [])}
    chunks: dict[str, dict] = {}
    for (name, key), t in targets.items():
        chunks.setdefault(name, {})[key] = t
    state, groups, index = {}, [], 0
    for g in optimizer.param_groups:
        ids, hyper = [], None
        for p in g["params"]:
            name = names[id(p)]
            values = dict(saved_state.get(name, {}))
            values.update(chunks.get(name, {}))      # the full-shape tensors (also where this rank's chunk is empty)
            if values:
                state[index] = values
            if hyper is None and name in group_of:
                hyper = {k: v for k, v in group_of[name].items() if k != "params"}
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in g.items() if k != "params"}, **(hyper or {}), "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
