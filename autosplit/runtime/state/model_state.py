"""A ParallelModule's full state dict, read and written on every rank (the call gate and agreement first).

Terms: see runtime/state/state_dict.py (owner, sharded, local) and runtime/faults/call_gate.py (entering a call).
Sharded checkpoints (each rank writes only its shards) are runtime/state/checkpoint.py's.
"""
from __future__ import annotations

import torch

from autosplit.errors import AutosplitError
from autosplit.runtime.faults.call_checks import state_dict_problem
from autosplit.runtime.state.state_dict import gather_full_state_dict, load_into


def full_state_dict(pm) -> dict[str, torch.Tensor]:
    """``pm``'s model state dict, full shapes, CPU tensors, identical on every rank."""
    pm._enter("full_state_dict")       # before planning: a lazy plan may communicate
    pm._require_plan("full_state_dict()")
    pm._agree()
    return gather_full_state_dict(pm.model, pm.plan, pm.raw_modules, pm.world, pm.watchdog)


def load_full_state_dict(pm, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a full state dict into ``pm``'s model and this rank's shards; then every rank checks that all
    ranks loaded the same values."""
    pm._enter("load_full_state_dict", state_dict)
    problem = state_dict_problem(state_dict, pm.model.state_dict())
    if problem:                          # unreachable after the gate; kept for direct callers
        raise AutosplitError(problem)
    load_into(pm.model, state_dict, pm.plan, pm.raw_modules, pm.block_rank)
    # the whole model was just replaced: compare it again (a meta model is not whole on any rank)
    pm._params_agreed = pm.initializer is not None
    pm._agree()
