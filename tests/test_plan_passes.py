"""The planning pipeline: every step a MetaPass under one PassManager, its order checked from the
passes' requires / ensures declarations, their contracts checked around each pass."""
import pytest
import torch

from autosplit.compiler import compile_with, plan_passes, plan_state
from autosplit.errors import AutosplitError
from autosplit.options import PlanOptions
from autosplit.passes.infra import MetaPass, run_passes
from tests.models import timm_cls

X = torch.randn(2, 3, 32, 32)


def _state(**options):
    return plan_state(timm_cls(depth=2), (2, 1, 1), X, PlanOptions(**options))


def test_the_pipeline_is_passes_and_states_every_step():
    state = _state(autocast=torch.bfloat16)
    names = [type(p).__name__ for p in plan_passes(state)]
    assert names == ["TraceModel", "ExampleShapeProp", "CheckSingleOutput", "TensorParallel", "AutocastDtypeProp",
                     "SimulateSchedule", "AnnotateCosts", "FindCuts", "CostSegments", "ChooseStageBounds",
                     "AssignStages", "SplitStages", "BuildStageInfos"]
    assert all(isinstance(p, MetaPass) for p in plan_passes(state))
    tp = plan_state(timm_cls(depth=2), (1, 2, 1), X, PlanOptions())
    assert [type(p).__name__ for p in plan_passes(tp)][3:5] == ["TensorParallel", "ExampleShapeProp"]


def test_the_passes_give_what_compile_returns():
    state = _state()
    gm = run_passes(plan_passes(state), state.model)
    plan = compile_with(timm_cls(depth=2), (2, 1, 1), X, PlanOptions())
    assert state.bounds == plan.bounds and len(state.split.stages) == plan.n_stages == 2
    assert all({"module_path", "val", "cost", "stage", "spec"} <= set(n.meta) for n in gm.graph.nodes)


def test_a_pass_before_what_it_requires_is_refused_before_anything_runs():
    state = _state()
    passes = plan_passes(state)
    split = next(i for i, p in enumerate(passes) if type(p).__name__ == "SplitStages")
    passes.insert(split - 2, passes.pop(split))          # SplitStages before AssignStages (meta['stage'])
    with pytest.raises(RuntimeError, match="pass schedule constraint violated"):
        run_passes(passes, state.model)
    assert state.produced == set()                        # nothing ran


def test_a_requirement_no_pass_ensures_is_named():
    state = _state()
    passes = [p for p in plan_passes(state) if type(p).__name__ != "CostSegments"]
    with pytest.raises(RuntimeError, match=r"ChooseStageBounds requires state:costs, which no pass of the pipeline"):
        run_passes(passes, state.model)


def test_a_pass_error_reaches_the_caller_as_itself():
    state = plan_state(timm_cls(depth=2), (40, 1, 1), X, PlanOptions())
    with pytest.raises(AutosplitError, match=r"= 40 stages, but the graph has only") as info:
        run_passes(plan_passes(state), state.model)
    assert any("FindCuts" in note for note in getattr(info.value, "__notes__", []))
