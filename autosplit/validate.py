"""Check planning arguments before any work, with errors that name the argument.

``autosplit.options.PlanOptions.check`` runs these for every option; the schedule's arithmetic
(chunks per rank, microbatches per pipeline rank) is ``autosplit.schedule.generate.validate``'s.

Terms:
  memory budget -- bytes per pipeline stage: a positive int / float, or a string with a unit,
                   "8GiB", "512 MiB", "1.5GB" (KiB/MiB/GiB/TiB are powers of 2, KB/MB/GB/TB powers of 10).
  leaf module   -- a module class torch.fx must not trace into.  Given as a class, a dotted import path
                   "package.module.ClassName", or a bare class name that names exactly one class among
                   the model's own submodule types.
  stage bounds  -- the last segment of each stage (``plan.bounds``): n_stages strictly increasing
                   segment indices, the last one the graph's last segment.

Every check raises AutosplitError and shows the value it got.
"""
from __future__ import annotations

import difflib
import importlib
import inspect
import math
import re
from collections.abc import Sequence

import torch
from torch import nn

from autosplit.errors import AutosplitError

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def near_miss(value, choices: Sequence) -> str | None:
    """The choice closest to a misspelled string ``value``, if one is close."""
    near = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1) if isinstance(value, str) else []
    return near[0] if near else None


def one_of(name: str, value, choices: Sequence) -> None:
    """``value`` must be one of ``choices``; a near miss is suggested."""
    if value in choices:
        return
    near = near_miss(value, choices)
    hint = f" (did you mean {near!r}?)" if near else ""
    raise AutosplitError(f"{name}={value!r}: expected one of {', '.join(repr(c) for c in choices)}{hint}")


def positive_int(name: str, value, default_note: str = "") -> None:
    if not _is_int(value) or value < 1:
        kind = type(value).__name__
        raise AutosplitError(f"{name}={value!r} ({kind}) must be a positive integer{default_note}")


def model(value) -> None:
    if not isinstance(value, nn.Module):
        raise AutosplitError(f"model is a {type(value).__module__}.{type(value).__qualname__}; expected a "
                             f"torch.nn.Module (the model itself, not its state_dict or a class)")


