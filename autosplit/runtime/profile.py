"""The cost-model profile a distributed job plans with when ``device=`` is not given, the same on every rank.

Terms:
  profile  -- a cost_model.DeviceProfile.  Every rank compiles the plan itself, so every rank must
              use the same numbers, or the ranks would cut the model differently.  Rank 0 decides and
              hands the result to the others through the store, waited on with the job's deadline (a
              collective broadcast here could not be bounded, and a rank that never plans would hang
              the others):
    cached   -- a measured profile cached for this machine and this many ranks on it
                (cost_model/profile_cache.py, written by ``autosplit.measure_profile()`` /
                ``python -m autosplit profile`` / autosplit/profiling/measure_profile.py), when present;
    built in -- else on GPUs the built-in profile picked from the device name (an unknown GPU is an
                error asking for ``device=``, never another GPU's numbers), and on CPU rank 0's quick
                measurement of this machine (matmul rate, copy bandwidth, op overhead).
              Rank 0 logs which one at DEBUG (the plan's summary, logged at INFO, names the profile);
              where it has none (an unknown GPU), every rank raises its error.  ``device="profile.json"``
              (a profile file) does not come here: every rank reads the file itself
              (cost_model/profiles.py, which logs the file it read at INFO).
  local ranks -- processes of the job on this machine: torchrun's LOCAL_WORLD_SIZE, else the whole world.
The training runtime measures nothing here: measuring is autosplit/profiling's, which this module does
not import (tests/test_layering.py); a job that wants a measured profile measures it first
(``autosplit.measure_profile()``, which caches it) and then calls ``parallelize``.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import pickle

import torch

from autosplit.cost_model import get_profile, profile_cache, profile_for_gpu
from autosplit.errors import AutosplitError

log = logging.getLogger("autosplit")
_CALLS = itertools.count()      # every rank plans its modules in the same order: the n-th call agrees
RETIRED_ENV = "AUTOSPLIT_MEASURE_PROFILE"


def local_ranks(world) -> int:
    """Processes of the job on this machine (see *local ranks*)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world.size))


def with_node_size(profile, world):
    """``profile`` with torchrun's node size (LOCAL_WORLD_SIZE) as its ``gpus_per_node`` on GPUs, so tp,
    dp and pipeline traffic are priced by the nodes they really cross (cost_model/comm.py).  Unchanged on
    CPU (a gloo world's measured collectives already are what its ranks do) or without torchrun's
    variable.  Every rank of a torchrun job has the same value, so every rank plans alike."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if world.device.type != "cuda" or not local:
        return profile
    p = get_profile(profile)
    return p if p.gpus_per_node == int(local) else dataclasses.replace(p, gpus_per_node=int(local))


def agreed_profile(world, watchdog):
    """The profile for ``world``'s device, identical on every rank: rank 0's, via the store.  Where rank 0
    has none to give (an unknown GPU), every rank raises its AutosplitError."""
    key = f"autosplit/profile/{next(_CALLS)}"
    if world.rank == 0:
        try:
            profile = _rank0_profile(world)
        except AutosplitError as exc:
            world.store.set(key, pickle.dumps(("error", str(exc))))
            raise
        world.store.set(key, pickle.dumps(("ok", profile)))
        return profile
    watchdog.until(lambda: world.store.check([key]), "waiting for rank 0's cost profile")
    status, value = pickle.loads(world.store.get(key))
    if status == "error":
        raise AutosplitError(value)
    return value


def _rank0_profile(world):
    cache_key = profile_cache.machine_key(world.device, local_ranks(world))
    profile = profile_cache.load(cache_key)
    how = f"measured, cached in {profile_cache.path_for(cache_key)}"
    if profile is None:
        if os.environ.get(RETIRED_ENV) == "1":
            log.warning("%s=1: parallelize no longer measures the profile itself; measure it first in the "
                        "job with autosplit.measure_profile() (it caches the profile parallelize then "
                        "reads), or pass device='profile.json' (python -m autosplit profile)", RETIRED_ENV)
        profile, how = _built_in(world)
    log.debug("cost-model profile: %s (%s)", profile.name, how)
    return profile


def _built_in(world):
    """(profile, how it was found) when nothing is cached."""
    if world.device.type == "cuda":
        return profile_for_gpu(torch.cuda.get_device_name(world.device)), "built in"
    # the measurement draws random matrices: keep them off the default stream, which must stay
    # identical on every rank (replicated dropout masks under tensor parallelism rely on it)
    with torch.random.fork_rng(devices=[]):
        return get_profile("cpu"), "this CPU measured by rank 0"
