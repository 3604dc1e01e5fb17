"""``autosplit.measure_profile(path=None)``: measure this job's devices and network, the same profile on every rank.

Terms (see autosplit/profiling/__init__.py for *job* and *alone*):
  in a job -- every rank calls it together: rank 0 times its device's kernels (device_bench.py) while the
              others wait; every rank times the collectives of every group size and node span
              (comm_bench.py); on CPU also what the single-host measurement always took (compute fits per
              op class, core sharing, wake, resume, the reference pipeline: measure_profile.py).  Rank 0
              builds the profile, every rank gets it, rank 0 caches it (cost_model/profile_cache.py: a later
              ``parallelize`` without ``device=`` on this machine and rank count plans with it) and writes
              ``path``.  The default process group is created from torchrun's environment where it does
              not exist yet and left up for the job; the groups the measurement made are destroyed.
  alone    -- no job: this one device.  On a GPU its kernel model over its built-in profile (or over
              peaks measured here, for a GPU without one); on CPU the single-process measurement of this
              machine (a one-rank gloo group made in this process and destroyed after), no collectives.
  written  -- ``path`` is written by rank 0 after the ranks agreed on the profile; every rank returns only
              once it is there, or raises the same error naming the path.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import pickle

import torch
import torch.distributed as dist

from autosplit.cost_model import profile_cache, profile_file
from autosplit.errors import AutosplitError
from autosplit.profiling.comm_bench import world_barrier
from autosplit.profiling.device_bench import measure_device
from autosplit.profiling.measure_profile import gpu_base
from autosplit.profiling.measure_profile import measure_profile as measure_in_world
from autosplit.runtime.faults.deadlines import Watchdog
from autosplit.runtime.parallel.world import DEFAULT_TIMEOUT_S, init_world
from autosplit.runtime.profile import local_ranks

_CALLS = itertools.count()
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def in_job() -> bool:
    """Whether this process is a rank of a job: torch.distributed initialized, or torchrun's environment."""
    return dist.is_initialized() or all(k in os.environ for k in LAUNCH_ENV)


def measure_profile(path=None, *, seconds: float = 5.0, timeout_s: float = DEFAULT_TIMEOUT_S,
                    save: bool = True):
    """This job's measured DeviceProfile, the same on every rank (or this one device's, alone).

    Args:
        path: a profile file to write (rank 0; a str or os.PathLike, conventionally ending in ".json"),
            then usable as ``device=path`` anywhere; None: write none.
        seconds: seconds of timed repeats for the device's kernels (and on CPU the op-class fits); more
            gives steadier numbers.  The collectives take what their sizes take.
        timeout_s: the limit of every distributed wait.
        save: also cache the profile for this machine (cost_model/profile_cache.py).
    """
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise AutosplitError(f"path={path!r}: expected a file name (str or os.PathLike) or None")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise AutosplitError(f"seconds={seconds!r}: expected a positive number of seconds")
    if in_job():
        return _in_job(path, seconds, timeout_s, save)
    return _alone(path, seconds, timeout_s, save)


def _watchdog(world) -> Watchdog:
    return Watchdog(world.store, world.rank, world.mesh, world.timeout_s, world.backend)


def _in_job(path, seconds: float, timeout_s: float, save: bool):
    world = init_world((1, 1, -1), timeout_s)
    watchdog = _watchdog(world)
    try:
        profile = measure_in_world(world, watchdog, compute_budget=min(2.0, seconds), save=save,
                                   device_seconds=seconds)
        source = (f"autosplit.measure_profile, {world.size} ranks ({local_ranks(world)} per node), rank 0 on "
                  f"{profile_file.source_line(world.device)}")
        _write_agreed(world, watchdog, path, profile, source)
        world_barrier(world, watchdog)             # no rank is still on the measurement's groups
        return profile
    finally:
        world.close()
        watchdog.close()


def _write_agreed(world, watchdog, path, profile, source: str) -> None:
    """Rank 0 writes ``path``; every rank then returns, or raises rank 0's error (see *written*)."""
    if path is None:
        return
    key = f"autosplit/measure_profile/written/{next(_CALLS)}"
    if world.rank == 0:
        error = _write(path, profile, source)
        world.store.set(key, pickle.dumps(error))
    else:
        watchdog.until(lambda: world.store.check([key]), f"waiting for rank 0 to write {os.fspath(path)}")
        error = pickle.loads(world.store.get(key))
    if error is not None:
        raise AutosplitError(error)


def _write(path, profile, source: str) -> str | None:
    try:
        profile_file.write(path, profile, source)
    except OSError as exc:
        return f"path={os.fspath(path)!r}: the profile could not be written ({exc.strerror or exc})"
    return None


def _alone(path, seconds: float, timeout_s: float, save: bool):
    folder = os.path.dirname(os.path.abspath(path)) if path is not None else None
    if folder is not None and not os.path.isdir(folder):      # before the measurement, not after it
        raise AutosplitError(f"path={os.fspath(path)!r}: the folder {folder} does not exist")
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        with torch.random.fork_rng(devices=[device]):
            kernels = measure_device(device, seconds)
            profile = kernels.apply(gpu_base(device))
        profile = dataclasses.replace(profile, name=f"{kernels.device} (measured: kernels, one device)")
        if save:
            profile_cache.save(profile_cache.machine_key(device, 1), profile)
    else:
        device = torch.device("cpu")
        profile = _cpu_alone(seconds, timeout_s, save)
    if path is not None:
        error = _write(path, profile, f"autosplit.measure_profile, one process, on {profile_file.source_line(device)}")
        if error is not None:
            raise AutosplitError(error)
    return profile


def _cpu_alone(seconds: float, timeout_s: float, save: bool):
    """The single-process CPU measurement in a one-rank gloo group of this process (see *alone*)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        world = init_world((1, 1, 1), timeout_s)
        watchdog = _watchdog(world)
        try:
            return measure_in_world(world, watchdog, compute_budget=min(2.0, seconds), save=save,
                                    device_seconds=seconds)
        finally:
            world.close()
            watchdog.close()
            watchdog.beat.stop()         # the beat of a store that ends here
    finally:
        dist.destroy_process_group()
