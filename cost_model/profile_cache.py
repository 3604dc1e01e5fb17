"""Measured profiles on disk, keyed by the machine and the torch version they were measured with.

Terms:
  key       -- what makes a measurement valid: host name, CPU model (or GPU name), core count, torch's
               thread count per process, ranks sharing this machine while it was measured (on a CPU
               they compete for its cores), and the torch version; written as a readable file name
               plus a short hash of the full key.
  directory -- ``$AUTOSPLIT_PROFILE_DIR``, else ``$XDG_CACHE_HOME/autosplit/profiles``, else
               ``~/.cache/autosplit/profiles``.  ``AUTOSPLIT_PROFILE_CACHE=0`` turns the cache off
               (nothing read, nothing written).
  file      -- ``<key>.json``: a profile file (profile_file.py: the same layout ``device="x.json"`` reads)
               plus the full ``key`` and ``cache_format`` (FORMAT: how the measurement was made; a file of
               another one is ignored, as is one that does not parse).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
from pathlib import Path

import torch

from autosplit.cost_model import profile_file
from autosplit.cost_model.device import DeviceProfile
from autosplit.errors import AutosplitError

# how the cached measurement was made; a file of another one is ignored.  10: the profile file's layout
# (profile_file.py), the kernel model, node spans and topology measured; 9: collectives on a host with more
# ranks than cores fitted to their in-step times; 8: plus ``pass_overhead``; 7: ``p2p_post`` timed after compute
# (its mean) where each rank has a core; 6: plus ``resume``; 5: collectives timed in step (after compute) on
# CPU; 4: plus ``p2p_wake``; 3: plus ``p2p_post``; 2: compute fits of one process alone plus ``sharing``
# (1: fits taken under contention)
FORMAT = 10


def enabled() -> bool:
    return os.environ.get("AUTOSPLIT_PROFILE_CACHE", "1") not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    if os.environ.get("AUTOSPLIT_PROFILE_DIR"):
        return Path(os.environ["AUTOSPLIT_PROFILE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autosplit" / "profiles"


def _processor(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(device="cpu", local_ranks: int = 1) -> dict:
    """The full key of a measurement on ``device`` with ``local_ranks`` processes on this machine."""
    device = torch.device(device)
    return {"host": socket.gethostname(), "processor": _processor(device), "cores": os.cpu_count() or 1,
            "threads": torch.get_num_threads(), "local_ranks": local_ranks, "torch": torch.__version__,
            "device_type": device.type}


def key_name(key: dict) -> str:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    readable = f"{key['host']}-{key['device_type']}-{key['cores']}c-{key['threads']}t-{key['local_ranks']}r"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in readable) + f"-{digest}"


# the profile as JSON values and back (the cache's entries, and what spawned measurements hand their parent)
to_dict, from_dict = profile_file.to_dict, profile_file.from_dict


def path_for(key: dict) -> Path:
    """Where the profile measured under ``key`` is cached."""
    return cache_dir() / f"{key_name(key)}.json"


def load(key: dict) -> DeviceProfile | None:
    """The cached profile for ``key``, or None (no file, cache off, another measurement format or key, or a
    file that does not parse)."""
    if not enabled():
        return None
    path = path_for(key)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("cache_format") != FORMAT or data.get("key") != key:
        return None
    try:
        return profile_file.parse(data, f"cached profile {str(path)!r}", allow=("key", "cache_format"))[0]
    except AutosplitError:
        return None


def save(key: dict, profile: DeviceProfile) -> Path | None:
    """Write ``profile`` under ``key`` (atomically: a temporary file renamed); None when the cache is off."""
    if not enabled():
        return None
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    return profile_file.write(path_for(key), profile, extra={"key": key, "cache_format": FORMAT})
