"""The cost-model profile a distributed job plans with, the same on every rank.

Terms:
  profile -- a cost_model.DeviceProfile.  Every rank compiles the plan itself, so every rank must
             use the same numbers, or the ranks would cut the model differently: on GPUs a built-in
             profile is picked from the device name (an unknown GPU is an error asking for
             ``device=``, never another GPU's numbers); on CPU rank 0 measures this machine and
             broadcasts the result.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autosplit.cost_model import get_profile, profile_for_gpu


def agreed_profile(world):
    """The profile for ``world``'s device, identical on every rank (one broadcast on CPU)."""
    if world.device.type == "cuda":
        return profile_for_gpu(torch.cuda.get_device_name(world.device))
    box = [None]
    if world.rank == 0:
        # the measurement draws random matrices: keep them off the default stream, which must stay
        # identical on every rank (replicated dropout masks under tensor parallelism rely on it)
        with torch.random.fork_rng(devices=[]):
            box[0] = get_profile("cpu")
    dist.broadcast_object_list(box, src=0)
    return box[0]
