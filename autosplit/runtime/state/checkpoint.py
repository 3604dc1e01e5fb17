"""Sharded checkpoints with torch.distributed.checkpoint (DCP): each rank writes and reads only its part.

Terms:
  entry      -- one key of the DCP state dict (DCP flattens nested dicts to dotted keys and keeps each
                key's path).  The model's tensors are top-level keys under the original names and full
                shapes (``blocks.0.attn.qkv.weight``), each rank writing its chunks
                (checkpoint_chunks.py); the rest is nested under a name:
                  optimizer     -- torch's own layout, by parameter name (checkpoint_optimizer.py);
                  loss_scaler   -- the fp16 loss scale and its growth counter;
                  rng           -- every rank's random state, ``rng.rank_<r>``;
                  <extra name>  -- each ``extra=`` Stateful's state (checkpoint_state.py).
  record     -- ``autosplit.json`` in the version: step, mesh, tp mode, schedule, plan hash, the extras'
                layouts.
  exact resume -- on the same mesh, a loaded job continues bit for bit as if it had not stopped
                (model, optimizer, loss scale, random streams, extras); on another mesh everything but
                the random streams is restored exactly (see checkpoint_state.py's *random state*).
Layout on disk and the atomic commit: checkpoint_files.py.

Communication: the call gate first (every rank enters the same call with the same directory, extras and
what it found on disk), then on save one all_gather_object of the optimizer's group names and one
gather_rows of the extras' digests, then DCP's collectives (plan gather/scatter, the final all-reduce),
which DCP issues in the same order on every rank, on a gloo group of the whole world whose timeout is
the module's ``timeout_s`` (they are not ours to route through the Watchdog; a gloo group keeps them off
NCCL's stream), then one ``gather_rows`` (through the Watchdog) in which rank 0 reports whether its
commit succeeded.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from autosplit.errors import AutosplitError
from autosplit.runtime.faults.agreement import plan_fingerprint
from autosplit.runtime.faults.exchange import gather_rows, nonce
from autosplit.runtime.state import checkpoint_optimizer as optim_layout
from autosplit.runtime.state import checkpoint_state, safe_load
from autosplit.runtime.state.checkpoint_chunks import model_entries
from autosplit.runtime.state.checkpoint_files import commit, latest_checkpoint, read_record, resolve, version_name

FORMAT = "autosplit-checkpoint-2"     # 1: the optimizer under optimizer/state/... keys, pickled groups


def _dcp_group(pm):
    """A gloo group over the world for DCP's collectives, made once (a collective call: every rank
    makes it at the same point, its first save or load, right after the call gate)."""
    if pm._owned.dcp_group is None:        # released with the module's other groups
        pm._owned.dcp_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=pm.world.timeout_s))
    return pm._owned.dcp_group


def _record(pm, optimizer, more: dict) -> dict:
    mesh = pm.world.mesh
    return {**more, "format": FORMAT, "step": pm.step_count, "mesh": [mesh.pp, mesh.tp, mesh.dp], "tp_mode": pm.tp_mode,
            "schedule": pm.schedule, "chunks_per_rank": pm.chunks_per_rank,
            "plan_hash": f"{plan_fingerprint(pm.plan):016x}",
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "torch": torch.__version__}


def _enter(pm, call: str, directory, optimizer, extra, problem: str | None, found: str = "") -> None:
    """The call gate: every rank in the same call with the same directory, optimizer type, extras (and,
    for a load, the same committed version found), then the plan and model agreement."""
    names = sorted(map(str, extra)) if isinstance(extra, dict) else extra
    text = (f"directory={os.fspath(directory)!r}, optimizer={type(optimizer).__name__ if optimizer else None}, "
            f"extra={names}{found}")
    pm.gate.enter(call, text, text, problem)
    pm._require_plan(f"{call}()")
    pm._agree()


def save_checkpoint(pm, directory, optimizer=None, extra=None) -> str:
    """Every rank writes its shards of the model (and of ``optimizer``'s state), the loss scale, its random
    state and the ``extra`` Statefuls into a new version of ``directory``; rank 0 commits it.  Returns the
    version's path.  See the module docstring."""
    directory = os.fspath(directory)
    names, problem = optim_layout.param_names(pm, optimizer) if optimizer is not None else ({}, None)
    opt_state = {}
    if optimizer is not None and problem is None:      # pm has a plan: the optimizer holds its parameters
        opt_state, problem = optim_layout.state_entries(pm, optimizer, names)
    problem = problem or checkpoint_state.extra_problem(extra, pm.model.state_dict().keys())
    _enter(pm, "save_checkpoint", directory, optimizer, extra, problem)
    group = _dcp_group(pm)
    state = model_entries(pm)
    if optimizer is not None:
        state[optim_layout.KEY] = {"state": opt_state,
                                   "param_groups": optim_layout.merged_groups(pm, optimizer, names, group)}
    more, more_record = checkpoint_state.save_entries(pm, extra)
    state.update(more)
    name = version_name(pm.step_count, gather_rows(pm.world, pm.watchdog, [nonce()], "checkpoint name")[0][0])
    path = os.path.join(directory, name)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), process_group=group)
    error = None
    if pm.world.rank == 0:
        try:
            commit(directory, name, _record(pm, optimizer, more_record))
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    failed = gather_rows(pm.world, pm.watchdog, [int(error is not None)], "checkpoint commit")[0][0]
    if failed:
        raise AutosplitError(f"save_checkpoint: rank 0 could not commit '{path}'"
                             + (f": {error}" if error else "") + "; the previous checkpoint is unchanged")
    return path


