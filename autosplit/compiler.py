"""``autosplit.compile``: from an unchanged model and one example microbatch to a Plan.

Terms: see plan.py (stage, layers, memory), passes/infra.py (pass, node metadata, plan state) and
options.py (the options).

The whole pipeline, every step a pass (passes/infra.py ``MetaPass``) run by one torch.fx
``PassManager`` (``run_passes``), which checks each pass's ``requires`` / ``ensures`` and that the
order below meets them:

    TraceModel                nn.Module -> GraphModule, meta['module_path']       passes/trace_model.py
    ExampleShapeProp          meta['val'] on meta tensors                         passes/shape_prop.py
    CheckSingleOutput         refuse a tuple / dict output                        passes/check_output.py
    TensorParallel            1D / 1D + sequence parallel / 2D / 2.5D / 3D rewrite (auto: the fastest), meta['spec'], state.tp_plan
                                                                                  passes/tensor_parallel.py
    [ExampleShapeProp]        tp > 1: again, for tp rank 0's local shapes
    [AutocastDtypeProp]       autocast: the dtypes torch.autocast gives           passes/autocast_prop.py
    SimulateSchedule          deadlock-free; activations in flight per stage      passes/schedule_peak.py
    AnnotateCosts             meta['cost'], state.unknown_ops                     cost_model/annotate.py
    FindCuts                  state.cuts, state.segments                          passes/cut_points.py
    CostSegments              state.costs (time, transfer, memory per segment)    passes/cost_segments.py
    ChooseStageBounds         state.bounds, the dp sharding, the baseline cut     passes/stage_bounds.py
    AssignStages              meta['stage']                                       passes/assign_stages.py
    SplitStages               one GraphModule per stage, state.split              passes/split_stages.py
    BuildStageInfos           state.stage_infos (the stage table)                 passes/stage_infos.py
    [OverlapTensorParallel]   tp_overlap_chunks > 1: forward all-reduces overlap  passes/tp_overlap.py
                              row chunks' compute (rewrites the stage modules)

``compile`` checks the options (options.py), runs the passes and puts their results into a Plan.
Nothing here allocates a weight: parameters may live on the meta device.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import nn

from autosplit import validate
from autosplit.cost_model import AnnotateCosts, get_profile
from autosplit.deprecated import positional_keywords
from autosplit.mesh import MeshShape, node_layout_note
from autosplit.model_layers import layer_paths
from autosplit.options import AUTOCAST, LINEAR_2D_FORMS, TP_MODES, PlanOptions   # noqa: F401 (re-exported)
from autosplit.passes.assign_stages import AssignStages
from autosplit.passes.autocast_prop import AutocastDtypeProp
from autosplit.passes.batch_norm import find_batch_norms, warn_batch_norm
from autosplit.passes.check_output import CheckSingleOutput
from autosplit.passes.cost_segments import CostSegments
from autosplit.passes.cut_points import FindCuts
from autosplit.passes.infra import MetaPass, PlanState, run_passes
from autosplit.passes.schedule_peak import SimulateSchedule
from autosplit.passes.shape_prop import ExampleShapeProp
from autosplit.passes.split_stages import SplitStages
from autosplit.passes.stage_bounds import ChooseStageBounds
from autosplit.passes.stage_infos import BuildStageInfos
from autosplit.passes.tensor_parallel import TensorParallel
from autosplit.passes.tp_overlap import OverlapTensorParallel
from autosplit.passes.trace_model import TraceModel
from autosplit.plan import Plan
from autosplit.trace import kept_module_state

_DEFAULTS = PlanOptions()
_OPTION_NAMES = frozenset(PlanOptions.names())
# compile's old positional parameters after example_input, in their old order (keyword-only now)
POSITIONAL_OPTIONS = ("tp_mode", "schedule", "chunks_per_rank", "num_microbatches")


def plan_passes(state: PlanState) -> list[MetaPass]:
    """The planning pipeline for ``state``'s options, in order (see the module docstring)."""
    opts = state.options
    passes: list[MetaPass] = [TraceModel(state), ExampleShapeProp(state.inputs, model=state.model,
                                                                         concrete_args=opts.concrete_args),
                              CheckSingleOutput(), TensorParallel(state)]
    if state.mesh.block > 1:
        passes.append(ExampleShapeProp(state.inputs))          # the local shapes of tp rank 0 (our graph)
    if opts.autocast is not None:
        passes.append(AutocastDtypeProp(state.inputs, opts.autocast, state.profile.device_type))
    passes += [SimulateSchedule(state), AnnotateCosts(state), FindCuts(state), CostSegments(state),
               ChooseStageBounds(state), AssignStages(state), SplitStages(state.n_stages, state),
               BuildStageInfos(state)]
    if state.mesh.block > 1 and opts.tp_overlap_chunks > 1:
        passes.append(OverlapTensorParallel(state))
    return passes


