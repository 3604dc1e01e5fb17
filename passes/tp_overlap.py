"""Overlap the forward's tensor-parallel all-reduces with compute, by splitting rows into chunks.

A row-parallel GEMM's partial sum must be all-reduced before anything reads it, and in a ViT block
everything after it reads it: there is no independent work to hide the all-reduce behind.  Split the
rows (dim 0: the batch) of a stretch of row-wise ops into k chunks, and there is: chunk 0's all-reduce
is in flight while chunk 1's GEMM runs, and chunk 1's while chunk 0 runs the ops after the reduction
(DeepSpeed's Domino and torch's async tensor parallelism rest on the same decomposition).  Every
chunk computes the rows it would have computed unsplit, so the result is the same up to the order of
additions in the weight gradients (which now add k partial GEMMs).

Terms:
  row-wise op -- output row i (index i along dim 0) depends only on row i of its activation inputs:
                 an op the registry declares ``rowwise`` (passes/op_registry.py: linears, convolutions,
                 norms over trailing dims, elementwise ops and activations), a module only with its
                 library's forward (torch's, or the tp rewrite's ``RowParallelLinear``), never an
                 in-place form, a random op only when it draws nothing (a dropout with p = 0: one that
                 draws random numbers would draw them in another order), and the tp ops
                 ``copy_to_axis`` / ``all_reduce``.  Decided from the op and ``meta['val']``'s shapes:
                 every tensor of the run has ``rows`` (>= k) rows and at least 2 dims, and an
                 elementwise operand either has those rows (it is split too) or is broadcast along
                 dim 0 (fewer dims, or 1 row: it is used whole).  Nothing is decided from names.
  run         -- a maximal stretch of consecutive graph nodes, all row-wise and in one layer
                 (``model_layers.layer_paths``; get_attr nodes may sit between them).  Consecutive in
                 graph order, so no path leaves a run and comes back into it; within one layer, so
                 activation checkpointing and FSDP units per layer still see contiguous layers.  Only
                 a run holding an ``all_reduce`` is rewritten.
  chunk       -- one of k row ranges (``torch.tensor_split`` along dim 0; uneven when k does not
                 divide the rows).  Every node of a run gets one copy per chunk; inputs from outside
                 the run are split once before it; values used after the run are ``torch.cat`` of
                 their chunks after it.
  phase       -- how many all-reduces lie on a node's longest path from the run's start.  The copies
                 are emitted phase by phase, each phase chunk by chunk; an all-reduce becomes
                 ``all_reduce_start`` (launched, not waited) and its ``wait`` is emitted where its
                 chunk first reads the result, one phase later: after the other chunks' work of the
                 phase, which is what overlaps it.  Every rank of the axis runs the same graph, so the
                 collectives keep one order on every rank (NCCL-safe).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.infra.pass_base import PassResult

from autosplit.model_layers import layer_of, layer_paths
from autosplit.passes.infra import MetaPass, PlanState
from autosplit.passes.op_names import inplace_base
from autosplit.passes.op_registry import arguments, module_entry, op
from autosplit.tp import ops

_TP_OPS = {ops.copy_to_axis, ops.all_reduce}
_LIBRARIES = ("torch", "autosplit")       # whose modules' forwards are the op their class declares
_WEIGHTED = ("linear", "conv", "norm")    # registry kinds whose other operands are weights, not activations


def _rowwise_module(module: nn.Module, ndim: int) -> bool:
    entry = module_entry(module)
    if not entry.rowwise or type(module).forward.__module__.split(".")[0] not in _LIBRARIES:
        return False                             # another forward than its class's op: leave it alone
    if entry.random is not None and getattr(module, "p", None) != 0:
        return False
    shape = getattr(module, "normalized_shape", None) if entry.kind == "norm" else ()
    return shape is not None and len(shape) < ndim


def _val(node) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def activation_args(gm: fx.GraphModule, node: fx.Node, rows: int) -> list[int] | None:
    """Positions in ``node.args`` of the activations to split, or None if the node is not row-wise
    for ``rows`` rows (see *row-wise op*)."""
    out = _val(node)
    if out is None or out.dim() < 2 or out.shape[0] != rows:
        return None
    first = _val(node.args[0]) if node.args else None
    if first is None or first.dim() != out.dim() or first.shape[0] != rows:
        return None
    if node.op == "call_module":
        ok = not node.kwargs and len(node.args) == 1 and _rowwise_module(gm.get_submodule(node.target), out.dim())
        return [0] if ok else None
    if node.op == "call_function" and node.target in _TP_OPS:
        return [0]
    entry = op(node)
    if not entry.rowwise or inplace_base(node) is not None:
        return None
    if entry.random is not None and (arguments(node) or {}).get(entry.random or "p") != 0:
        return None                              # it draws random numbers
    if entry.kind in _WEIGHTED:
        others = list(node.args[1:]) + list(node.kwargs.values())
        if any(isinstance(a, fx.Node) and a.op != "get_attr" for a in others):
            return None                          # a weight computed in the graph: leave it alone
        if entry.kind == "norm":
            shape = (arguments(node) or {}).get("normalized_shape")
            if not isinstance(shape, (tuple, list)) or len(shape) >= out.dim():
                return None
        return [0]
    if any(isinstance(v, fx.Node) for v in node.kwargs.values()):
        return None
    split = []
    for i, a in enumerate(node.args):
        v = _val(a)
        if v is None:
            if isinstance(a, fx.Node) and not isinstance(a.meta.get("val"), (int, float, bool)):
                return None                      # an operand of unknown shape
            continue
        if v.dim() == out.dim() and v.shape[0] == rows:
            split.append(i)
        elif v.dim() == out.dim() and v.shape[0] != 1:
            return None
    return split


def find_runs(gm: fx.GraphModule, layers: list[str], chunks: int) -> list[list[fx.Node]]:
    """The runs of ``gm`` that hold an all-reduce (see *run*), each a list of nodes in graph order."""
    runs, run, rows, layer = [], [], None, None

    def close():
        if any(n.target is ops.all_reduce for n in run):
            runs.append(list(run))
        run.clear()

    for node in gm.graph.nodes:
        if node.op == "get_attr":
            continue
        if run:
            if layer_of(node, layers) == layer and activation_args(gm, node, rows) is not None:
                run.append(node)
                continue
            close()
        val = _val(node)                         # may a run start here?
        if val is not None and val.dim() >= 2 and val.shape[0] >= chunks \
                and activation_args(gm, node, val.shape[0]) is not None:
            rows, layer = val.shape[0], layer_of(node, layers)
            run.append(node)
    close()
    return runs


def _sizes(rows: int, chunks: int) -> list[int]:
    return [t.shape[0] for t in torch.empty(rows, device="meta").tensor_split(chunks)]


def _meta(node: fx.Node, val) -> dict:
    """``node``'s metadata for a node standing in for (a chunk of) it: its own value, no cost."""
    return {**{k: v for k, v in node.meta.items() if k not in ("val", "cost")}, "val": val}


