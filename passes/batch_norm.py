"""BatchNorm under microbatches and data parallelism: find the layers that normalize with batch
statistics, and say what they compute in a plan.

Terms:
  batch-statistics layer -- a node that normalizes with the mean and variance of the batch it is given:
                 a ``call_module`` of any ``torch.nn.modules.batchnorm._BatchNorm`` (BatchNorm1d/2d/3d,
                 timm's BatchNormAct2d, ...) in training mode or without running statistics, also one
                 inside a leaf module; or a call of ``F.batch_norm`` / ``torch.batch_norm`` /
                 ``torch.native_batch_norm`` whose ``training`` argument is True, follows the mode
                 (trace_modes' ModeSwitch with a True train value) or is computed.  Found from the graph's
                 ops, never from names.
  per microbatch -- the pipeline forwards each microbatch on its own, so each is normalized with its own
                 statistics (as GPipe does): the single-device equivalent is gradient accumulation over
                 the same microbatches, not one forward of the step's batch.
  per replica -- under dp each replica normalizes its own rows (DistributedDataParallel without
                 SyncBatchNorm).
  running statistics -- ``running_mean`` / ``running_var`` / ``num_batches_tracked``: updated once per
                 microbatch forward, in microbatch order (every schedule runs a stage's forwards in
                 microbatch order; recomputation under checkpointing restores them,
                 runtime/stage/checkpointing.py); under dp, dp rank 0's are broadcast after every step
                 (runtime/parallel/buffers.py, DDP's ``broadcast_buffers``).
  label       -- the layers' module paths, numbered siblings that differ in one index merged:
                 "blocks.{0-3}.attn.qkv.bn".
  values per channel -- what a layer's statistics are taken over: its input's dim 0 times the dims after
                 the channel dim (dim 1), as torch counts them (it refuses 1 in training mode: "Expected
                 more than 1 value per channel").  Per row: that over the microbatch rows, where the rows
                 are in dim 0 (a BatchNorm1d on (B, C) features: 1; on tokens flattened to (B*N, C): N;
                 a BatchNorm2d on (B, C, H, W): H*W).
  fewest rows -- the fewest microbatch rows every layer accepts: 2 where some layer sees one value per
                 channel per row (or its input is not in the graph: inside a leaf module), else 1.

Pure: reads the traced graph and the module objects' flags; no process group.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from autosplit.passes.op_dims import arg
from autosplit.trace_modes import ModeSwitch

# functional batch norms: where their (running_mean, training, momentum) arguments sit
_FUNCTIONAL = {F.batch_norm: (1, 5, 6), torch.batch_norm: (3, 5, 6), torch.native_batch_norm: (3, 5, 6)}
ROOT = "<root>"          # a functional call in the model's own forward (as errors.py names it)


class BatchNormStatisticsWarning(UserWarning):
    """A plan normalizes with per-microbatch (and per-replica) batch statistics; see ``plan.summary()``."""


@dataclass(frozen=True)
class BatchNormLayer:
    path: str              # module path; a functional call: "<owner module path or ROOT> <node name>"
    kind: str              # "BatchNorm2d", "BatchNormAct2d", "F.batch_norm", ...
    tracks: bool           # updates running statistics in training mode
    momentum: float | None  # None: cumulative average (torch's momentum=None)
    values: int | None = None   # values per channel of its input in the graph (tp rank 0's); None: inside a
                                # leaf module (its input is not in the graph)


def _training_value(gm: fx.GraphModule, value) -> bool:
    """The ``training`` argument as the step sees it (modules in training mode)."""
    if isinstance(value, fx.Node):
        if value.op == "call_module" and isinstance(gm.get_submodule(value.target), ModeSwitch):
            return bool(gm.get_submodule(value.target).train_value)
        return True          # computed at run time: may be True
    return bool(value)


def _values(x) -> int | None:
    """Values per channel of a node's tensor value (dim 0 times the dims after dim 1), as torch's
    ``_verify_batch_size`` counts them; None without a shape."""
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return None
    return math.prod([val.shape[0], *val.shape[2:]])


def _module_layers(path: str, module: torch.nn.Module, values: int | None = None) -> list[BatchNormLayer]:
    """The batch-statistics layers among ``module`` and its submodules; ``values``: the node's input's
    values per channel, which are those of ``module`` itself only (a submodule's input is not in the graph)."""
    out = []
    for sub, m in module.named_modules():
        if isinstance(m, _BatchNorm) and (m.training or (m.running_mean is None and m.running_var is None)):
            out.append(BatchNormLayer(f"{path}.{sub}" if sub else path, type(m).__name__,
                                      m.training and m.track_running_stats, m.momentum, None if sub else values))
    return out


def _add(found: dict[str, BatchNormLayer], layer: BatchNormLayer) -> None:
    """Record ``layer`` once; a layer called again keeps its fewest values (None, unknown, counts as fewest)."""
    seen = found.setdefault(layer.path, layer)
    if seen is not layer and seen.values is not None and (layer.values is None or layer.values < seen.values):
        found[layer.path] = replace(seen, values=layer.values)


def find_batch_norms(gm: fx.GraphModule) -> list[BatchNormLayer]:
    """The batch-statistics layers of the traced model, in graph order (each once)."""
    found: dict[str, BatchNormLayer] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if not isinstance(module, ModeSwitch):    # a leaf module may hold BatchNorms inside
                values = _values(node.args[0]) if node.args else None
                for layer in _module_layers(node.meta.get("module_path") or str(node.target), module, values):
                    _add(found, layer)
        elif node.op == "call_function" and node.target in _FUNCTIONAL:
            stats_at, training_at, momentum_at = _FUNCTIONAL[node.target]
            if not _training_value(gm, arg(node, training_at, "training", False)):
                continue                               # running statistics only: an affine op
            name = f"{node.meta.get('module_path') or ROOT} {node.name}"
            kind = "F.batch_norm" if node.target is F.batch_norm else f"torch.{node.target.__name__}"
            momentum = arg(node, momentum_at, "momentum", 0.1)
            _add(found, BatchNormLayer(name, kind, arg(node, stats_at, "running_mean", None) is not None,
                                       momentum if isinstance(momentum, (int, float)) else None,
                                       _values(arg(node, 0, "input"))))
    return list(found.values())


def running_stats(node: fx.Node) -> list:
    """The running_mean and running_var arguments of a functional batch norm ``node`` (its kernel
    updates them in place in training mode); empty for any other node."""
    if node.op != "call_function" or node.target not in _FUNCTIONAL:
        return []
    at = _FUNCTIONAL[node.target][0]
    return [x for x in (arg(node, at, "running_mean"), arg(node, at + 1, "running_var")) if x is not None]


def values_per_row(layer: BatchNormLayer, rows: int) -> int | None:
    """``layer``'s values per channel per microbatch row, its input having ``layer.values`` at ``rows``
    rows; None where that is unknown (inside a leaf module) or not a multiple of the rows (the rows are
    not in its input's dim 0 alone)."""
    if layer.values is None or layer.values % rows:
        return None
    return layer.values // rows


def fewest_rows(layers: list[BatchNormLayer], rows: int) -> tuple[int, BatchNormLayer | None]:
    """The fewest microbatch rows at which every layer still sees more than one value per channel, from
    a graph shape-propagated at ``rows`` rows; and the first layer that needs 2 (None where 1 will do).
    2 is always enough: a layer's values per channel grow with the rows."""
    for layer in layers:
        per_row = values_per_row(layer, rows)
        if per_row is None or per_row <= 1:
            return 2, layer
    return 1, None


def one_row_refusal(layer: BatchNormLayer, rows: int) -> str:
    """Why ``layer`` (fewest_rows's) needs 2 microbatch rows, with the arithmetic."""
    head = f"{layer.path} ({layer.kind}, batch statistics in training mode)"
    if layer.values is None:
        return f"{head} is inside a leaf module: its input's values per channel are not in the graph"
    per_row = values_per_row(layer, rows)
    if per_row is None:
        return (f"{head} sees {layer.values} values per channel at {rows} rows, not a multiple of the rows: "
                f"how many one row gives is not known")
    return (f"{head} sees {per_row} value per channel per row ({layer.values} at {rows} rows): over one "
            f"row torch refuses it (\"Expected more than 1 value per channel when training\")")


def _ranges(values: list[int]) -> str:
    values = sorted(set(values))
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def paths_label(paths: list[str]) -> str:
    """``paths`` in order of first appearance, those equal but for one numeric part merged into one
    entry with that part's values as ranges: "blocks.{0-1,3}.attn.qkv.bn"."""
    groups: list[tuple[list[str], int | None, list[int]]] = []     # (base parts, varying slot, its values)
    for path in paths:
        parts = path.split(".")
        for g, (base, slot, values) in enumerate(groups):
            differ = [k for k, (a, b) in enumerate(zip(parts, base)) if a != b] if len(parts) == len(base) else None
            if differ and len(differ) == 1 and slot in (None, differ[0]) and parts[differ[0]].isdigit() \
                    and base[differ[0]].isdigit():
                groups[g] = (base, differ[0], values + [int(parts[differ[0]])])
                break
        else:
            groups.append((parts, None, []))
    out = []
    for base, slot, values in groups:
        if slot is None:
            out.append(".".join(base))
        else:
            out.append(".".join(base[:slot] + ["{" + _ranges([int(base[slot])] + values) + "}"] + base[slot + 1:]))
    return ", ".join(out)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def batch_norm_note(layers: list[BatchNormLayer], microbatches: int, dp: int, microbatch_size: int | None,
                    recompute: str | None = None) -> list[str]:
    """The summary's note (lines); empty where each forward sees the whole step's batch (m = dp = 1)
    or no layer normalizes with batch statistics."""
    if not layers or microbatches * dp == 1:
        return []
    size = f" of {microbatch_size} samples" if microbatch_size else ""
    where = []
    if microbatches > 1:
        where.append(f"per microbatch ({microbatches} microbatches{size}, as GPipe)")
    if dp > 1:
        where.append(f"per replica (dp={dp}, as DistributedDataParallel without SyncBatchNorm)")
    step = f"the step's {microbatch_size * microbatches * dp} samples" if microbatch_size else "the step's batch"
    verb = "normalizes" if len(layers) == 1 else "normalize"
    lines = [f"BatchNorm: {_plural(len(layers), 'BatchNorm layer')} {verb} with batch statistics: "
             f"{paths_label([layer.path for layer in layers])}",
             f"  they compute mean and variance {' and '.join(where)}, not over {step}; the single-device "
             f"equivalent is gradient accumulation over the same microbatches"]
    if any(layer.tracks for layer in layers):
        kept = (f"; after each step every replica holds dp rank 0's (DDP's broadcast_buffers)" if dp > 1 else "")
        again = f", not again when recompute=\"{recompute}\" runs the forward again" if recompute else ""
        lines.append(f"  running statistics: updated once per microbatch in microbatch order ({microbatches} "
                     f"update{'' if microbatches == 1 else 's'} per step){again}{kept}")
    lines.append("  statistics over the whole batch: num_microbatches=1 and dp=1, or a norm without batch "
                 "statistics (docs/design.md, \"BatchNorm: per-microbatch, per-replica statistics\")")
    return lines


def warn_batch_norm(lines: list[str], stacklevel: int = 3) -> None:
    """One warning carrying the note (nothing when ``lines`` is empty)."""
    if lines:
        warnings.warn("\n".join(lines), BatchNormStatisticsWarning, stacklevel=stacklevel)


__all__ = ["BatchNormLayer", "BatchNormStatisticsWarning", "batch_norm_note", "fewest_rows", "find_batch_norms",
           "one_row_refusal", "paths_label", "running_stats", "values_per_row", "warn_batch_norm"]
