"""Sharded checkpoints with torch.distributed.checkpoint (DCP): each rank writes and reads only its part.

Terms:
  entry      -- one key of the DCP state dict.  The model's tensors keep the original names and full
                shapes (``blocks.0.attn.qkv.weight``); optimizer state is ``optimizer/state/<param
                name>/<key>`` (``exp_avg``, ``momentum_buffer``, ``step`` ...), each parameter's group
                hyperparameters ``optimizer/group/<param name>`` (a pickled dict).
  chunk      -- a contiguous block of a full tensor with its global offsets.  A tensor-parallel shard
                is one chunk per box of its ShardedParam (autosplit/tp/shards.py): the fused qkv by
                heads is three chunks per rank, a 2D layout a grid of them.  Under ``dp_shard`` (FSDP2)
                a rank holds a block of its tp shard (a DTensor over dp); its indices are the tp
                slice's indices at the block's offsets, so the same boxes describe it.  Replicated
                tensors (tp and dp) are one full chunk, written once (DCP de-duplicates equal chunks).
  per-element state -- an optimizer state tensor with the parameter's shape (sharded like it) or a
                scalar (replicated, e.g. Adam's ``step``).  Other shapes cannot be resharded: refused.
  record     -- ``autosplit.json`` in the version: step, mesh, tp mode, schedule, plan hash.
Layout on disk and the atomic commit: checkpoint_files.py.

Why DCP's *CheckpointableTensor* protocol (a plain local tensor carrying ``global_shape``,
``global_offsets``, ``local_offsets``, ``local_sizes``) and not DTensor or ShardedTensor: a DTensor
placement cannot say "rows {0..7, 32..39, 64..71}" (qkv by heads) nor the index lists of a 2D layout,
and a ShardedTensor needs non-overlapping shards over one process group (dp replicas hold equal shards)
and is deprecated.  The protocol takes several boxes of one local tensor as they are, and DCP's own
resharding (``create_read_items_for_chunk_list``) then reads, on any mesh, only the byte ranges of the
saved chunks that overlap each box this rank holds (each such chunk is read whole, then narrowed).

Communication: the call gate first (every rank enters the same call with the same directory), then
DCP's collectives (plan gather/scatter, the final all-reduce), which DCP issues in the same order on
every rank, on a gloo group of the whole world whose timeout is the module's ``timeout_s`` (they are
not ours to route through the Watchdog; a gloo group keeps them off NCCL's stream), then one
``gather_rows`` (through the Watchdog) in which rank 0 reports whether its commit succeeded.
"""
from __future__ import annotations

import os
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from autosplit.errors import AutosplitError
from autosplit.runtime.agreement import plan_fingerprint
from autosplit.runtime.checkpoint_files import (OPTIMIZER_PREFIX, commit, read_record, resolve,
                                                version_name)
from autosplit.runtime.exchange import gather_rows, nonce
from autosplit.runtime.state_dict import local_tensors
from autosplit.tp.shards import ShardedParam

FORMAT = "autosplit-checkpoint-1"
_STATE, _GROUP = OPTIMIZER_PREFIX + "state/", OPTIMIZER_PREFIX + "group/"


def _entry(t: torch.Tensor, info: ShardedParam | None, tp_rank: int) -> torch.Tensor | None:
    """This rank's part of ``t`` as a DCP entry: a view of its local storage (DCP writes a load into
    it) tagged with its chunks; ``t`` itself's view for a whole tensor; None when it holds nothing."""
    slices = dict(info.slices[tp_rank]) if info is not None else {}
    full_shape = tuple(info.full_shape) if info is not None else tuple(t.shape)
    local = t.to_local() if isinstance(t, DTensor) else t
    if isinstance(t, DTensor):          # a block of the tp shard: narrow each dim's indices to it
        sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        for d, (size, offset) in enumerate(zip(sizes, offsets)):
            if size != t.shape[d]:
                slices[d] = slices.get(d, torch.arange(full_shape[d]))[offset:offset + size]
    view = local.detach()
    if not slices:
        return view
    if local.numel() == 0:
        return None
    boxes = ShardedParam("", full_shape, [slices]).boxes(0)
    view.global_shape = full_shape
    view.global_offsets = tuple(b[0] for b in boxes)
    view.local_sizes = tuple(b[1] for b in boxes)
    view.local_offsets = tuple(b[2] for b in boxes)
    return view


