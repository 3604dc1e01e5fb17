"""Dynamic loss scaling for fp16, decided consistently on every rank.

Terms:
  scale     -- the factor the loss is multiplied by before backward (so small fp16 gradients do not
               flush to zero); gradients are divided by it again before the optimizer step.
  overflow  -- an inf or nan in any rank's gradients; ranks agree on it through the step's one
               all-reduce over the whole world (summed with the loss), so either every rank skips the
               step or none does.
  skip      -- on overflow every gradient is set to None, which torch optimizers treat as "no update",
               and the scale is halved; after ``growth_interval`` clean steps it doubles.
  growth counter -- ``clean_steps``, the clean steps since the last overflow or growth.  The scale and
               the counter are this class's state (``state_dict``, saved in checkpoints): a resumed run
               without them would skip steps the uninterrupted run applied, or grow at other steps.

torch.amp.GradScaler decides overflow per process and wraps the optimizer; a pipeline needs one
decision across ranks that each hold a different part of the model, hence this small class.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class LossScaler:
    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.clean_steps = 0
        self.skipped = False

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The scale and the growth counter as 0-d tensors (float64 holds every power of two exactly)."""
        return {"scale": torch.tensor(self.scale, dtype=torch.float64),
                "growth_tracker": torch.tensor(self.clean_steps, dtype=torch.int64)}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["growth_tracker"])

    def unscale(self, params: list[torch.nn.Parameter], device) -> torch.Tensor:
        """Unscale every gradient and check it for inf/nan in one fused device-side pass per
        (device, dtype) group; returns this rank's overflow flag (1.0 or 0.0) on ``device``, not read:
        the step all-reduces it together with the loss, so the verdict costs no host sync of its own
        (a per-gradient ``isfinite(g).all()`` test would sync once per tensor)."""
        found = torch.zeros(1, device=device)
        groups: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None:
                groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        for (grad_device, _), grads in groups.items():
            inv = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=grad_device)
            found_here = torch.zeros(1, dtype=torch.float32, device=grad_device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_here, inv)
            found = torch.maximum(found, found_here.to(found.device))
        return found

    def update(self, overflow: bool, params: list[torch.nn.Parameter]) -> None:
        """After every rank's flag was summed: skip the step everywhere (gradients None, scale
        halved) on an overflow anywhere, else count a clean step and grow the scale on schedule."""
        self.skipped = overflow
        if overflow:
            for p in params:
                p.grad = None
            self.scale /= 2
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= 2
