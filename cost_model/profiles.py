"""Named cost-model profiles: the built-in GPUs, this CPU measured, and a GPU found by its name.

Terms: see device.py (profile) and calibrate.py (measuring this machine).  This module sits above
both, so neither imports the other's user: device.py holds the data, calibrate.py measures into it.
"""
from __future__ import annotations

import functools

from autosplit.cost_model.calibrate import calibrate
from autosplit.cost_model.device import BUILTIN, DeviceProfile
from autosplit.errors import AutosplitError

_BUILTIN = BUILTIN
NAMES = tuple(_BUILTIN) + ("cpu",)


@functools.lru_cache(maxsize=1)
def _cpu_profile() -> DeviceProfile:
    """This machine: its measured profile for one process when one is cached (profile_cache.py;
    ``python -m autosplit.runtime.measure_profile --ranks 1`` writes it), else measured in about half
    a second.  The two-process link measurement is left out: a library call must not spawn processes
    (that re-runs an unguarded user script); call ``calibrate(link=True)`` for it and pass the profile."""
    from autosplit.cost_model import profile_cache       # the cache module imports this one's peers
    return profile_cache.load(profile_cache.machine_key("cpu", 1)) or calibrate(seconds=0.5, link=False)


def get_profile(name_or_profile) -> DeviceProfile:
    """A DeviceProfile from "h100", "a100", "cpu" (measured here, once per process) or a DeviceProfile."""
    if isinstance(name_or_profile, DeviceProfile):
        return name_or_profile
    if not isinstance(name_or_profile, str):
        raise AutosplitError(f"device={name_or_profile!r} is a {type(name_or_profile).__name__}; expected a "
                             f"profile name ({', '.join(NAMES)}) or a cost_model.DeviceProfile")
    key = name_or_profile.lower()
    if key == "cpu":
        return _cpu_profile()
    if key not in _BUILTIN:
        raise AutosplitError(f"device={name_or_profile!r}: unknown device profile; valid names: {', '.join(NAMES)} "
                             f"(or pass a DeviceProfile, e.g. cost_model.calibrate(device='cuda'))")
    return _BUILTIN[key]


# SXM parts only: the PCIe / NVL variants of the same chip have lower clocks, memory bandwidth and links,
# so they must not silently get the SXM numbers.
_GPU_NAMES = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"))
_OTHER_FORM_FACTORS = ("pcie", "nvl")


def profile_for_gpu(gpu_name: str) -> DeviceProfile:
    """The built-in profile of a GPU named ``gpu_name`` (``torch.cuda.get_device_name``).

    An unknown GPU is an error rather than a guess: every rank must plan with the same numbers, and a
    wrong profile silently moves the cut.  (A measured profile would need rank 0 to calibrate and
    broadcast; we leave that to the user: ``device=cost_model.calibrate(device='cuda')``.)
    """
    lowered = gpu_name.lower()
    for marker, key in _GPU_NAMES:
        if marker in lowered and not any(f in lowered for f in _OTHER_FORM_FACTORS):
            return _BUILTIN[key]
    raise AutosplitError(
        f"GPU {gpu_name!r} has no built-in cost-model profile (built in: H100 SXM, H200 SXM, A100 SXM); "
        f"pass device= to autosplit.parallelize / autosplit.compile: a name ({', '.join(NAMES)}) or a "
        f"DeviceProfile, e.g. device=autosplit.cost_model.calibrate(device='cuda') measured on this GPU")