def _sharded(pm) -> dict:
    return pm.plan.tp_plan.sharded if pm.plan.tp_plan is not None else {}


def _put(out: dict, key: str, t: torch.Tensor, info, tp_rank: int) -> None:
    entry = _entry(t, info, tp_rank)
    if entry is not None:
        out[key] = entry


def _local_entries(pm) -> dict[str, torch.Tensor]:
    """This rank's model tensors under their original names (persistent ones: the state dict's)."""
    keys, sharded = set(pm.model.state_dict().keys()), _sharded(pm)
    out = {}
    for name, t in local_tensors(pm.raw_modules).items():
        if name in keys:
            _put(out, name, t, sharded.get(name), pm.tp_rank)
    return out


def _param_names(pm, optimizer) -> tuple[dict[int, str], str | None]:
    """id(parameter) -> name, and a problem if the optimizer holds a tensor that is not this rank's.
    Reads the stage modules directly: no lazy planning (which communicates) before the call gate."""
    names = {id(p): n for m in pm.raw_modules for n, p in m.named_parameters()}
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in names:
                return names, (f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not one of "
                               f"pm.parameters(); build it as torch.optim.X(pm.parameters(), ...)")
    return names, None


def _optimizer_entries(pm, optimizer, names: dict[int, str]) -> tuple[dict, str | None]:
    sharded, out = _sharded(pm), {}
    for g in optimizer.param_groups:
        hyper = {k: v for k, v in g.items() if k != "params"}
        for p in g["params"]:
            name = names[id(p)]
            out[_GROUP + name] = pickle.dumps(hyper)       # one bytes entry (DCP would flatten a dict)
            for key, value in optimizer.state.get(p, {}).items():
                entry = f"{_STATE}{name}/{key}"
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    out[entry] = value                      # replicated: a scalar or a Python value
                elif value.shape == p.shape:
                    _put(out, entry, value, sharded.get(name), pm.tp_rank)
                else:
                    return out, (f"optimizer state '{key}' of '{name}' has shape {tuple(value.shape)}, neither the "
                                 f"parameter's {tuple(p.shape)} nor a scalar; only per-element optimizer state "
                                 f"(SGD momentum, Adam moments) can be saved for resharding")
    return out, None


def _dcp_group(pm):
    """A gloo group over the world for DCP's collectives, made once (a collective call: every rank
    makes it at the same point, its first save or load, right after the call gate)."""
    if pm._owned.dcp_group is None:        # released with the module's other groups
        pm._owned.dcp_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=pm.world.timeout_s))
    return pm._owned.dcp_group


def _record(pm, optimizer) -> dict:
    mesh = pm.world.mesh
    return {"format": FORMAT, "step": pm.step_count, "mesh": [mesh.pp, mesh.tp, mesh.dp], "tp_mode": pm.tp_mode,
            "schedule": pm.schedule, "chunks_per_rank": pm.chunks_per_rank,
            "plan_hash": f"{plan_fingerprint(pm.plan):016x}",
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "torch": torch.__version__}


def _enter(pm, call: str, directory, optimizer, problem: str | None) -> None:
    text = f"directory={os.fspath(directory)!r}, optimizer={type(optimizer).__name__ if optimizer else None}"
    pm.gate.enter(call, text, text, problem)
    pm._require_plan(f"{call}()")
    pm._agree()


def save_checkpoint(pm, directory, optimizer=None) -> str:
    """Every rank writes its shards of the model (and of ``optimizer``'s state) into a new version of
    ``directory``; rank 0 commits it.  Returns the version's path.  See the module docstring."""
    directory = os.fspath(directory)
    names, problem = _param_names(pm, optimizer) if optimizer is not None else ({}, None)
    extra = {}
    if optimizer is not None and problem is None:      # pm has a plan: the optimizer holds its parameters
        extra, problem = _optimizer_entries(pm, optimizer, names)
    _enter(pm, "save_checkpoint", directory, optimizer, problem)
    state = {**_local_entries(pm), **extra}
    group = _dcp_group(pm)
    name = version_name(pm.step_count, gather_rows(pm.world, pm.watchdog, [nonce()], "checkpoint name")[0][0])
    path = os.path.join(directory, name)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), process_group=group)
    error = None
    if pm.world.rank == 0:
        try:
            commit(directory, name, _record(pm, optimizer))
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    failed = gather_rows(pm.world, pm.watchdog, [int(error is not None)], "checkpoint commit")[0][0]
    if failed:
        raise AutosplitError(f"save_checkpoint: rank 0 could not commit '{path}'"
                             + (f": {error}" if error else "") + "; the previous checkpoint is unchanged")
    return path


