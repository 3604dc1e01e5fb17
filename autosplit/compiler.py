"""``autosplit.compile``: from an unchanged model and one example microbatch to a Plan.

Terms: see plan.py (stage, layers, memory) and passes/cut_points.py (cut, segment).

Steps, each a graph pass or a pure function:
  validate -> trace -> MetaShapeProp [-> AutocastDtypeProp] -> AnnotateCosts -> find_cuts
  -> balanced_bounds (or the user's stage_bounds) -> assign stages -> SplitStages -> Plan.
Nothing here allocates a weight: parameters may live on the meta device.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate
from torch import nn

from autosplit import validate
from autosplit.cost_model.weight_grad import split_backward_time
from autosplit.cost_model import AnnotateCosts, get_profile, graph_time
from autosplit.cost_model.comm import linear_2d_time
from autosplit.cost_model.sharding import StageDataParallel, candidates
from autosplit.errors import AutosplitError, PlanError
from autosplit.model_layers import find_layer_ends, first_layer_segment, layer_paths, layers_label
from autosplit.mesh import MeshShape
from autosplit.passes.autocast_prop import AutocastDtypeProp
from autosplit.passes.check_output import check_single_output
from autosplit.passes.cut_points import Cut, find_cuts
from autosplit.passes.partition import balanced_bounds, stage_costs, torchtitan_bounds
from autosplit.passes.shape_prop import MetaShapeProp, tensor_bytes
from autosplit.passes.split_stages import SplitStages
from autosplit.passes.split_backward import weight_gemm_nodes
from autosplit.passes.tp2d import shard_2d
from autosplit.passes.tp_rewrite import shard_tensor_parallel
from autosplit.passes.tp_sequence import apply_sequence_parallel
from autosplit.plan import Plan, StageInfo, TensorInfo
from autosplit.schedule import SCHEDULES, SPLIT_BACKWARD, check_schedule, placement_of
from autosplit.segment_costs import CHECKPOINTS, OPTIMIZER_FACTOR, SegmentCosts, comm_time
from autosplit.trace import trace

TP_MODES = ("1d", "2d")
LINEAR_2D_FORMS = ("allgather", "summa")
AUTOCAST = (None, torch.bfloat16, torch.float16)


def _check_args(model, mesh: MeshShape, tp_mode: str, schedule: str, chunks_per_rank: int, num_microbatches,
                autocast, checkpoint, sequence_parallel) -> None:
    validate.model(model)
    validate.one_of("tp_mode", tp_mode, TP_MODES)
    if tp_mode == "2d":
        q = math.isqrt(mesh.tp)
        if q * q != mesh.tp:
            raise AutosplitError(f"tp_mode='2d' arranges tp ranks in a q x q grid, so tp must be a perfect square; "
                                 f"tp={mesh.tp} is not (nearest squares: {q * q} = {q}x{q} and {(q + 1) ** 2} = "
                                 f"{q + 1}x{q + 1})")
        if sequence_parallel and mesh.tp > 1:
            raise AutosplitError("sequence_parallel=True applies to tp_mode='1d'; tp_mode='2d' already splits "
                                 "every activation over both tp axes (batch over tp_row, channels over tp_col)")
    validate.one_of("schedule", schedule, SCHEDULES)
    validate.positive_int("chunks_per_rank", chunks_per_rank)
    if schedule == "interleaved" and chunks_per_rank < 2:
        raise AutosplitError(f"schedule='interleaved' needs chunks_per_rank >= 2 (got {chunks_per_rank})")
    if schedule in ("1f1b", "zb-h1") and chunks_per_rank != 1:
        raise AutosplitError(f"schedule={schedule!r} runs one chunk per rank (got chunks_per_rank="
                             f"{chunks_per_rank}); use schedule='interleaved' or 'zb-v' for several")
    if schedule == "zb-v" and chunks_per_rank != 2:
        raise AutosplitError(f"schedule='zb-v' runs two chunks per rank in a V (rank r holds stages r and "
                             f"2*pp-1-r); got chunks_per_rank={chunks_per_rank}, use 2")
    if num_microbatches is not None:
        validate.positive_int("num_microbatches", num_microbatches,
                              f" (or None for 2 * pp = {2 * mesh.pp})")
    if not any(autocast is a for a in AUTOCAST):
        raise AutosplitError(f"autocast={autocast!r}: expected None, torch.bfloat16 or torch.float16")
    validate.one_of("checkpoint", checkpoint, CHECKPOINTS)
    if not isinstance(sequence_parallel, bool):
        raise AutosplitError(f"sequence_parallel={sequence_parallel!r}: expected True or False")


def _shape_prop(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> None:
    try:
        MetaShapeProp(inputs)(gm)
    except AutosplitError as exc:
        shapes = ", ".join(str(tuple(x.shape)) for x in inputs)
        raise AutosplitError(f"{exc}\nexample_input has shape {shapes}; it must be one microbatch "
                             f"of what the model's forward takes, batch dim first (e.g. (B, C, H, W))") from exc


def _segments(nodes: list[fx.Node], cuts: list[Cut]) -> list[list[fx.Node]]:
    ends = [c.position for c in cuts] + [len(nodes) - 1]
    segments, start = [], 0
    for end in ends:
        segments.append(nodes[start:end + 1])
        start = end + 1
    return segments


def _in_flight(result, place) -> list[int]:
    """Microbatches whose activations each stage holds at the schedule's peak (from the simulator)."""
    return [max(1, -(-result.peak_activations[place.rank(s)] // place.v)) for s in range(place.num_stages)]


def compile(model: nn.Module, mesh=(1, 1, 1), example_input=None, tp_mode: str = "1d",
            schedule: str = "1f1b", chunks_per_rank: int = 1, num_microbatches: int | None = None, *,
            device="h100", memory_budget: float | str | None = None, leaf_modules: Sequence = (),
            concrete_args: dict | None = None, stage_bounds: Sequence[int] | None = None,
            sequence_parallel: bool = False, autocast: torch.dtype | None = None,
            checkpoint: str | None = None, tp_2d_form: str = "auto", dp_shard: bool | str = False) -> Plan:
    """Plan ``model`` for ``mesh=(pp, tp, dp)``; see the README and the API contract.

    Args:
        device: the cost-model profile: "h100", "h200", "a100", "cpu" (measured here) or a DeviceProfile.
        memory_budget: bytes per stage the cut must respect: a number, or a string such as "8GiB",
            "512MiB", "1.5GB".
        num_microbatches: a positive integer; None means 2 * pp.
        leaf_modules: module classes torch.fx must not trace into: classes, "package.module.ClassName",
            or a class name that names one class among the model's submodules.
        concrete_args: values for forward parameters after the example inputs.
        sequence_parallel: with tp > 1, also shard the token dim between tensor-parallel regions.
        stage_bounds: reuse another plan's cut (``plan.bounds``) instead of searching, e.g. to re-plan
            the same model for a new batch size while keeping every parameter on the same rank.
        autocast: None, torch.bfloat16 or torch.float16: plan for training under ``torch.autocast``
            (matmuls at the half-precision peak, activations and boundaries in the dtype autocast gives).
        checkpoint: None, "stage" or "block": plan for activation recomputation (memory and time).
        tp_2d_form: with tp_mode="2d", how each linear multiplies its blocks: "allgather" (gather the
            activation over tp_col and the weight over tp_row, one GEMM), "summa" (q broadcast steps,
            smaller transient buffers) or "auto" (whichever the cost model prices lower, per layer).
        dp_shard: False (replicated dp), "stage" or "layer" (FSDP2 units over dp; runtime/fsdp.py), or
            True: "stage" where it fits ``memory_budget``, else "layer" (cost_model/sharding.py).
    """
    mesh = MeshShape.parse(mesh)
    if schedule in SPLIT_BACKWARD and dp_shard:
        raise AutosplitError(f"schedule={schedule!r} with dp_shard={dp_shard!r}: FSDP2 reduce-scatters a module's "
                             f"gradients when its backward ends, but a zero-bubble schedule computes the weight "
                             f"gradients later, in W; use dp_shard=False (replicated dp) or schedule='1f1b'")
    _check_args(model, mesh, tp_mode, schedule, chunks_per_rank, num_microbatches, autocast, checkpoint,
                sequence_parallel)
    inputs = validate.example_inputs(model, example_input)
    budget = validate.memory_budget(memory_budget)
    validate.concrete_args(model, len(inputs), concrete_args)
    leaves = validate.leaf_modules(model, leaf_modules)
    profile = get_profile(device)
    num_microbatches = 2 * mesh.pp if num_microbatches is None else num_microbatches
    n_stages = mesh.pp * chunks_per_rank
    simulated = check_schedule(schedule, mesh.pp, num_microbatches, chunks_per_rank)  # proves it deadlock-free
    place = placement_of(schedule, mesh.pp, chunks_per_rank)
    in_flight = _in_flight(simulated, place)

    validate.one_of("tp_2d_form", tp_2d_form, ("auto",) + LINEAR_2D_FORMS)
    form = _form_chooser(tp_2d_form, math.isqrt(mesh.tp), profile)
    gm, tp_plan = _graph(model, inputs, mesh.tp, sequence_parallel, leaves, concrete_args, tp_mode, form)
    if autocast is not None:
        AutocastDtypeProp(inputs, autocast, profile.device_type)(gm)
    annotate = AnnotateCosts()
    annotate(gm)
    cuts = find_cuts(gm)
    if n_stages > len(cuts) + 1:
        raise AutosplitError(
            f"pp({mesh.pp}) * chunks_per_rank({chunks_per_rank}) = {n_stages} stages, but the graph has only "
            f"{len(cuts)} places to cut (at most {len(cuts) + 1} stages); use fewer pipeline stages")
    layers = layer_paths(model)
    segments = _segments(list(gm.graph.nodes), cuts)
    seg = SegmentCosts(segments, cuts, mesh.tp, profile, in_flight, checkpoint=checkpoint, layers=layers,
                       input_bytes=sum(tensor_bytes(x) for x in inputs))
    options = candidates(dp_shard, mesh.dp) if mesh.dp > 1 else [None]
    for sharding in options:        # in order of preference: the first whose cut fits the budget
        dpc = StageDataParallel(segments, seg.params, layers, mesh.dp, num_microbatches, sharding, profile,
                                0.5 if autocast is not None else 1.0)
        def memory(s, a, b, dpc=dpc):          # the dp state as sharded, instead of 4 x parameter bytes
            return seg.memory(s, a, b) - OPTIMIZER_FACTOR * sum(seg.params[a:b + 1]) + dpc(a, b).memory_bytes
        try:
            if stage_bounds is not None:
                bounds = validate.stage_bounds(stage_bounds, n_stages, len(segments))
                if budget is not None and sharding != options[-1] and max(
                        memory(s, a + 1, b) for s, (a, b) in enumerate(zip([-1, *bounds], bounds))) > budget:
                    continue
            else:
                bounds = balanced_bounds(seg.time, seg.out_time, n_stages, memory, budget, seg_params=seg.params)
            break
        except PlanError:
            if sharding == options[-1]:
                raise
    layer_ends = find_layer_ends(layers, segments)
    baseline = torchtitan_bounds(layer_ends, first_layer_segment(layers, segments) - 1, len(segments), n_stages)
    _assign_stages(segments, bounds)
    split = SplitStages(n_stages)
    split(gm)
    return Plan(mesh=mesh, tp_mode=tp_mode, schedule=schedule, chunks_per_rank=chunks_per_rank,
                num_microbatches=num_microbatches, device=profile.name,
                example_shapes=[tuple(x.shape) for x in inputs],
                example_dtypes=[str(x.dtype).removeprefix("torch.") for x in inputs],
                stages=_stage_infos(layers, mesh, split, seg, bounds, dpc, place),
                equal_layer_times=None if baseline is None else stage_costs(baseline, seg.time, seg.out_time),
                equal_layer_bounds=baseline,
                unknown_ops=list(annotate.unknown_ops), bounds=bounds, graph=gm, modules=split.stages,
                tp_plan=tp_plan, schedule_grid=simulated.format_grid(),
                autocast=None if autocast is None else str(autocast).removeprefix("torch."),
                checkpoint=checkpoint, layer_end_segments=layer_ends, dp_shard=sharding)


def _form_chooser(choice: str, q: int, profile):
    """fn(node, x_val, w_shape) -> the 2D linear form: the user's, or the one the cost model prices lower."""
    def form(node, x, w_shape):
        if choice != "auto":
            return choice
        x_bytes = tensor_bytes(x) / (q * q)                        # the (B/q, ..., in/q) block
        w_bytes = math.prod(w_shape) * x.element_size() / (q * q)  # the (out/q, in/q) block
        times = {f: sum(linear_2d_time(x_bytes, w_bytes, q, f, profile)) for f in LINEAR_2D_FORMS}
        return min(LINEAR_2D_FORMS, key=times.get)
    return form


def _graph(model, inputs, tp: int, sequence_parallel: bool, leaf_modules, concrete_args, tp_mode="1d", form=None):
    """Traced, shape-annotated graph; with tp > 1 rewritten for tensor parallelism (local shapes of
    tp rank 0) together with the TensorParallelPlan that builds the other ranks' modules."""
    gm = trace(model, len(inputs), leaf_modules=leaf_modules, concrete_args=concrete_args)
    _shape_prop(gm, inputs)
    check_single_output(gm)          # a tuple or dict output: refused here, with what to do instead
    if tp == 1:
        for n in gm.graph.nodes:
            n.meta["spec"] = {"tp": Replicate()}     # one placement per sharding axis (dp splits rows only)
        return gm, None
    if tp_mode == "2d":
        tp_plan = shard_2d(gm, math.isqrt(tp), form)
        gm = fx.GraphModule(tp_plan.local_root(0, gm.graph), gm.graph, type(model).__name__)
        _shape_prop(gm, inputs)
        return gm, tp_plan
    tp_plan = shard_tensor_parallel(gm, tp)
    if sequence_parallel:
        apply_sequence_parallel(gm, tp_plan)
    gm = fx.GraphModule(tp_plan.local_root(0, gm.graph), gm.graph, type(model).__name__)
    _shape_prop(gm, inputs)
    return gm, tp_plan


def _visible(node: fx.Node) -> bool:
    cost = node.meta.get("cost")
    return cost is not None and (cost.fwd_flops > 0 or cost.param_bytes > 0)


def _assign_stages(segments: list[list[fx.Node]], bounds: list[int]) -> None:
    stage = 0
    for k, seg in enumerate(segments):
        for n in seg:
            n.meta["stage"] = stage
        if k == bounds[stage] and stage < len(bounds) - 1:
            stage += 1
    # A parameter read, and what is computed from parameters alone (2D's gathers of a parameter's
    # blocks), belongs to the stage of its first user: no parameter crosses a stage boundary.
    nodes = [n for seg in segments for n in seg]
    from_params = set()
    for n in nodes:
        if n.op == "get_attr" or (n.op == "call_function" and n.all_input_nodes
                                  and all(a in from_params for a in n.all_input_nodes)):
            from_params.add(n)
    for n in reversed(nodes):
        if n in from_params and n.users:
            n.meta["stage"] = min(u.meta["stage"] for u in n.users)


def _tensor_infos(nodes: list[fx.Node]) -> list[TensorInfo]:
    infos = []
    for node in nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            infos.append(TensorInfo(node.name, tuple(val.shape), str(val.dtype).removeprefix("torch."),
                                    tensor_bytes(val)))
        else:
            infos.append(TensorInfo(node.name, (), type(val).__name__, 0))
    return infos


def _stage_infos(layers: list[str], mesh: MeshShape, split: SplitStages, seg: SegmentCosts, bounds,
                 dpc: StageDataParallel, place) -> list[StageInfo]:
    all_nodes = [n for s in seg.segments for n in s]
    by_name = {n.name: n for n in all_nodes}
    result = all_nodes[-1].args[0]                    # the model's output (the output node's argument)
    by_name["output"] = result if isinstance(result, fx.Node) else all_nodes[-1]
    shown = [n for n in all_nodes if _visible(n)]     # labels skip Identity, Dropout(p=0), views
    gemms = set(weight_gemm_nodes(all_nodes[0].graph.owning_module))
    infos = []
    for s, module in enumerate(split.stages):
        nodes = [n for n in all_nodes if n.meta.get("stage") == s]
        fwd, bwd = graph_time(nodes, seg.profile)
        params = dict(module.named_parameters())
        param_bytes = sum(p.numel() * p.element_size() for p in params.values())
        first = bounds[s - 1] + 1 if s else 0
        dp = dpc(first, bounds[s], param_bytes)
        kept, recompute = seg.activations(first, bounds[s])
        infos.append(StageInfo(
            index=s, pp_rank=place.rank(s), chunk=place.chunk(s),
            layers=layers_label(layers, [n for n in shown if n.meta["stage"] == s], shown),
            nodes=[n.name for n in nodes], params=list(params), n_params=sum(p.numel() for p in params.values()),
            param_bytes=param_bytes, fwd_time=fwd, bwd_time=bwd + seg.recompute_time(nodes),
            comm_time=seg.boundary_time(bounds[s]) + comm_time(nodes, mesh.tp, seg.profile),
            activation_bytes=kept, in_flight=seg.in_flight[s],
            memory_bytes=int(dp.memory_bytes) + seg.in_flight[s] * kept + recompute,
            dp_bytes=int(dp.traffic_bytes), dp_time=dp.time,
            inputs=_tensor_infos([by_name[n] for n in split.inputs[s]]),
            outputs=_tensor_infos([by_name[n] for n in split.outputs[s]]),
            recompute_bytes=recompute, w_time=split_backward_time(nodes, gemms, seg.profile)[1]))
    return infos
