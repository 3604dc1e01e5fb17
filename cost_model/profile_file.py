"""A DeviceProfile as a JSON file: what ``python -m autosplit profile --out`` writes and ``device=`` reads.

Terms:
  file     -- one JSON object: ``"format"`` (FORMAT, the layout's version), ``"source"`` (a short line on what
              measured it: host, device name, torch version, date) and every DeviceProfile field by its name:
              dtypes by name (``"peak_flops": {"float16": 9.89e14, ...}``), tuples as lists, ``compute``
              as measured.compute_to_json writes it, ``comm`` as ``{"all_reduce/8": [alpha, beta], ...}``
              (keys: measured.comm_key), None as null.  A rate measured as unbounded (a view's fit) is
              written ``Infinity``, which Python's json reads back.
  strict   -- reading refuses what it cannot vouch for, naming the path and the field: a missing file, text
              that is not JSON, another ``format``, a field DeviceProfile does not have, a required field
              missing, a dtype name torch does not know, a value of the wrong kind.  Fields that DeviceProfile
              gives a default may be left out (a hand-written file states only what it knows).
  equal    -- ``read(write(path, p))`` == p: every field comes back with the type it went in with.
The measured-profile cache (profile_cache.py) stores the same object, plus its key.  Pure: files and
dicts only, no process group, no device.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import socket
from dataclasses import MISSING, asdict, fields
from pathlib import Path

import torch

from autosplit.cost_model.device import DeviceProfile
from autosplit.cost_model.measured import compute_from_json, compute_to_json
from autosplit.errors import AutosplitError

FORMAT = 1
META = ("format", "source")      # the file's own entries beside the profile's fields


def is_path(device) -> bool:
    """Whether ``device=`` names a profile file: an os.PathLike, or a str ending in ".json"."""
    return isinstance(device, os.PathLike) or (isinstance(device, str) and device.lower().endswith(".json"))


def source_line(device="cpu") -> str:
    """What measured a profile here and now: host, device name (the CPU's where no GPU is present), torch
    version, date (UTC)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        what = torch.cuda.get_device_name(device)
    else:
        what = f"{platform.processor() or platform.machine()} cpu, {os.cpu_count()} cores"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"{socket.gethostname()}, {what}, torch {torch.__version__}, {date}"


def to_dict(profile: DeviceProfile) -> dict:
    """The profile's fields as JSON values (see *file*)."""
    d = asdict(profile)
    d["peak_flops"] = {str(k).removeprefix("torch."): v for k, v in profile.peak_flops.items()}
    d["compute"] = compute_to_json(profile.compute)
    d["comm"] = None if profile.comm is None else {k: list(v) for k, v in profile.comm.items()}
    for name in ("sharing", "resume"):
        d[name] = None if d[name] is None else list(d[name])
    return d


def _number(where: str, name: str, value, none: bool = False):
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AutosplitError(f"{where}: field {name!r} is {value!r}; expected a number{' or null' if none else ''}")
    return value


def _numbers(where: str, name: str, value, length: int | None = None) -> tuple:
    if not isinstance(value, (list, tuple)) or (length is not None and len(value) != length):
        raise AutosplitError(f"{where}: field {name!r} is {value!r}; expected a list of "
                             f"{length if length is not None else 'some'} numbers")
    return tuple(_number(where, name, v) for v in value)


def _dtype(where: str, name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise AutosplitError(f"{where}: field 'peak_flops' names dtype {name!r}, which torch does not have "
                             f"(e.g. 'float32', 'bfloat16', 'float16')")
    return dtype


def _comm_key(where: str, key) -> str:
    kind, _, span = key.partition("/") if isinstance(key, str) else ("", "", "")
    n, _, nodes = span.partition("@")
    if not (kind and n.isdigit() and (not nodes or nodes.isdigit())):
        raise AutosplitError(f"{where}: field 'comm' has key {key!r}; expected 'kind/n' or 'kind/n@nodes', "
                             f"e.g. 'all_reduce/8' or 'all_reduce/16@2'")
    return key


def from_dict(d: dict, where: str = "profile") -> DeviceProfile:
    """The DeviceProfile of ``to_dict``'s output (see *strict*); ``where`` starts every error message."""
    if not isinstance(d, dict):
        raise AutosplitError(f"{where}: expected a JSON object of DeviceProfile fields, got {type(d).__name__}")
    known = {f.name: f for f in fields(DeviceProfile)}
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise AutosplitError(f"{where}: unknown field{'s' if len(unknown) > 1 else ''} "
                             f"{', '.join(map(repr, unknown))}; DeviceProfile's fields: {', '.join(known)}")
    missing = [n for n, f in known.items() if n not in d and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise AutosplitError(f"{where}: missing field{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}")
    d = dict(d)
    if not isinstance(d["name"], str):
        raise AutosplitError(f"{where}: field 'name' is {d['name']!r}; expected a string")
    if not isinstance(d["peak_flops"], dict) or not d["peak_flops"]:
        raise AutosplitError(f"{where}: field 'peak_flops' is {d['peak_flops']!r}; expected {{dtype name: FLOP/s}}")
    d["peak_flops"] = {_dtype(where, k): _number(where, "peak_flops", v) for k, v in d["peak_flops"].items()}
    for name in ("mem_bandwidth", "link_bandwidth", "link_latency", "memory_bytes", "op_overhead", "p2p_post",
                 "p2p_wake", "pass_overhead", "gemm_efficiency", "gemm_half_dim", "attention_efficiency",
                 "bandwidth_efficiency", "allreduce_bandwidth", "network_bandwidth", "network_latency"):
        if name in d:
            _number(where, name, d[name])
    if d.get("gpus_per_node") is not None and (not isinstance(d["gpus_per_node"], int)
                                              or isinstance(d["gpus_per_node"], bool) or d["gpus_per_node"] < 1):
        raise AutosplitError(f"{where}: field 'gpus_per_node' is {d['gpus_per_node']!r}; expected a positive "
                             f"integer or null (the whole job on one node)")
    if d.get("device_type", "cuda") not in ("cuda", "cpu"):
        raise AutosplitError(f"{where}: field 'device_type' is {d['device_type']!r}; expected 'cuda' or 'cpu'")
    try:
        d["compute"] = compute_from_json(d.get("compute"))
    except (TypeError, ValueError, AttributeError):
        raise AutosplitError(f"{where}: field 'compute' is {d['compute']!r}; expected {{op class: "
                             f"[[alpha, rate], [alpha, rate]]}}") from None
    comm = d.get("comm")
    if comm is not None:
        if not isinstance(comm, dict):
            raise AutosplitError(f"{where}: field 'comm' is {comm!r}; expected {{'kind/n': [alpha, beta]}}")
        d["comm"] = {_comm_key(where, k): _numbers(where, "comm", v, 2) for k, v in comm.items()}
    if d.get("sharing") is not None:
        d["sharing"] = _numbers(where, "sharing", d["sharing"])
    if "resume" in d:
        d["resume"] = _numbers(where, "resume", d["resume"], 2)
    return DeviceProfile(**d)


def to_json(profile: DeviceProfile, source: str | None = None) -> dict:
    """The file's object (see *file*); ``source`` None: this host and process (``source_line``)."""
    return {"format": FORMAT, "source": source if source is not None else source_line(profile.device_type),
            **to_dict(profile)}


def write(path, profile: DeviceProfile, source: str | None = None, extra: dict | None = None) -> Path:
    """Write ``profile`` to ``path`` as a profile file, atomically (a temporary file renamed).

    Args:
        path: where (a str or os.PathLike); its directory must exist.
        profile: the DeviceProfile.
        source: the ``source`` line; None: this host and process.
        extra: more top-level entries (the cache's key); ``read`` refuses a file holding them.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**to_json(profile, source), **(extra or {})}, indent=1))
    os.replace(tmp, path)
    return path


def parse(data, where: str, allow: tuple = ()) -> tuple[DeviceProfile, str]:
    """(profile, source) of a file's loaded object; ``allow``: more top-level entries to skip."""
    if not isinstance(data, dict):
        raise AutosplitError(f"{where}: expected a JSON object, got {type(data).__name__}")
    if "format" not in data:
        raise AutosplitError(f"{where}: field 'format' is missing; a profile file states its format "
                             f"(this autosplit reads format {FORMAT}; python -m autosplit profile writes one)")
    if data["format"] != FORMAT:
        raise AutosplitError(f"{where}: field 'format' is {data['format']!r}; this autosplit reads format {FORMAT} "
                             f"(measure the profile again: python -m autosplit profile --out FILE)")
    source = data.get("source", "")
    if not isinstance(source, str):
        raise AutosplitError(f"{where}: field 'source' is {source!r}; expected a string")
    return from_dict({k: v for k, v in data.items() if k not in META + tuple(allow)}, where), source


def read_with_source(path) -> tuple[DeviceProfile, str]:
    """(profile, source line) of the profile file at ``path`` (see *strict*)."""
    where = f"profile file {os.fspath(path)!r}"
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise AutosplitError(f"{where}: no such file (resolved: {os.path.abspath(path)}); write one with "
                             f"python -m autosplit profile --out FILE") from None
    except OSError as exc:
        raise AutosplitError(f"{where}: cannot be read ({exc.strerror or exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AutosplitError(f"{where}: not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    return parse(data, where)


def read(path) -> DeviceProfile:
    """The DeviceProfile in the profile file at ``path`` (see *strict*)."""
    return read_with_source(path)[0]

