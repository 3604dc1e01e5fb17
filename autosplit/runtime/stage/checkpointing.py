"""Activation checkpointing: keep fewer activations, recompute them during backward.

Terms:
  stage granularity -- the whole stage's forward is recomputed in its backward: only the stage's
                       inputs stay alive between a microbatch's forward and backward.
  block granularity -- each layer (transformer block, found by autosplit.model_layers.layer_paths) inside the
                       stage is recomputed on its own; the tensors between blocks stay alive.
The stage GraphModule is split with torch.fx's ``split_module`` into contiguous runs of nodes, one
run per layer, and the layer runs are wrapped in ``torch.utils.checkpoint``.  Parameters are the
same objects as in the stage module, so optimizers and gradient buckets see no difference.
  buffers under recomputation -- the recomputed forward runs in training mode, so a BatchNorm in it would
                       update its running statistics a second time per microbatch (``num_batches_tracked``
                       +2, momentum applied twice); the recomputation restores the buffers the forward
                       wrote.
  written buffers -- what the recomputation restores: the buffers of the modules the graph calls (their
                       forward is not in the graph: BatchNorm, whose kernel updates the running
                       statistics without bumping torch's version counter, or a leaf module), the running
                       statistics a functional batch norm of the graph is given, and any buffer whose
                       version counter (``Tensor._version``, bumped by every in-place op) a forward
                       changed.  A layer without BatchNorm that only reads its buffers copies none.
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from autosplit.model_layers import layer_of, layer_paths
from autosplit.passes.batch_norm import running_stats


class Checkpointed(torch.nn.Module):
    """Recompute ``module``'s forward during backward instead of keeping its activations."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self._written = _kernel_written(module)     # buffer names; grows with what forwards are seen to write

    def forward(self, *inputs):
        if not torch.is_grad_enabled():
            return self.module(*inputs)
        buffers = list(self.module.named_buffers())
        before = [b._version for _, b in buffers]
        out = torch.utils.checkpoint.checkpoint(self.module, *inputs, use_reentrant=False,
                                                context_fn=self._contexts)
        # Why after the forward and not before the recomputation: its backward (and so the recomputation,
        # which reads ``_written`` only when it starts) always comes after this forward.
        self._written.update(name for (name, b), v in zip(buffers, before) if b._version != v)
        return out

    def _contexts(self):
        return contextlib.nullcontext(), _buffers_restored(self.module, self._written)


def _kernel_written(module: torch.nn.Module) -> set[str]:
    """The buffers of ``module`` that a forward may write unseen by their version counters (see the
    module docstring); every buffer where ``module`` holds no graph to read that from."""
    graphs = [(p, m) for p, m in module.named_modules() if isinstance(m, fx.GraphModule)]
    if not graphs:
        return {name for name, _ in module.named_buffers()}
    buffers = {name for name, _ in module.named_buffers()}
    found = set()
    for prefix, gm in graphs:
        at = f"{prefix}." if prefix else ""
        for node in gm.graph.nodes:
            called = gm.get_submodule(node.target) if node.op == "call_module" else None
            if called is not None and not isinstance(called, fx.GraphModule):
                found.update(f"{at}{node.target}.{name}" for name, _ in called.named_buffers())
            found.update(f"{at}{x.target}" for x in running_stats(node)
                         if isinstance(x, fx.Node) and x.op == "get_attr")
    return found & buffers


@contextlib.contextmanager
def _buffers_restored(module: torch.nn.Module, written: set[str]):
    """Run a recomputation and put the ``written`` buffers of ``module`` back as they were.  Why a copy
    around the recomputation and not a frozen momentum: the buffers may have moved on since this
    microbatch's forward (1F1B runs later forwards before this backward), and training-mode outputs never
    read them, so the values at the recomputation's start are the ones to keep.  Written buffers are few
    and small (running statistics); torch's early stop ends a recomputation by raising inside it, so the
    restore is in ``finally``."""
    saved = [(b, b.clone()) for name, b in module.named_buffers() if name in written]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def split_layers(stage: fx.GraphModule, model: torch.nn.Module) -> tuple[fx.GraphModule, list[str]]:
    """``stage`` split into contiguous runs of nodes, one submodule per run, and the names of the
    runs that are one of the model's layers (runtime/parallel/fsdp.py shards each of those on its own)."""
    layers = layer_paths(model)
    runs: dict[fx.Node, int] = {}
    is_layer: dict[int, bool] = {}
    run, current = 0, object()
    for node in stage.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        layer = layer_of(node, layers) if node.op != "get_attr" else current
        if layer != current:
            run, current = run + 1, layer
            is_layer[run] = layer is not None
        runs[node] = run
    split = split_module(stage, stage, lambda n: runs[n], keep_original_order=True)
    split.layer_runs = True        # its submod_* children are the runs (runtime/pipeline/compiled_stages.py compiles each)
    names = [name for name, _ in split.named_children()
             if name.startswith("submod_") and is_layer.get(int(name.removeprefix("submod_")), False)]
    return split, names


def checkpoint_blocks(stage: fx.GraphModule, model: torch.nn.Module) -> fx.GraphModule:
    """``stage`` with each of the model's layers it contains recomputed in backward."""
    split, names = split_layers(stage, model)
    for name in names:
        setattr(split, name, Checkpointed(getattr(split, name)))
    return split


def checkpointed(stage: fx.GraphModule, model: torch.nn.Module, granularity: str | None) -> torch.nn.Module:
    """The module to run for ``granularity`` None, "stage" or "block"."""
    if granularity is None:
        return stage
    if granularity == "stage":
        return Checkpointed(stage)
    if granularity == "block":
        return checkpoint_blocks(stage, model)
    raise ValueError(f"recompute={granularity!r}: expected None, 'stage' or 'block'")
