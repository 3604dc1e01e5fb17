"""The stage table as a planning pass: one ``StageInfo`` per stage, from the split graph and the costs.

Terms: see autosplit/stage_info.py (the fields) and plan.py (stage, layers, memory).
  shown -- nodes that do work or hold parameters (``cost.fwd_flops > 0`` or ``cost.param_bytes > 0``):
           the layers label skips Identity, Dropout(p=0) and views.
Predicted times: forward / backward per microbatch (backward plus checkpointing's recomputation, and
the part a split backward defers to W), the boundary transfer plus tensor-parallel communication, and
the dp collectives per step; memory: the dp state as sharded + in flight x kept + recompute.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

from autosplit.cost_model import graph_time
from autosplit.cost_model.weight_grad import split_backward_time
from autosplit.model_layers import layers_label
from autosplit.passes.infra import MetaPass, PlanState
from autosplit.passes.shape_prop import tensor_bytes
from autosplit.passes.split_backward import weight_gemm_nodes
from autosplit.segment_costs import comm_time
from autosplit.stage_info import StageInfo, TensorInfo


def _visible(node: fx.Node) -> bool:
    cost = node.meta.get("cost")
    return cost is not None and (cost.fwd_flops > 0 or cost.param_bytes > 0)


def tensor_infos(nodes: list[fx.Node]) -> list[TensorInfo]:
    """Name, shape, dtype and bytes of each node's value (a non-tensor: its type name, 0 bytes)."""
    infos = []
    for node in nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            infos.append(TensorInfo(node.name, tuple(val.shape), str(val.dtype).removeprefix("torch."),
                                    tensor_bytes(val)))
        else:
            infos.append(TensorInfo(node.name, (), type(val).__name__, 0))
    return infos


def stage_compute_times(nodes: list[fx.Node], gemms: set, profile) -> tuple[float, float, float]:
    """(forward s, backward s, W s) per microbatch of one stage's ``nodes`` under ``profile``: W is the part
    of the backward a split backward defers (``gemms``: the graph's ``weight_gemm_nodes``); recomputation
    is not included (the caller adds it)."""
    fwd, bwd = graph_time(nodes, profile)
    return fwd, bwd, split_backward_time(nodes, gemms, profile)[1]


class BuildStageInfos(MetaPass):
    """Requires meta['stage'] and meta['cost'], the split, costs, bounds and dp costs.
    Ensures ``state.stage_infos``."""

    requires_meta = ("stage", "cost")
    requires_state = ("split", "costs", "bounds", "dp_costs", "placement")
    ensures_state = ("stage_infos",)

    def __init__(self, state: PlanState):
        self.state = state

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        s, seg, bounds = self.state, self.state.costs, self.state.bounds
        all_nodes = [n for part in seg.segments for n in part]
        by_name = {n.name: n for n in all_nodes}
        result = all_nodes[-1].args[0]                 # the model's output (the output node's argument)
        by_name["output"] = result if isinstance(result, fx.Node) else all_nodes[-1]
        shown = [n for n in all_nodes if _visible(n)]
        gemms = set(weight_gemm_nodes(graph_module))
        infos = []
        for st, module in enumerate(s.split.stages):
            nodes = [n for n in all_nodes if n.meta.get("stage") == st]
            fwd, bwd, w = stage_compute_times(nodes, gemms, seg.profile)
            params = dict(module.named_parameters())
            param_bytes = sum(p.numel() * p.element_size() for p in params.values())
            first = bounds[st - 1] + 1 if st else 0
            dp = s.dp_costs(first, bounds[st], param_bytes)
            kept, recompute = seg.activations(first, bounds[st])
            infos.append(StageInfo(
                index=st, pp_rank=s.placement.rank(st), chunk=s.placement.chunk(st),
                layers=layers_label(s.layers, [n for n in shown if n.meta["stage"] == st], shown),
                nodes=[n.name for n in nodes], params=list(params),
                n_params=sum(p.numel() for p in params.values()),
                param_bytes=param_bytes, fwd_time=fwd, bwd_time=bwd + seg.recompute_time(nodes),
                comm_time=seg.boundary_time(bounds[st]) + comm_time(nodes, s.mesh.block, seg.profile) +
                seg.recompute_comm(nodes), recompute_comm=seg.recompute_comm(nodes),
                activation_bytes=kept, in_flight=seg.in_flight[st],
                memory_bytes=int(dp.memory_bytes) + seg.in_flight[st] * kept + recompute,
                dp_bytes=int(dp.traffic_bytes), dp_time=dp.time, dp_buckets=dp.buckets,
                dp_gather=dp.gather, dp_units=dp.units,
                inputs=tensor_infos([by_name[n] for n in s.split.inputs[st]]),
                outputs=tensor_infos([by_name[n] for n in s.split.outputs[st]]),
                recompute_bytes=recompute, w_time=w))
        s.put(stage_infos=infos)
        return PassResult(graph_module, False)