def _model_problem(pm, metadata) -> str | None:
    """Keys or full shapes of the model that the checkpoint lacks (the same answer on every rank)."""
    saved = metadata.state_dict_metadata
    for name, t in pm.model.state_dict().items():
        md = saved.get(name)
        if md is None or isinstance(md, BytesStorageMetadata):
            return f"load_checkpoint: the checkpoint has no tensor '{name}' (was it saved from another model?)"
        if tuple(md.size) != tuple(t.shape):
            return f"load_checkpoint: '{name}' has shape {tuple(md.size)} in the checkpoint, the model has {tuple(t.shape)}"
    return None


def _load_problem(pm, metadata, record: dict, optimizer, extra) -> str | None:
    problem = _model_problem(pm, metadata)
    if problem is None and optimizer is not None:
        problem = optim_layout.saved_problem(metadata)
        if problem and record.get("format") == "autosplit-checkpoint-1":
            problem = ("load_checkpoint: the checkpoint was saved by an earlier autosplit (format 1), whose "
                       "optimizer layout this version does not read; load it without optimizer=")
    return problem or checkpoint_state.load_problem(pm, record, extra)


def load_checkpoint(pm, directory, optimizer=None, extra=None, missing_ok: bool = False) -> dict | None:
    """Every rank reads the parts of the committed version of ``directory`` that its shards (its optimizer
    state, its random state, the extras) cover, saved on any mesh, tp mode or schedule.  Returns the
    record; None (on every rank) when ``missing_ok`` and ``directory`` holds no committed checkpoint yet."""
    names, problem = optim_layout.param_names(pm, optimizer) if optimizer is not None else ({}, None)
    problem = problem or checkpoint_state.extra_problem(extra, pm.model.state_dict().keys())
    path, reader, metadata, record = None, None, None, {}
    if problem is None:
        try:
            if missing_ok and latest_checkpoint(directory) is None:
                path = None
            else:
                path = resolve(directory)
                reader = safe_load.SafeReader(path)      # no pickle in it runs code: see safe_load.py
                metadata = reader.read_metadata()
                record = read_record(path)
                problem = _load_problem(pm, metadata, record, optimizer, extra)
        except (AutosplitError, OSError) as exc:
            problem = str(exc)
    found = f", found={os.path.basename(path) if path else None}"   # every rank must see the same version
    _enter(pm, "load_checkpoint", directory, optimizer, extra, problem, found)
    if path is None:
        return None
    state = model_entries(pm)
    targets = (optim_layout.load_targets(pm, optimizer, names, metadata, state) if optimizer is not None else {})
    todo = checkpoint_state.load_targets(pm, metadata, record, extra, state)
    safe_load.load(state, reader, process_group=_dcp_group(pm))
    if optimizer is not None:
        optim_layout.load_into(optimizer, names, state.get(optim_layout.KEY, {}), targets)
    checkpoint_state.apply_loaded(state, todo)
    pm.step_count = record.get("step", pm.step_count)
    pm._params_agreed = True        # the values came from one checkpoint; the model object is not whole
    return record
