"""The rest of a job's state in a checkpoint: the fp16 loss scale, every rank's random state, the extras.

Terms:
  loss scaler -- ``loss_scaler.scale`` and ``loss_scaler.growth_tracker`` (runtime/state/loss_scaler.py), saved
                 when fp16 autocast scales the loss (the same on every rank); restored when the loading
                 module scales too (a bf16 or fp32 checkpoint leaves an fp16 job's initial scale).
  random state -- ``rng.rank_<r>.cpu`` (and ``.cuda`` on GPUs): each rank's generators (autosplit/tp/
                 random.py's ``generator_states``; the per-tp-rank forks derive from them).  On the SAME
                 mesh rank r gets rank r's state back: dropout masks continue exactly.  On another mesh a
                 rank's saved stream has no counterpart (other stages, other tp slices draw from it), so
                 every rank takes rank 0's: the masks differ from an uninterrupted run but never repeat
                 the ones drawn before the save, and every tp rank of a group shares one default stream
                 as tensor parallelism needs (a replicated activation's mask must be the same on each).
  extra       -- ``extra={"name": stateful}``: any ``torch.distributed.checkpoint.stateful.Stateful``
                 (an LR scheduler, a stateful data loader), saved under its name by its
                 ``state_dict()`` and given back to its ``load_state_dict``.  Its *layout* follows what
                 the ranks hold, found at save time by comparing a digest of each rank's state:
                   replicated  -- the same on every rank (a scheduler): ``name.<key>``; loads on any mesh;
                   per_replica -- the same within each dp replica (a loader reading the replica's rows):
                                  ``name.dp_rank_<k>.<key>``; loads where dp is the same;
                   per_rank    -- otherwise: ``name.rank_<r>.<key>``; loads on the same mesh only.
                 The record (autosplit.json) names each extra's layout.  DCP stores Python values as its own
                 byte entries and gives dict keys back as strings.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from torch.distributed.checkpoint._traverse import get_element, set_element
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from autosplit.runtime.faults.exchange import gather_rows
from autosplit.runtime.state.checkpoint_files import entry_paths
from autosplit.tp.random import generator_states, set_generator_states

SCALER, RNG = "loss_scaler", "rng"
RESERVED = ("optimizer", SCALER, RNG)


def extra_problem(extra, model_keys) -> str | None:
    """Why ``extra`` cannot be saved or loaded (checked on every rank before the call gate), or None."""
    if extra is None:
        return None
    if not isinstance(extra, Mapping):
        return f"extra= must be a dict {{name: Stateful}}, not a {type(extra).__name__}"
    for name, obj in extra.items():
        if not isinstance(name, str) or not name:
            return f"extra= names must be non-empty strings, not {name!r}"
        if name in RESERVED:
            return f"extra name '{name}' is taken by the checkpoint's own {name} state; choose another"
        clash = next((k for k in model_keys if k == name or k.startswith(name + ".")), None)
        if clash is not None:
            return f"extra name '{name}' clashes with the model's '{clash}'; choose another"
        if not isinstance(obj, Stateful):
            return (f"extra['{name}'] is a {type(obj).__name__}, not a torch.distributed.checkpoint.stateful."
                    f"Stateful (it needs state_dict() and load_state_dict())")
    return None


def _digest(value, h) -> None:
    if isinstance(value, Mapping):
        h.update(b"{")
        for k in sorted(value, key=repr):
            h.update(repr(k).encode())
            _digest(value[k], h)
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for v in value:
            _digest(v, h)
        h.update(b"]")
    elif isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(value.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    else:
        h.update(repr(value).encode())


def digest(value) -> int:
    h = hashlib.sha256()
    _digest(value, h)
    return int.from_bytes(h.digest()[:8], "little") >> 1


def _layout(pm, values: list[int]) -> str:
    """See *extra*: from every rank's digest of one extra."""
    if len(set(values)) == 1:
        return "replicated"
    replica = {}
    for r, v in enumerate(values):
        replica.setdefault(pm.world.mesh.coord_of(r).dp, set()).add(v)
    return "per_replica" if all(len(vs) == 1 for vs in replica.values()) else "per_rank"