def compile(model: nn.Module, mesh=(1, 1, 1), example_input=None, *old_positional,
            tp_mode: str = "1d", schedule: str = "1f1b", chunks_per_rank: int = 1, num_microbatches: int | None = None,
            device="h100", memory_budget: float | str | None = None, leaf_modules: Sequence = (),
            concrete_args: dict | None = None, stage_bounds: Sequence[int] | None = None,
            sequence_parallel: bool = False, autocast: torch.dtype | None = None, recompute: str | None = None,
            tp_2d_form: str = "auto", tp_depth: int | None = None, dp_shard: bool | str = False,
            tp_overlap_chunks: int = 1, cp_attention: str = "auto", options: PlanOptions | None = None,
            **renamed) -> Plan:
    """Plan ``model`` for ``mesh=(pp, tp, dp)``; see the README and the API contract.

    Args:
        model: the unchanged ``nn.Module`` (its parameters may be on the meta device).
        mesh: (pp, tp, dp), a "PP,TP,DP" string, or a MeshShape.  Default one device, (1, 1, 1): offline
            there is no world for dp=-1 (``parallelize``'s default) to fill.
        example_input: one microbatch (a tensor or a tuple of tensors; meta tensors are enough).
        options: the options as a ``PlanOptions``; keyword arguments given beside it override its
            fields.  Every other argument is a ``PlanOptions`` field, documented there, keyword-only and
            in its order (``parallelize`` takes the same ones in the same order): tp_mode, schedule,
            chunks_per_rank, num_microbatches (None: 2 * pp), device, memory_budget, leaf_modules,
            concrete_args, stage_bounds, sequence_parallel, autocast, recompute, tp_2d_form, tp_depth,
            dp_shard, tp_overlap_chunks, cp_attention.
        old_positional, renamed: deprecated for one release (autosplit/deprecated.py): tp_mode, schedule,
            chunks_per_rank and num_microbatches passed positionally after example_input, and
            ``checkpoint=`` (now ``recompute=``); each warns with a DeprecationWarning.
    Returns:
        the Plan: stage table (``plan.summary()``), per-rank modules, ``plan.dump(directory)``.
    """
    # every parameter named like an option, as given (first statement: locals() holds the parameters only)
    values = {k: v for k, v in locals().items() if k in _OPTION_NAMES}
    values.update(positional_keywords("compile", POSITIONAL_OPTIONS, old_positional, values, vars(_DEFAULTS)))
    changed = _DEFAULTS.changed(values)
    return compile_with(model, mesh, example_input, PlanOptions.from_kwargs("compile", {**changed, **renamed}, options))


def plan_state(model: nn.Module, mesh, example_input, options: PlanOptions) -> PlanState:
    """Check the arguments and the options; the PlanState the passes start from (no pass has run)."""
    mesh = MeshShape.parse(mesh)
    validate.model(model)
    options.check(mesh, microbatches_default=f" (or None for 2 * pp = {2 * mesh.pp})")
    inputs = validate.example_inputs(model, example_input)
    budget = validate.memory_budget(options.memory_budget)
    validate.concrete_args(model, len(inputs), options.concrete_args)
    return PlanState(model=model, inputs=inputs, mesh=mesh, options=options, profile=get_profile(options.device),
                     num_microbatches=options.num_microbatches or 2 * mesh.pp,
                     n_stages=mesh.pp * options.chunks_per_rank, budget=budget,
                     leaves=validate.leaf_modules(model, options.leaf_modules), layers=layer_paths(model))


def compile_with(model: nn.Module, mesh, example_input, options: PlanOptions, warn: bool = True) -> Plan:
    """``compile`` with its options as one ``PlanOptions`` (what ``parallelize`` and the CLI call);
    ``warn``: give the BatchNorm note as a warning too (``parallelize`` does once per call)."""
    state = plan_state(model, mesh, example_input, options)
    # the passes run the model's code (trace, and leaves' forwards in every shape propagation): the
    # model, whose modules the stage modules share, keeps none of what that wrote (trace.ModuleState)
    with kept_module_state(model):
        gm = run_passes(plan_passes(state), model)
    plan = Plan(mesh=state.mesh, tp_mode=options.tp_mode, schedule=options.schedule,
                chunks_per_rank=options.chunks_per_rank, num_microbatches=state.num_microbatches,
                device=state.profile.name, example_shapes=[tuple(x.shape) for x in state.inputs],
                example_dtypes=[str(x.dtype).removeprefix("torch.") for x in state.inputs],
                stages=state.stage_infos, equal_layer_times=state.baseline_times,
                equal_layer_bounds=state.baseline_bounds, unknown_ops=state.unknown_ops, bounds=state.bounds,
                graph=gm, modules=state.split.stages, tp_plan=state.tp_plan,
                schedule_grid=state.schedule_result.format_grid(),
                autocast=None if options.autocast is None else str(options.autocast).removeprefix("torch."),
                recompute=options.recompute, layer_end_segments=state.layer_ends, dp_shard=state.dp_shard,
                profile=state.profile, batch_norms=find_batch_norms(gm), cp_attention=options.cp_attention)
    if warn:
        warn_batch_norm(plan.batch_norm_note(), stacklevel=4)   # at compile's caller
        note = node_layout_note(state.mesh, state.profile.gpus_per_node)
        if note:                                                # the layout cannot keep tp inside a node
            warnings.warn(f"autosplit: {note}", stacklevel=3)
    return plan
