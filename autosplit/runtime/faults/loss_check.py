"""The loss function's contract: a scalar, floating, differentiable tensor per microbatch.

Terms:
  up front -- ``loss_fn_problem`` at parallelize time, from the object alone (no call, so a user's
              loss with side effects is not run an extra time): not callable, or a torch loss
              module built with ``reduction='none'``.
  checked  -- ``checked_loss`` wraps loss_fn for the executor: the first wrong value raises an
              AutosplitError on the last stage's rank, which the Watchdog reports on every rank
              ("rank R (...) failed at 1F0: AutosplitError: loss_fn returned ...").  Python checks
              of shape and dtype only: no host sync.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from autosplit.errors import AutosplitError


def loss_fn_problem(loss_fn) -> str | None:
    if not callable(loss_fn):
        return f"loss_fn={loss_fn!r} is not callable; expected loss_fn(logits, labels) -> scalar tensor"
    if isinstance(loss_fn, torch.nn.modules.loss._Loss) and getattr(loss_fn, "reduction", "mean") == "none":
        return (f"loss_fn={loss_fn!r} has reduction='none' and returns one loss per row; autosplit needs a "
                f"scalar per microbatch: use reduction='mean'")
    return None


def checked_loss(loss_fn: Callable) -> Callable:
    def loss(output, labels):
        value = loss_fn(output, labels)
        if not isinstance(value, torch.Tensor):
            raise AutosplitError(f"loss_fn returned a {type(value).__name__}; it must return a scalar tensor "
                                 f"(the microbatch's mean loss) computed from the logits")
        if value.numel() != 1:
            raise AutosplitError(f"loss_fn returned a tensor of shape {tuple(value.shape)} for logits of shape "
                                 f"{tuple(output.shape)}; it must return a scalar (the microbatch's mean loss), "
                                 f"e.g. reduce with .mean()")
        if not value.is_floating_point():
            raise AutosplitError(f"loss_fn returned a {value.dtype} tensor; it must be floating point")
        if torch.is_grad_enabled() and not value.requires_grad:
            raise AutosplitError("loss_fn returned a tensor that does not depend on the logits (requires_grad="
                                 "False): compute the loss from the logits without detaching them")
        return value
    return loss
