"""One pipeline stage as the plan describes it: plain data, no graph and no process group.

Terms: see plan.py (stage, layers, memory).  ``passes/stage_infos.py`` builds these; the Plan holds one
per global stage, and the report, the dump and plan.json present them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass
class StageInfo:
    index: int
    pp_rank: int
    chunk: int
    layers: str
    nodes: list[str]
    params: list[str]
    n_params: int
    param_bytes: int
    fwd_time: float               # seconds per microbatch, predicted
    bwd_time: float
    comm_time: float              # sending outputs forward and receiving their gradients back
    activation_bytes: int         # kept for backward, per microbatch
    in_flight: int                # microbatches whose activations the schedule holds at once
    memory_bytes: int
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    recompute_bytes: int = 0      # alive while one microbatch's backward recomputes (checkpointing)
    w_time: float = 0.0           # the part of bwd_time a split backward defers to W (zb-h1, zb-v)
    dp_bytes: int = 0             # data-parallel traffic per step and rank (cost_model/sharding.py)
    dp_time: float = 0.0          # its predicted seconds per step (not part of ``time``)
    dp_buckets: int = 1           # the pieces it is sent in while the final backward runs (step_time.py)
    dp_gather: float = 0.0        # dp_shard: seconds of one pass's FSDP all-gathers (cost_model/sharding.py)
    dp_units: int = 1             # the FSDP units they go out in
    recompute_comm: float = 0.0   # forward tp collectives backward's recomputation runs again (in comm_time)

    @property
    def time(self) -> float:
        return self.fwd_time + self.bwd_time + self.comm_time
