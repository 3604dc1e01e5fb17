"""Random ops (dropout) inside tensor-parallel sharded regions: a different stream per tp rank.

Terms:
  sharded random op -- a dropout (module, function or SDPA's ``dropout_p``) whose input is split
                       across tp ranks (attention heads, MLP hidden features, or tokens under sequence
                       parallelism).  Each rank holds a different part of one tensor, so each needs its
                       own mask: with one shared stream, rank 1's heads would get rank 0's mask
                       pattern.  Replicated activations must get the *same* mask on every tp rank.
  default stream    -- torch's default generator; identical on every tp rank (same seed, same draws),
                       which keeps replicated-region masks equal.
  fork              -- (Megatron's model-parallel RNG) a sharded random op draws one seed from the
                       default CPU stream (the same draw on every tp rank), runs under a generator
                       seeded with (that seed, tp rank), then restores the default stream.  So the
                       default stream advances identically on every tp rank, sharded masks differ,
                       and activation checkpointing, which restores the default stream before it
                       recomputes, replays exactly the same masks.
  seed              -- the fork seeds the one generator the op draws from (the CPU default generator,
                       or the default generator of the tensor's CUDA device) and ``fork_rng`` restores it.

  rank's random state -- what a rank's draws depend on: its default CPU generator and, on a GPU, the
                       default generator of its device (``generator_states``).  A fork has no state of
                       its own: its seed is a draw of the default CPU stream and ``fork_rng`` puts the
                       generator back, so restoring these two states restores every fork too.  Checkpoints
                       save them per rank (runtime/state/checkpoint_state.py).

``TpRandom`` wraps one op; ``passes/tp_random.py`` puts it on the sharded random ops of a stage graph.
"""
from __future__ import annotations

import torch
from torch import nn

from autosplit.tp import ops

_GOLDEN = 0x9E3779B97F4A7C15          # odd 64-bit constant: (seed, rank) -> well-separated seeds


def rank_seed(seed: int, rank: int) -> int:
    """The seed of tp rank ``rank``'s fork, from one draw ``seed`` of the default stream."""
    return (seed + _GOLDEN * (rank + 1)) % (2**63 - 1)


def _device_of(args, kwargs) -> torch.device:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def generator_states(device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's random state (see *rank's random state*): ``cpu`` and, on a GPU, ``cuda`` (uint8 tensors)."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_generator_states(states: dict[str, torch.Tensor], device: torch.device) -> None:
    """Restore ``generator_states``' output; a ``cuda`` state is restored only on a GPU (a CPU job's
    checkpoint resumed on GPUs leaves the device generator as it is)."""
    torch.set_rng_state(states["cpu"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


class TpRandom(nn.Module):
    """Runs ``op`` (a module, a function, or a Tensor method name) under this tp rank's fork."""

    def __init__(self, op, axis: str):
        super().__init__()
        self.axis = axis
        if isinstance(op, nn.Module):
            self.inner = op               # the model's own module: follows its train/eval flag
        else:
            self.fn = op

    def _call(self, args, kwargs):
        if hasattr(self, "inner"):
            return self.inner(*args, **kwargs)
        if isinstance(self.fn, str):      # a Tensor method: x.bernoulli(...)
            return getattr(args[0], self.fn)(*args[1:], **kwargs)
        return self.fn(*args, **kwargs)

    def forward(self, *args, **kwargs):
        if _device_of(args, kwargs).type == "meta" or getattr(getattr(self, "inner", None), "p", None) == 0:
            return self._call(args, kwargs)     # planning, or a dropout that draws nothing (p read per call)
        return self._forked(args, kwargs)

    # Why dynamo does not trace the fork: the seed is a host read (.item()) and fork_rng a context over
    # generator states, both graph breaks; and inductor's own random kernels would not draw torch's
    # masks anyway.  So a compiled stage runs each sharded dropout eagerly, here: one deliberate break.
    @torch._dynamo.disable
    def _forked(self, args, kwargs):
        device = _device_of(args, kwargs)
        seed = int(torch.randint(0, 2**62, (1,)).item())        # one draw of the default CPU stream
        rank = ops.axis_rank(self.axis)
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            devices, generator = [index], torch.cuda.default_generators[index]
        else:
            devices, generator = [], torch.default_generator
        with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
            # *seed*: only the generator the op draws from.  Not torch.manual_seed: it seeds every
            # device type's generators too, and for each one not initialized in this process (CUDA on a
            # CPU run, XPU and MTIA everywhere) it formats the Python stack to queue a lazy call:
            # 1-1.5 ms per call, 40-60 ms per step of the CPU benchmark ViT under sequence parallelism.
            generator.manual_seed(rank_seed(seed, rank))
            return self._call(args, kwargs)

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}" + ("" if hasattr(self, "inner") else f", op={getattr(self.fn, '__name__', self.fn)}")
