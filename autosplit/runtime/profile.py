"""The cost-model profile a distributed job plans with, the same on every rank.

Terms:
  profile  -- a cost_model.DeviceProfile.  Every rank compiles the plan itself, so every rank must
              use the same numbers, or the ranks would cut the model differently.  Rank 0 decides and
              hands the result to the others through the store, waited on with the job's deadline (a
              collective broadcast here could not be bounded, and a rank that never plans would hang
              the others):
    cached   -- a measured profile cached for this machine and this many ranks on it
                (cost_model/profile_cache.py, written by runtime/measure_profile.py), when present;
    measure  -- else, with ``AUTOSPLIT_MEASURE_PROFILE=1``, every rank measures it now, together
                (measure_profile.py: compute per op class, alpha-beta per collective) and rank 0
                caches it;
    built in -- else on GPUs the built-in profile picked from the device name (an unknown GPU is an
                error asking for ``device=``, never another GPU's numbers), and on CPU rank 0's quick
                measurement of this machine (matmul rate, copy bandwidth, op overhead).
"""
from __future__ import annotations

import itertools
import os
import pickle

import torch

from autosplit.cost_model import get_profile, profile_cache, profile_for_gpu
from autosplit.runtime.measure_profile import local_ranks, measure_profile

_CALLS = itertools.count()      # every rank plans its modules in the same order: the n-th call agrees
_MEASURE = b"measure"


def agreed_profile(world, watchdog):
    """The profile for ``world``'s device, identical on every rank: rank 0's, via the store."""
    key = f"autosplit/profile/{next(_CALLS)}"
    if world.rank == 0:
        profile = profile_cache.load(profile_cache.machine_key(world.device, local_ranks(world)))
        if profile is None and os.environ.get("AUTOSPLIT_MEASURE_PROFILE") == "1":
            world.store.set(key, _MEASURE)
            return measure_profile(world, watchdog)
        if profile is None:
            profile = _built_in(world)
        world.store.set(key, pickle.dumps(profile))
        return profile
    watchdog.until(lambda: world.store.check([key]), "waiting for rank 0's cost profile")
    value = world.store.get(key)
    return measure_profile(world, watchdog) if value == _MEASURE else pickle.loads(value)


def _built_in(world):
    if world.device.type == "cuda":
        return profile_for_gpu(torch.cuda.get_device_name(world.device))
    # the measurement draws random matrices: keep them off the default stream, which must stay
    # identical on every rank (replicated dropout masks under tensor parallelism rely on it)
    with torch.random.fork_rng(devices=[]):
        return get_profile("cpu")