def _load_problem(pm, metadata, optimizer) -> str | None:
    """Keys or full shapes of the model that the checkpoint lacks (the same answer on every rank)."""
    saved = metadata.state_dict_metadata
    for name, t in pm.model.state_dict().items():
        md = saved.get(name)
        if md is None or isinstance(md, BytesStorageMetadata):
            return f"load_checkpoint: the checkpoint has no tensor '{name}' (was it saved from another model?)"
        if tuple(md.size) != tuple(t.shape):
            return f"load_checkpoint: '{name}' has shape {tuple(md.size)} in the checkpoint, the model has {tuple(t.shape)}"
    if optimizer is not None and not any(k.startswith(OPTIMIZER_PREFIX) for k in saved):
        return "load_checkpoint: the checkpoint holds no optimizer state (it was saved without optimizer=)"
    return None


def _optimizer_targets(pm, optimizer, names, metadata) -> tuple[dict, dict]:
    """(DCP entries, state tensors): empty tensors (or placeholders) DCP fills with this rank's part of
    the saved state, and the tensors the optimizer gets (a DTensor whose local part is an entry)."""
    sharded, saved, out, targets = _sharded(pm), metadata.state_dict_metadata, {}, {}
    by_param: dict[str, list[str]] = {}
    for entry in saved:
        if entry.startswith(_STATE):
            by_param.setdefault(entry[len(_STATE):].rpartition("/")[0], []).append(entry)
    for g in optimizer.param_groups:
        for p in g["params"]:
            name = names[id(p)]
            if _GROUP + name in saved:
                out[_GROUP + name] = None
            for entry in by_param.get(name, []):
                md = saved[entry]
                if isinstance(md, BytesStorageMetadata):
                    out[entry] = None
                elif len(md.size) == 0:
                    out[entry] = torch.empty((), dtype=md.properties.dtype)
                else:                       # like the parameter: a DTensor for an FSDP-sharded one
                    target = torch.empty_like(p, dtype=md.properties.dtype)
                    targets[entry] = target
                    _put(out, entry, target, sharded.get(name), pm.tp_rank)
    return out, targets


def _load_optimizer(optimizer, names: dict[int, str], loaded: dict) -> None:
    """Hand the loaded state to ``optimizer.load_state_dict`` (its own device and dtype rules)."""
    state, groups, index = {}, [], 0
    for g in optimizer.param_groups:
        ids, hyper = [], None
        for p in g["params"]:
            name = names[id(p)]
            prefix = f"{_STATE}{name}/"
            values = {k[len(prefix):]: v for k, v in loaded.items() if k.startswith(prefix)}
            if values:
                state[index] = values
            if hyper is None and loaded.get(_GROUP + name) is not None:
                hyper = pickle.loads(loaded[_GROUP + name])
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in g.items() if k != "params"}, **(hyper or {}), "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def load_checkpoint(pm, directory, optimizer=None) -> dict:
    """Every rank reads the parts of the committed version of ``directory`` that its shards (and its
    optimizer state) cover, saved on any mesh, tp mode or schedule.  Returns the record."""
    names, problem = _param_names(pm, optimizer) if optimizer is not None else ({}, None)
    path, reader, metadata = None, None, None
    if problem is None:
        try:
            path = resolve(directory)
            reader = dcp.FileSystemReader(path)
            metadata = reader.read_metadata()
            problem = _load_problem(pm, metadata, optimizer)
        except (AutosplitError, OSError) as exc:
            problem = str(exc)
    _enter(pm, "load_checkpoint", directory, optimizer, problem)
    state = _local_entries(pm)
    entries, targets = _optimizer_targets(pm, optimizer, names, metadata) if optimizer is not None else ({}, {})
    state.update(entries)
    dcp.load(state, storage_reader=reader, process_group=_dcp_group(pm))
    if optimizer is not None:
        _load_optimizer(optimizer, names, {**{k: state[k] for k in entries}, **targets})
    record = read_record(path)
    pm.step_count = record.get("step", pm.step_count)
    pm._params_agreed = True        # the values came from one checkpoint; the model object is not whole
    return record
