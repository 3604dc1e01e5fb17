"""The hidden test hook: ``AUTOSPLIT_CHECK_MUTATE=<configuration>`` breaks one configuration's collectives.

Terms: see autosplit/check/__init__.py (mutation, configuration).
  mutated rank -- the last rank of the world: while the named configuration trains, what it feeds
                  each floating-point ``all_reduce``, ``all_gather``, ``all_gather_into_tensor``,
                  ``reduce_scatter_tensor`` and their ``*_single`` forms (the calls the runtime and
                  FSDP2 make through ``torch.distributed``: tp, dp, dp_shard and the loss) is shifted by ``DELTA``, so every result those
                  collectives return is wrong by a little, on every rank of the group.  The numerics
                  part must then fail, naming the configuration.  The runtime is untouched: the
                  functions are swapped on ``torch.distributed`` for the configuration's run only.
  perturbed    -- how many collective calls the mutated rank shifted; 0 where the configuration
                  has none of them (a world of one rank; compiled stages' traced collectives), which
                  the numerics part reports, as a mutation that could not bite.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

ENV = "AUTOSPLIT_CHECK_MUTATE"
DELTA = 1e-3
# function name -> (position of the tensor fed in, its keyword name, reduced in place)
# (FSDP2 calls the *_single ones, where torch has them; a name this torch lacks is left alone)
_FED = {"all_reduce": (0, "tensor", True), "all_gather": (1, "tensor", False),
        "all_gather_into_tensor": (1, "input_tensor", False), "reduce_scatter_tensor": (1, "input", False),
        "all_gather_single": (1, "input_tensor", False), "reduce_scatter_single": (1, "input", False)}


def mutated_config() -> str | None:
    """The configuration the environment asks to break, or None."""
    return os.environ.get(ENV) or None


def _shifted(fn, position: int, keyword: str, in_place: bool, counter: list):
    def call(*args, **kwargs):
        args = list(args)
        t = args[position] if len(args) > position else kwargs.get(keyword)
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            counter[0] += 1
            with torch.no_grad():
                if in_place:
                    t.add_(DELTA)
                else:
                    t = t + DELTA
            if len(args) > position:
                args[position] = t
            else:
                kwargs[keyword] = t
        return fn(*args, **kwargs)
    return call


@contextlib.contextmanager
def mutation(active: bool, rank: int, world: int):
    """While open, the mutated rank (``world - 1``) shifts its collectives' inputs when ``active``.
    Yields a one-element list: the number of calls shifted so far."""
    counter = [0]
    if not active or rank != world - 1:
        yield counter
        return
    saved = {name: getattr(dist, name) for name in _FED if hasattr(dist, name)}
    for name, fn in saved.items():
        setattr(dist, name, _shifted(fn, *_FED[name], counter))
    try:
        yield counter
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