def memory_budget(value) -> float | None:
    """Bytes, from a number of bytes or a string such as "8GiB" / "1.5GB"; None stays None."""
    if value is None:
        return None
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", value.lower())
        if not m or m.group(2) not in _UNITS:
            raise AutosplitError(f"memory_budget={value!r}: expected bytes as a number or a string like "
                                 f"'8GiB', '512MiB', '1.5GB' (units: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
        number = float(m.group(1)) * _UNITS[m.group(2)]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        raise AutosplitError(f"memory_budget={value!r} is a {type(value).__name__}; expected bytes (int or "
                             f"float) or a string like '8GiB'")
    if not math.isfinite(number) or number <= 0:
        raise AutosplitError(f"memory_budget={value!r} = {number:g} bytes; it must be a positive, finite "
                             f"number of bytes per stage")
    return number


def example_inputs(model_: nn.Module, value) -> tuple[torch.Tensor, ...]:
    """The example microbatch as a tuple of tensors."""
    if value is None:
        meta = any(p.device.type == "meta" for p in model_.parameters())
        why = "the model is on the meta device, so " if meta else ""
        raise AutosplitError(
            f"example_input is required: {why}autosplit plans shapes from one microbatch, e.g. "
            f"example_input=torch.empty(8, 3, 224, 224, device='meta')")
    inputs = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not inputs:
        raise AutosplitError("example_input is empty; pass one microbatch tensor (or a tuple of them)")
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            where = f"example_input[{i}]" if isinstance(value, (tuple, list)) else "example_input"
            raise AutosplitError(f"{where} is a {type(x).__name__}; expected a tensor (one microbatch)")
        if x.dim() == 0:
            raise AutosplitError(f"example_input has shape (); expected one microbatch with the batch dim "
                                 f"first, e.g. (B, C, H, W)")
        if x.shape[0] == 0:
            # (a slice batch[: B // dp // m] with B < dp * m comes out empty: every cost would be 0 / 0)
            where = f"example_input[{i}]" if isinstance(value, (tuple, list)) else "example_input"
            raise AutosplitError(f"{where} has 0 rows (shape {tuple(x.shape)}); a microbatch needs at least one "
                                 f"sample: with B samples per step, dp replicas and m microbatches it holds "
                                 f"B // (dp * m), so B >= dp * m")
    return inputs


def concrete_args(model_: nn.Module, n_inputs: int, value) -> None:
    """Keys must be forward parameters that the example inputs do not already fill."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise AutosplitError(f"concrete_args={value!r}: expected a dict {{parameter name: value}}")
    params = list(inspect.signature(model_.forward).parameters.values())
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL,)]
    for key in value:
        if key not in names:
            raise AutosplitError(f"concrete_args key {key!r}: {type(model_).__name__}.forward has no such "
                                 f"parameter; it takes ({', '.join(names)})")
        if names.index(key) < n_inputs:
            raise AutosplitError(f"concrete_args key {key!r} is forward parameter {names.index(key)}, which the "
                                 f"{n_inputs} example input(s) already fill; fix only parameters after them")


def leaf_modules(model_: nn.Module, value) -> tuple[type, ...]:
    """Classes from classes, dotted import paths, or class names found among the model's submodules."""
    if isinstance(value, (str, type)):
        value = [value]
    try:
        items = list(value)
    except TypeError:
        raise AutosplitError(f"leaf_modules={value!r}: expected a list of nn.Module classes or class names") from None
    found = []
    for item in items:
        cls = _leaf_class(model_, item) if isinstance(item, str) else item
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise AutosplitError(f"leaf_modules entry {item!r} is not an nn.Module class (or its name)")
        found.append(cls)
    return tuple(found)


def _leaf_class(model_: nn.Module, name: str) -> type:
    if "." in name:
        module_name, _, cls_name = name.rpartition(".")
        try:
            return getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError) as exc:
            raise AutosplitError(f"leaf_modules entry {name!r}: cannot import it ({type(exc).__name__}: {exc})") from None
    types = {type(m) for m in model_.modules()}
    matches = sorted({t for t in types if t.__name__ == name}, key=lambda t: t.__module__)
    if len(matches) == 1:
        return matches[0]
    if matches:
        paths = ", ".join(f"{t.__module__}.{t.__qualname__}" for t in matches)
        raise AutosplitError(f"leaf_modules entry {name!r} names {len(matches)} classes in the model ({paths}); "
                             f"give the full 'package.module.ClassName'")
    near = difflib.get_close_matches(name, sorted({t.__name__ for t in types}), n=3)
    hint = f"; close: {', '.join(near)}" if near else ""
    raise AutosplitError(f"leaf_modules entry {name!r}: no submodule of {type(model_).__name__} has that class "
                         f"name{hint} (or give 'package.module.ClassName')")


def stage_bounds(value, n_stages: int, n_segments: int) -> list[int]:
    """``value`` as a list: n_stages strictly increasing segment indices ending at the last segment."""
    try:
        bounds = list(value)
    except TypeError:
        raise AutosplitError(f"stage_bounds={value!r}: expected a list of {n_stages} segment indices "
                             f"(e.g. another plan's plan.bounds)") from None
    if len(bounds) != n_stages:
        raise AutosplitError(f"stage_bounds={bounds}: {len(bounds)} entries for {n_stages} stages; give the last "
                             f"segment of each stage (segments 0..{n_segments - 1})")
    if not all(_is_int(b) for b in bounds):
        raise AutosplitError(f"stage_bounds={bounds}: entries must be integers (segment indices)")
    for s in range(1, n_stages):
        if bounds[s] <= bounds[s - 1]:
            raise AutosplitError(f"stage_bounds={bounds}: not strictly increasing, stage {s} ends at segment "
                                 f"{bounds[s]} <= {bounds[s - 1]} where stage {s - 1} ends (every stage needs a segment)")
    if bounds[0] < 0:
        raise AutosplitError(f"stage_bounds={bounds}: segment {bounds[0]} < 0")
    if bounds[-1] != n_segments - 1:
        raise AutosplitError(f"stage_bounds={bounds}: the last stage must end at the last segment, "
                             f"{n_segments - 1} (the graph has {n_segments} segments), not {bounds[-1]}")
    return bounds