def _sub(pm, layout: str) -> tuple:
    """The path under an extra's name where this rank's state of ``layout`` lives."""
    return {"replicated": (), "per_replica": (f"dp_rank_{pm.dp_rank}",),
            "per_rank": (f"rank_{pm.world.rank}",)}[layout]


def save_entries(pm, extra) -> tuple[dict, dict]:
    """(DCP state dict part, record part) of the loss scaler, this rank's random state and the extras.
    One gather_rows (the extras' digests), after the call gate."""
    state: dict = {RNG: {f"rank_{pm.world.rank}": generator_states(pm.world.device)}}
    if pm.scaler.enabled:
        state[SCALER] = pm.scaler.state_dict()
    names = sorted(extra or {})
    states = {n: extra[n].state_dict() for n in names}
    rows = gather_rows(pm.world, pm.watchdog, [digest(states[n]) for n in names] or [0], "checkpoint extras")
    layouts = {n: _layout(pm, [r[i] for r in rows]) for i, n in enumerate(names)}
    for n in names:
        sub = _sub(pm, layouts[n])
        state[n] = {sub[0]: states[n]} if sub else states[n]
    return state, {"extra": layouts, "rng": "per_rank"}


def _template(metadata, prefix: tuple, root: dict) -> bool:
    """Put into ``root`` an empty target for every saved entry under ``prefix`` (from the checkpoint's
    own metadata, so the structure is the saved one); whether there was any."""
    found = False
    for key, path in entry_paths(metadata).items():
        md = metadata.state_dict_metadata[key]
        if path[:len(prefix)] == prefix:
            set_element(root, path, None if isinstance(md, BytesStorageMetadata) else
                        torch.empty(md.size, dtype=md.properties.dtype))
            found = True
    return found


def _saved_mesh(record: dict) -> str:
    return "({}, {}, {})".format(*record["mesh"]) if record.get("mesh") else "an unknown mesh"


def _mesh(pm) -> list[int]:
    m = pm.world.mesh
    return [m.pp, m.tp, m.dp]


def load_problem(pm, record: dict, extra) -> str | None:
    """Why the extras cannot be loaded here (the same answer on every rank: the record and the mesh)."""
    layouts = record.get("extra", {})
    for name in sorted(extra or {}):
        layout = layouts.get(name)
        if layout is None:
            return (f"load_checkpoint: the checkpoint holds no extra '{name}' (it holds "
                    f"{', '.join(repr(n) for n in sorted(layouts)) or 'none'}); save it with extra={{'{name}': ...}}")
        saved = record.get("mesh") or [None, None, None]
        if layout == "per_replica" and saved[2] != pm.dp_size:
            return (f"load_checkpoint: extra '{name}' differed between the data-parallel replicas when it was saved "
                    f"on {_saved_mesh(record)} (dp={saved[2]}), so each replica's state loads only with dp={saved[2]}; "
                    f"this mesh has dp={pm.dp_size}: build a fresh '{name}' for dp={pm.dp_size}, or leave it out")
        if layout == "per_rank" and saved != _mesh(pm):
            here = "({}, {}, {})".format(*_mesh(pm))
            return (f"load_checkpoint: extra '{name}' differed between ranks of one data-parallel replica when it was "
                    f"saved on {_saved_mesh(record)}, so it loads only on that mesh, not on {here}")
    return None


def load_targets(pm, metadata, record: dict, extra, root: dict) -> list:
    """Put into ``root`` the targets of the scaler, this rank's random state and the extras; returns
    the (path, apply) pairs ``apply_loaded`` runs once DCP has filled them."""
    todo = []
    if pm.scaler.enabled and _template(metadata, (SCALER,), root):
        todo.append(((SCALER,), pm.scaler.load_state_dict))
    same_mesh = record.get("mesh") == _mesh(pm)
    source = (RNG, f"rank_{pm.world.rank}" if same_mesh else "rank_0")    # see *random state*
    if _template(metadata, source, root):
        todo.append((source, lambda s: set_generator_states(s, pm.world.device)))
    for name in sorted(extra or {}):
        path = (name, *_sub(pm, record["extra"][name]))
        _template(metadata, path, root)
        todo.append((path, extra[name].load_state_dict))
    return todo


def apply_loaded(root: dict, todo: list) -> None:
    for path, apply in todo:
        apply(get_element(root, path, {}))
