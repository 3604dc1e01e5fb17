"""The optimizer step's seconds: element-wise kernels over the parameters one rank owns.

Terms:
  owned      -- the parameter bytes a rank steps: its stages' tensor-parallel shards, and under
                ``dp_shard`` (FSDP2) 1/dp of them (each rank steps its own shard of the flat state).
  kind       -- what the step runs per element, from the user's optimizer (a torch.optim class, an
                instance, or a name): "sgd" (plain), "sgd_momentum", "adam", "adamw".
  passes     -- parameter-sized tensors read plus written by torch's default (``foreach``) implementation,
                one multi-tensor kernel per ``_foreach_*`` call, counted from torch/optim/{sgd,adam,adamw}.py:
                  sgd:          add_(p, g)                                            r2 w1 =  3
                  sgd_momentum: mul_(buf), add_(buf, g), add_(p, buf)                 2 + 3 + 3 = 8
                  adam:         lerp_(m, g), mul_(v), addcmul_(v, g, g), sqrt(v), div_, add_(eps),
                                addcdiv_(p, m, denom)                                 3+2+3+2+2+2+4 = 18
                  adamw:        adam's, and mul_(p, 1 - lr wd) first                  18 + 2 = 20
                nesterov momentum adds a pass of 3, a non-zero weight decay of SGD/Adam an add_ of 3.
                ``fused=True`` (one kernel reading p, g and the state, writing p and the state): sgd 3,
                sgd_momentum 5, adam/adamw 7.
  flops      -- per element: sgd 2, sgd_momentum 4, adam 12, adamw 14 (the vector units, never the bound
                on a GPU: the passes are).
  launches   -- one kernel per ``_foreach_*`` call per group of up to ``TENSORS_PER_LAUNCH`` tensors
                (torch's multi_tensor_apply chunks its tensor lists); fused: one per group.
  time       -- max(passes x owned / bandwidth, flops x elements / float32 rate) + launches x op_overhead
                (the roofline of kernels.py), with the state in float32 (autocast keeps it so).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from autosplit.cost_model.profiles import get_profile
from autosplit.errors import AutosplitError

TENSORS_PER_LAUNCH = 48      # torch's multi_tensor_apply: 48 tensors per launch at depth 3 (cuda/MultiTensorApply)


@dataclass(frozen=True)
class OptimizerKind:
    """What one step of an optimizer runs per element (see Terms)."""
    name: str
    passes: float          # parameter-sized reads + writes
    flops: float           # per element
    kernels: int           # _foreach_* calls per tensor group

    def time(self, param_bytes: float, tensors: int, profile) -> float:
        """Seconds to step ``param_bytes`` of float32 parameters in ``tensors`` tensors on ``profile``."""
        if param_bytes <= 0:
            return 0.0
        p = get_profile(profile)
        work = max(self.passes * param_bytes / (p.mem_bandwidth * p.bandwidth_efficiency),
                   self.flops * param_bytes / 4 / p.flops_for(torch.float32))
        return work + self.kernels * math.ceil(max(tensors, 1) / TENSORS_PER_LAUNCH) * p.op_overhead


    def floor(self, param_bytes: float, profile) -> float:
        """A bound ``time`` never goes below for ``param_bytes`` (its traffic alone; the search prunes with it)."""
        p = get_profile(profile)
        return self.passes * max(param_bytes, 0.0) / (p.mem_bandwidth * p.bandwidth_efficiency)


_BASE = {   # name: (passes, flops, foreach kernels), foreach implementation, no weight decay
    "sgd": (3, 2, 1), "sgd_momentum": (8, 4, 3), "adam": (18, 12, 7), "adamw": (20, 14, 8)}
_FUSED_PASSES = {"sgd": 3, "sgd_momentum": 5, "adam": 7, "adamw": 7}
NAMES = tuple(_BASE)


def optimizer_kind(optimizer) -> OptimizerKind:
    """The OptimizerKind of ``optimizer``: a torch.optim class (its defaults), an instance (its
    ``defaults``: momentum, nesterov, weight decay, fused), an OptimizerKind, or one of NAMES."""
    if isinstance(optimizer, OptimizerKind):
        return optimizer
    if isinstance(optimizer, str):
        if optimizer.lower() not in _BASE:
            raise AutosplitError(f"optimizer={optimizer!r}: expected a torch.optim class or instance, or one of "
                                 f"{', '.join(NAMES)}")
        return _kind(optimizer.lower(), {})
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    defaults = dict(getattr(optimizer, "defaults", {})) if not isinstance(optimizer, type) else {}
    if isinstance(optimizer, type):
        try:
            import inspect
            defaults = {k: v.default for k, v in inspect.signature(cls.__init__).parameters.items()
                        if v.default is not inspect.Parameter.empty}
        except (TypeError, ValueError):
            defaults = {}
    for base, algo in ((torch.optim.AdamW, "adamw"), (torch.optim.Adam, "adam"), (torch.optim.SGD, "sgd")):
        if issubclass(cls, base):
            if algo == "sgd" and (defaults.get("momentum") or 0) != 0:
                algo = "sgd_momentum"
            return _kind(algo, defaults)
    raise AutosplitError(f"optimizer={cls.__name__}: the cost model prices torch.optim.SGD, Adam and AdamW (and "
                         f"their subclasses); pass the nearest of {', '.join(NAMES)} by name")


def _kind(algo: str, defaults: dict) -> OptimizerKind:
    passes, flops, kernels = _BASE[algo]
    if defaults.get("nesterov"):
        passes, flops, kernels = passes + 3, flops + 2, kernels + 1
    if algo != "adamw" and (defaults.get("weight_decay") or 0) != 0:     # grad = grad + wd * p
        passes, flops, kernels = passes + 3, flops + 2, kernels + 1
    if defaults.get("fused"):
        passes, kernels = _FUSED_PASSES[algo], 1
    return OptimizerKind(algo, float(passes), float(flops), kernels)
