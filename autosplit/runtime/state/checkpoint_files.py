"""A checkpoint directory on disk: versions, the atomic commit, and export to a plain state dict.

Terms:
  checkpoint directory -- what ``save_checkpoint(directory)`` is given.  It holds:
        LATEST                         the name of the committed version (one line)
        step-00000004-<nonce>/         one torch.distributed.checkpoint (DCP) directory: .metadata,
                                       one data file per rank, autosplit.json (the metadata record)
  version   -- one save: a fresh subdirectory, so a save never overwrites the files of the version
               that LATEST names.
  commit    -- after every rank has written its data and DCP has written ``.metadata``, rank 0 writes
               ``autosplit.json`` and replaces LATEST atomically (write a temporary file, fsync,
               ``os.replace``, fsync the directory).  A crash before that leaves LATEST naming the
               previous version; the interrupted version is *incomplete* and is ignored (with a
               warning that names it) until the next successful save removes it.  A crash after the
               commit but before the removal leaves the previous version *superseded*: complete, older,
               ignored without a warning.
  committed -- the version LATEST names (``latest_checkpoint``); None before the first commit, which is
               how a job resumes only if there is something to resume from.
  model keys -- the checkpoint's top-level tensor entries, under the original model's names (full
               shapes); the rest is nested under a name (``optimizer``, ``rng``, ...: see checkpoint.py).
               A first-format checkpoint kept its optimizer under ``optimizer/...`` keys.
A plain DCP directory (``.metadata`` directly inside) is accepted too.  No process group here.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from autosplit.errors import AutosplitError
from autosplit.runtime.state.safe_load import SafeReader
from autosplit.runtime.state.safe_load import load as safe_load

LATEST = "LATEST"
RECORD = "autosplit.json"
OPTIMIZER_PREFIX = "optimizer/"
_VERSION = re.compile(r"step-\d+-[0-9a-f]+$")


def version_name(step: int, nonce: int) -> str:
    return f"step-{step:08d}-{nonce:016x}"


def _versions(directory: str) -> list[str]:
    if not os.path.isdir(directory):
        return []
    return sorted(d for d in os.listdir(directory) if _VERSION.match(d) and os.path.isdir(os.path.join(directory, d)))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(directory: str, version: str, record: dict) -> None:
    """Rank 0, after DCP finished writing ``version``: write its record, point LATEST at it
    atomically, then remove every other version (the previous one and any incomplete ones)."""
    path = os.path.join(directory, version)
    with open(os.path.join(path, RECORD), "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    tmp = os.path.join(directory, f".{LATEST}.{version}.tmp")
    with open(tmp, "w") as f:
        f.write(version + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, LATEST))        # the commit point
    _fsync_dir(directory)
    for old in _versions(directory):
        if old != version:
            shutil.rmtree(os.path.join(directory, old), ignore_errors=True)


def _step(version: str) -> int:
    return int(version.split("-")[1])


def _complete(path: str) -> bool:
    """DCP wrote ``.metadata`` (after every rank's data) and rank 0 its record: nothing is missing."""
    return os.path.isfile(os.path.join(path, ".metadata")) and os.path.isfile(os.path.join(path, RECORD))


def latest_checkpoint(directory) -> str | None:
    """The committed checkpoint in ``directory`` (the version ``LATEST`` names; ``directory`` itself for
    a plain DCP directory), or None when there is none yet: no directory, or only versions whose save
    never committed.  No process group; every rank may call it, e.g. to resume only if a checkpoint exists.

    Args:
        directory: the directory given to ``save_checkpoint``.
    Raises AutosplitError when ``LATEST`` names a version that is missing or incomplete (a directory
    changed by hand): starting afresh would silently throw the run away.
    """
    directory = os.fspath(directory)
    if os.path.isfile(os.path.join(directory, ".metadata")):
        return directory
    latest_file = os.path.join(directory, LATEST)
    if not os.path.isfile(latest_file):
        return None
    with open(latest_file) as f:
        latest = f.read().strip()
    path = os.path.join(directory, latest)
    if not _complete(path):
        raise AutosplitError(f"'{directory}/{LATEST}' names '{latest}', which is missing or incomplete (was the "
                             f"directory changed by hand?)")
    return path


def resolve(directory) -> str:
    """The DCP directory to load from ``directory`` (a checkpoint directory or a plain DCP one).
    Raises AutosplitError with what is wrong; warns about incomplete versions it skips.  A complete
    version older than the committed one is not warned about: it is the previous checkpoint, superseded,
    whose removal after the commit did not finish (the next save removes it)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise AutosplitError(f"load_checkpoint: no checkpoint at '{directory}' (not a directory)")
    try:
        path = latest_checkpoint(directory)
    except AutosplitError as exc:
        raise AutosplitError(f"load_checkpoint: {exc}") from None
    versions = _versions(directory)
    if path is None:
        if versions:
            raise AutosplitError(
                f"load_checkpoint: '{directory}' holds no complete checkpoint: {', '.join(versions)} "
                f"{'was' if len(versions) == 1 else 'were'} never committed (the save was interrupted before "
                f"every rank had written its shards); load an earlier checkpoint, or pass missing_ok=True to "
                f"start afresh")
        raise AutosplitError(f"load_checkpoint: '{directory}' is not a checkpoint (no {LATEST} file, no versions)")
    latest = os.path.basename(path)
    if path == directory:
        return path
    incomplete = [v for v in versions if v != latest and not _complete(os.path.join(directory, v))]
    uncommitted = [v for v in versions if v != latest and v not in incomplete and _step(v) > _step(latest)]
    if incomplete:
        warnings.warn(f"load_checkpoint: ignoring incomplete checkpoint{'s' if len(incomplete) > 1 else ''} "
                      f"{', '.join(incomplete)} in '{directory}' (a save interrupted before its commit); loading "
                      f"the committed '{latest}'", stacklevel=3)
    if uncommitted:
        warnings.warn(f"load_checkpoint: ignoring {', '.join(uncommitted)} in '{directory}': written completely "
                      f"but never committed (interrupted between its record and {LATEST}); loading the committed "
                      f"'{latest}'", stacklevel=3)
    return path


def read_record(path: str) -> dict:
    """The metadata record of a resolved version ({} for a plain DCP directory)."""
    record = os.path.join(path, RECORD)
    if not os.path.isfile(record):
        return {}
    with open(record) as f:
        return json.load(f)


def entry_paths(metadata) -> dict[str, tuple]:
    """Every saved entry's path in the nested state dict it was saved from: DCP's flat key -> the path its
    default planner kept in ``metadata.planner_data``, or ``(key,)`` where it kept none (a checkpoint
    written without flattening, or a top-level entry)."""
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return {key: tuple(paths.get(key, (key,))) for key in metadata.state_dict_metadata}


def is_model_key(key: str, path: tuple) -> bool:
    """A model tensor's entry (``path`` from ``entry_paths``): a top-level key (everything else is nested
    under its part's name, ``optimizer``, ``rng``, ``loss_scaler`` or an extra's), not the optimizer of a
    first-format checkpoint."""
    return len(path) == 1 and not key.startswith(OPTIMIZER_PREFIX)


def export_state_dict(directory, out) -> dict[str, torch.Tensor]:
    """Write the model's full state dict (original names and shapes, CPU tensors) from a checkpoint
    to ``out`` with ``torch.save``; ``model.load_state_dict`` of the unchanged model accepts it.
    Reads the model keys only (not the optimizer state); needs no process group."""
    path = resolve(directory)
    reader = SafeReader(path)       # no pickle in it runs code: see safe_load.py
    metadata = reader.read_metadata()
    paths = entry_paths(metadata)
    state = {k: torch.empty(md.size, dtype=md.properties.dtype)
             for k, md in metadata.state_dict_metadata.items()
             if isinstance(md, TensorStorageMetadata) and is_model_key(k, paths[k])}
    safe_load(state, reader, no_dist=True)
    torch.save(state, out)
    return state