def chunk_run(gm: fx.GraphModule, run: list[fx.Node], chunks: int) -> None:
    """Rewrite one run of ``gm`` into ``chunks`` row chunks (see the module docstring)."""
    graph, members = gm.graph, set(run)
    rows = _val(run[0]).shape[0]
    sizes = _sizes(rows, chunks)
    starts = [sum(sizes[:c]) for c in range(chunks)]

    def narrow(val, c):
        return val.narrow(0, starts[c], sizes[c]) if isinstance(val, torch.Tensor) else val

    split_of: dict[fx.Node, list[fx.Node]] = {}      # an input from outside -> its chunks
    copies: dict[fx.Node, list[fx.Node]] = {}        # a run node -> its chunk copies (waited results)
    started: dict[fx.Node, list[fx.Node]] = {}       # an all_reduce -> its chunks' all_reduce_start
    positions = {node: activation_args(gm, node, rows) for node in run}   # find_runs checked: never None
    phase: dict[fx.Node, int] = {}
    for node in run:
        ins = [node.args[i] for i in positions[node] if node.args[i] in members]
        phase[node] = max((phase[a] + (a.target is ops.all_reduce) for a in ins), default=0)

    node = run[0].next                           # parameters read inside the run: fetched before it
    while node is not run[-1]:
        node, here = node.next, node
        if here.op == "get_attr":
            run[0].prepend(here)
    with graph.inserting_before(run[0]):
        for node in run:                         # inputs from outside the run: split once, here
            for i in positions[node]:
                a = node.args[i]
                if a not in members and a not in split_of:
                    parts = graph.create_node("call_method", "tensor_split", (a, chunks), {"dim": 0},
                                              name=f"{a.name}_chunks")
                    parts.meta = _meta(run[0], tuple(narrow(_val(a), c) for c in range(chunks)))
                    split_of[a] = []
                    for c in range(chunks):
                        item = graph.call_function(operator.getitem, (parts, c))
                        item.meta = _meta(run[0], narrow(_val(a), c))
                        split_of[a].append(item)

        def chunk_arg(a, c):
            if a in split_of:
                return split_of[a][c]
            if a in started and copies[a][c] is None:      # first reader of this chunk's reduction
                copies[a][c] = graph.create_node("call_function", ops.wait, (started[a][c],), name=f"{a.name}_c{c}")
                copies[a][c].meta = _meta(a, narrow(_val(a), c))
            return copies[a][c]

        for p in range(max(phase.values()) + 1):
            for c in range(chunks):
                for node in (n for n in run if phase[n] == p):
                    args = tuple(chunk_arg(a, c) if i in positions[node] else a for i, a in enumerate(node.args))
                    if node.target is ops.all_reduce:
                        new = graph.create_node("call_function", ops.all_reduce_start, args, dict(node.kwargs),
                                                name=f"{node.name}_start_c{c}")
                        started.setdefault(node, [None] * chunks)[c] = new
                        copies.setdefault(node, [None] * chunks)
                    else:
                        new = graph.create_node(node.op, node.target, args, dict(node.kwargs), name=f"{node.name}_c{c}")
                        copies.setdefault(node, []).append(new)
                    new.meta = _meta(node, narrow(_val(node), c))
        for node in run:                         # values read after the run: whole again
            outside = [u for u in node.users if u not in members]
            if not outside:
                continue
            parts = [chunk_arg(node, c) for c in range(chunks)]
            whole = graph.create_node("call_function", torch.cat, (parts,), {"dim": 0}, name=f"{node.name}_whole")
            whole.meta = _meta(node, _val(node))
            for user in outside:
                user.replace_input_with(node, whole)
    for node in reversed(run):
        graph.erase_node(node)


