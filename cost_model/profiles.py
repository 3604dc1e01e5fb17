"""Named cost-model profiles: the built-in GPUs, this CPU measured, a profile file, and a GPU found by its name.

Terms: see device.py (profile), calibrate.py (measuring this machine) and profile_file.py (a profile as a
JSON file).  This module sits above them, so none imports the other's user: device.py holds the data,
calibrate.py measures into it, profile_file.py reads and writes it.
  profile file -- ``device=`` given as an os.PathLike or a str ending in ".json": the file is read once per
                  process and version of it (its resolved path, modification time and size), so the many
                  ``get_profile`` calls of one plan read it once; each read is logged at INFO, naming the
                  file, the profile and its ``source`` (what ``parallelize`` planned with, on every rank).
"""
from __future__ import annotations

import functools
import logging
import os
import re

from autosplit.cost_model import profile_file
from autosplit.cost_model.calibrate import calibrate
from autosplit.cost_model.device import BUILTIN, DeviceProfile
from autosplit.errors import AutosplitError

log = logging.getLogger("autosplit")

_BUILTIN = BUILTIN
NAMES = tuple(_BUILTIN) + ("cpu",)


@functools.lru_cache(maxsize=1)
def _cpu_profile() -> DeviceProfile:
    """This machine: its measured profile for one process when one is cached (profile_cache.py;
    ``python -m autosplit profile`` or ``python -m autosplit profile --ranks 1`` writes
    it), else measured in about half a second.  The two-process link measurement is left out: a library call
    must not spawn processes (that re-runs an unguarded user script); call ``calibrate(link=True)`` for it and
    pass the profile."""
    from autosplit.cost_model import profile_cache       # the cache module imports this one's peers
    return profile_cache.load(profile_cache.machine_key("cpu", 1)) or calibrate(seconds=0.5, link=False)


@functools.lru_cache(maxsize=16)
def _file_profile(path: str, mtime_ns: int, size: int) -> DeviceProfile:
    """The profile in file ``path`` as of (``mtime_ns``, ``size``): a rewritten file is read again."""
    profile, source = profile_file.read_with_source(path)
    log.info("cost-model profile from %s: %s (%s)", path, profile.name, source or "no source given")
    return profile


def _from_file(path) -> DeviceProfile:
    where = os.fspath(path)
    try:
        st = os.stat(where)
    except OSError:
        return profile_file.read(where)          # raises the file's error, naming the path
    return _file_profile(os.path.abspath(where), st.st_mtime_ns, st.st_size)


def get_profile(name_or_profile) -> DeviceProfile:
    """A DeviceProfile from a name ("h100", "a100", ...; "cpu": measured here, once per process), a profile
    file (an os.PathLike or a str ending in ".json": cost_model/profile_file.py), or a DeviceProfile.

    Args:
        name_or_profile: what ``device=`` was given.
    """
    if isinstance(name_or_profile, DeviceProfile):
        return name_or_profile
    if profile_file.is_path(name_or_profile):
        return _from_file(name_or_profile)
    if not isinstance(name_or_profile, str):
        raise AutosplitError(f"device={name_or_profile!r} is a {type(name_or_profile).__name__}; expected a "
                             f"profile name ({', '.join(NAMES)}), a profile file (a path ending in .json) or a "
                             f"cost_model.DeviceProfile")
    key = name_or_profile.lower()
    if key == "cpu":
        return _cpu_profile()
    if key not in _BUILTIN:
        raise AutosplitError(f"device={name_or_profile!r}: unknown device profile; valid names: {', '.join(NAMES)} "
                             f"(or a profile file: python -m autosplit profile --out profile.json, then "
                             f"device='profile.json'; or a DeviceProfile, e.g. cost_model.calibrate(device='cuda'))")
    return _BUILTIN[key]


# SXM parts only: the PCIe / NVL variants of the same chip have lower clocks, memory bandwidth and links,
# so they must not silently get the SXM numbers.  The consumer parts by their exact names: an "RTX 4090 D",
# a "3090 Ti" or the 600 W Pro 6000 are other parts.
_GPU_NAMES = ((r"\bh200\b", "h200"), (r"\bh100\b", "h100"), (r"\ba100\b", "a100"), (r"rtx 3090$", "rtx3090"),
              (r"rtx 4090$", "rtx4090"), (r"rtx 5090$", "rtx5090"),
              (r"rtx pro 6000 blackwell max-q", "rtx_pro6000_maxq"))
_OTHER_FORM_FACTORS = ("pcie", "nvl")


def profile_for_gpu(gpu_name: str) -> DeviceProfile:
    """The built-in profile of a GPU named ``gpu_name`` (``torch.cuda.get_device_name``).

    An unknown GPU is an error rather than a guess: every rank must plan with the same numbers, and a
    wrong profile silently moves the cut.  A measured profile is the user's call: ``autosplit.measure_profile()``
    in the job (rank 0 builds it, every rank gets it) or a profile file (``python -m autosplit profile``).
    """
    lowered = gpu_name.lower().strip()
    for pattern, key in _GPU_NAMES:
        if re.search(pattern, lowered) and not any(f in lowered for f in _OTHER_FORM_FACTORS):
            return _BUILTIN[key]
    raise AutosplitError(
        f"GPU {gpu_name!r} has no built-in cost-model profile (built in: H100 SXM, H200 SXM, A100 SXM, "
        f"GeForce RTX 3090 / 4090 / 5090, RTX PRO 6000 Blackwell Max-Q); "
        f"pass device= to autosplit.parallelize / autosplit.compile: a name ({', '.join(NAMES)}), a profile file "
        f"measured on this GPU (torchrun ... -m autosplit profile --out profile.json, then device='profile.json') "
        f"or a DeviceProfile (autosplit.measure_profile() in the job)")
