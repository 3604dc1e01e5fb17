"""The cost-model profile a distributed job plans with, the same on every rank.

Terms:
  profile -- a cost_model.DeviceProfile.  Every rank compiles the plan itself, so every rank must
             use the same numbers, or the ranks would cut the model differently: on GPUs a built-in
             profile is picked from the device name (an unknown GPU is an error asking for
             ``device=``, never another GPU's numbers); on CPU rank 0 measures this machine and
             hands the result to the others through the store, waited on with the job's deadline
             (a collective broadcast here could not be bounded, and a rank that never plans would
             hang the others).
"""
from __future__ import annotations

import itertools
import pickle

import torch

from autosplit.cost_model import get_profile, profile_for_gpu


_CALLS = itertools.count()      # every rank plans its modules in the same order: the n-th call agrees


def agreed_profile(world, watchdog):
    """The profile for ``world``'s device, identical on every rank (on CPU: rank 0's, via the store)."""
    if world.device.type == "cuda":
        return profile_for_gpu(torch.cuda.get_device_name(world.device))
    key = f"autosplit/profile/{next(_CALLS)}"
    if world.rank == 0:
        # the measurement draws random matrices: keep them off the default stream, which must stay
        # identical on every rank (replicated dropout masks under tensor parallelism rely on it)
        with torch.random.fork_rng(devices=[]):
            profile = get_profile("cpu")
        world.store.set(key, pickle.dumps(profile))
        return profile
    watchdog.until(lambda: world.store.check([key]), "waiting for rank 0's measured cost profile")
    return pickle.loads(world.store.get(key))
