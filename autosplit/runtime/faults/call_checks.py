"""The argument checks of ParallelModule's entry points, run on every rank before the call gate.

Terms:
  problem  -- a sentence naming the argument at fault and the arithmetic, or None when the
              arguments are fine; the call gate (call_gate.py) makes every rank raise it.
  args     -- (text, key): the arguments as readable text, and what of them must be equal on every
              rank (shapes and dtypes of the batch, ``max_norm``, a state dict's keys and shapes).

Pure: reads shapes and Python values only; no communication, no device copies.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch


def _shape(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
    return type(x).__name__


def _inputs(images) -> tuple:
    return tuple(images) if isinstance(images, (tuple, list)) else (images,)


def batch_problem(what: str, images, num_microbatches: int, plan) -> str | None:
    """Images that are not tensors, disagree on rows, do not divide into microbatches, or do not
    match the plan (``plan``: None while the first step may still re-plan)."""
    inputs = _inputs(images)
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return f"{what}: input {i} is {_shape(x)}; expected a tensor with the batch as its first dim"
    rows = [x.shape[0] for x in inputs]
    if len(set(rows)) > 1:
        return f"{what}: the inputs have {rows} rows; every input needs the same batch size"
    m = num_microbatches
    if rows[0] % m:
        return (f"{what}: batch of {rows[0]} rows is not divisible by num_microbatches({m}); use a batch that "
                f"is a multiple of {m}")
    if plan is not None:
        got = [((x.shape[0] // m, *x.shape[1:]), str(x.dtype).removeprefix("torch.")) for x in inputs]
        want = list(zip(map(tuple, plan.example_shapes), plan.example_dtypes))
        if got != want:
            return (f"{what} inputs give microbatches of (shape, dtype) {got}, but the plan was built for {want}; "
                    f"keep the batch size, image size and dtype of the first step")
    return None


def labels_problem(images, labels) -> str | None:
    rows = _inputs(images)[0].shape[0]
    if not isinstance(labels, torch.Tensor) or labels.dim() == 0:
        return f"step: labels is {_shape(labels)}; expected a tensor with one row per image"
    if labels.shape[0] != rows:
        return (f"step: labels have {labels.shape[0]} rows but the batch has {rows} (images "
                f"{_shape(_inputs(images)[0])}); give one label per image")
    return None


def batch_args(images, labels=None) -> tuple[str, str]:
    text = "images " + ", ".join(_shape(x) for x in _inputs(images))
    if labels is not None:
        text += f", labels {_shape(labels)}"
    return text, text


def max_norm_problem(max_norm) -> str | None:
    ok = isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool) and math.isfinite(max_norm) \
        and max_norm > 0
    return None if ok else f"clip_grad_norm_: max_norm={max_norm!r} must be a positive finite number"


def state_dict_problem(state_dict, own: Mapping) -> str | None:
    """A state dict that is not a mapping, or whose keys or shapes differ from the model's."""
    if not isinstance(state_dict, Mapping):
        return f"load_full_state_dict: expected a dict of tensors (e.g. model.state_dict()), got {_shape(state_dict)}"
    missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
    if missing or unexpected:
        return f"load_full_state_dict: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}"
    for name, tensor in own.items():
        value = state_dict[name]
        if not isinstance(value, torch.Tensor):
            return f"load_full_state_dict: '{name}' is {_shape(value)}; expected a tensor"
        if tuple(value.shape) != tuple(tensor.shape):
            return (f"load_full_state_dict: '{name}' has shape {tuple(value.shape)}, the model has "
                    f"{tuple(tensor.shape)}")
    return None


def state_dict_args(state_dict) -> tuple[str, str]:
    if not isinstance(state_dict, Mapping):
        return _shape(state_dict), _shape(state_dict)
    key = ";".join(f"{k}:{_shape(v)}" for k, v in sorted(state_dict.items(), key=lambda kv: str(kv[0])))
    return f"a state dict of {len(state_dict)} entries", key


def check_call(call: str, args: tuple, *, num_microbatches: int, plan, model) -> tuple[str, str, str | None]:
    """(args text, args key, problem) of one entry-point call (see the module docstring).

    Args:
      call: the method's name; args: its positional arguments.
      num_microbatches: the module's; plan: the plan shapes must match, None if it may still change;
      model: the user's model (the keys and shapes a state dict must have).
    """
    if call in ("step", "predict"):
        error = batch_problem(call, args[0], num_microbatches, plan)
        if error is None and call == "step":
            error = labels_problem(args[0], args[1])
        return (*batch_args(*args), error)
    if call == "clip_grad_norm_":
        return f"max_norm={args[0]!r}", f"max_norm={args[0]!r}", max_norm_problem(args[0])
    if call == "load_full_state_dict":
        return (*state_dict_args(args[0]), state_dict_problem(args[0], model.state_dict()))
    return "", "", None