def overlap_tp_forward(gm: fx.GraphModule, layers: list[str], chunks: int) -> int:
    """Chunk every run of ``gm`` that holds an all-reduce; the number of runs rewritten.

    Args:
        gm: a stage GraphModule after the tensor-parallel rewrite, with ``meta['val']`` on its nodes.
        layers: the model's layer paths (``model_layers.layer_paths``): a run stays within one.
        chunks: k >= 2, the number of row chunks.
    """
    runs = find_runs(gm, layers, chunks)
    for run in runs:
        chunk_run(gm, run, chunks)
    if runs:
        gm.graph.lint()
        gm.recompile()
    return len(runs)


class OverlapTensorParallel(MetaPass):
    """Requires the split stages (and their nodes' ``meta['val']``); rewrites each stage module in
    place when ``options.tp_overlap_chunks`` >= 2 and tp > 1 (1D).  Runs after the stage table is
    built: the plan prices the unchunked compute and does not credit the overlap."""

    requires_state = ("split", "stage_infos")

    def __init__(self, state: PlanState):
        self.state = state

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        chunks = self.state.options.tp_overlap_chunks
        layers = layer_paths(self.state.model)
        changed = False
        for stage in self.state.split.stages:
            changed |= overlap_tp_forward(stage, layers, chunks) > 0
        return PassResult(graph_module, changed)
