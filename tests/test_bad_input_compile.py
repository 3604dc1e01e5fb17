"""A corpus of bad calls to autosplit.compile: each raises an AutosplitError (or one of its kinds)
whose message names the argument and shows the value or the arithmetic."""
import pytest
import torch

import autosplit
from autosplit.errors import AutosplitError, PlanError, RankError
from tests.models import HandViT, timm_cls

X = torch.randn(2, 3, 32, 32)


def _call(**overrides):
    kwargs = dict(model=timm_cls(depth=2), mesh=(2, 1, 1), example_input=X)
    kwargs.update(overrides)
    return autosplit.compile(**kwargs)


CASES = [  # (id, compile overrides, exception type, regex the message must match)
    ("model_not_module", dict(model={"w": torch.zeros(1)}), AutosplitError, r"model is a builtins\.dict; expected a torch\.nn\.Module"),
    ("model_is_class", dict(model=HandViT), AutosplitError, r"model is a builtins\.type; expected a torch\.nn\.Module"),
    ("mesh_two_axes", dict(mesh=(2, 1)), AutosplitError, r"mesh=\(2, 1\): expected three integers"),
    ("mesh_zero_pp", dict(mesh=(0, 1, 1)), AutosplitError, r"mesh axis pp=0 must be a positive integer"),
    ("mesh_string_typo", dict(mesh="2;1;1"), AutosplitError, r"mesh '2;1;1': expected three integers"),
    ("microbatches_zero", dict(num_microbatches=0), AutosplitError, r"num_microbatches=0 \(int\) must be a positive integer \(or None for 2 \* pp = 4\)"),
    ("microbatches_negative", dict(num_microbatches=-3), AutosplitError, r"num_microbatches=-3 \(int\) must be a positive integer"),
    ("microbatches_float", dict(num_microbatches=4.0), AutosplitError, r"num_microbatches=4\.0 \(float\) must be a positive integer"),
    ("microbatches_bool", dict(num_microbatches=True), AutosplitError, r"num_microbatches=True \(bool\) must be a positive integer"),
    ("chunks_bool", dict(chunks_per_rank=True), AutosplitError, r"chunks_per_rank=True \(bool\) must be a positive integer"),
    ("chunks_string", dict(chunks_per_rank="2", schedule="interleaved"), AutosplitError, r"chunks_per_rank='2' \(str\) must be a positive integer"),
    ("interleaved_one_chunk", dict(schedule="interleaved"), AutosplitError, r"schedule='interleaved' needs chunks_per_rank >= 2 \(got 1\)"),
    ("schedule_typo", dict(schedule="1fb1"), AutosplitError, r"schedule='1fb1': expected one of 'gpipe', '1f1b', 'interleaved', 'zb-h1', 'zb-v' \(did you mean '1f1b'\?\)"),
    ("tp_mode_typo", dict(tp_mode="1D "), AutosplitError, r"tp_mode='1D ': expected one of '1d', '2d'"),
    ("recompute_typo", dict(recompute="blocks"), AutosplitError, r"recompute='blocks': expected one of None, 'stage', 'block' \(did you mean 'block'\?\)"),
    ("autocast_float32", dict(autocast=torch.float32), AutosplitError, r"autocast=torch\.float32: expected None, torch\.bfloat16 or torch\.float16"),
    ("autocast_string", dict(autocast="bf16"), AutosplitError, r"autocast='bf16': expected None, torch\.bfloat16 or torch\.float16"),
    ("device_unknown", dict(device="tpu-v5"), AutosplitError, r"device='tpu-v5': unknown device profile; valid names: h100, h200, a100, rtx3090, rtx4090, rtx5090, rtx_pro6000_maxq, cpu"),
    ("device_wrong_type", dict(device=3), AutosplitError, r"device=3 is a int; expected a profile name"),
    ("example_missing", dict(example_input=None), AutosplitError, r"example_input is required"),
    ("example_not_tensor", dict(example_input=[[1.0, 2.0]]), AutosplitError, r"example_input\[0\] is a list; expected a tensor"),
    ("example_numpy_like", dict(example_input=3.0), AutosplitError, r"example_input is a float; expected a tensor"),
    ("example_wrong_rank", dict(example_input=torch.randn(3, 32, 32)), AutosplitError, r"(?s)example_input has shape \(3, 32, 32\); it must be one microbatch"),
    ("example_empty_tuple", dict(example_input=()), AutosplitError, r"example_input is empty"),
    # (was a ZeroDivisionError reported as an autosplit bug)
    ("example_zero_rows", dict(example_input=torch.randn(0, 3, 32, 32)), AutosplitError,
     r"example_input has 0 rows \(shape \(0, 3, 32, 32\)\); a microbatch needs at least one sample"),
    ("budget_unit_typo", dict(memory_budget="8 GBs"), AutosplitError, r"memory_budget='8 GBs': expected bytes as a number or a string like '8GiB'"),
    ("budget_negative", dict(memory_budget=-1), AutosplitError, r"memory_budget=-1 = -1 bytes; it must be a positive"),
    ("budget_zero_string", dict(memory_budget="0GiB"), AutosplitError, r"memory_budget='0GiB' = 0 bytes"),
    ("budget_bool", dict(memory_budget=True), AutosplitError, r"memory_budget=True is a bool; expected bytes"),
    ("budget_too_small", dict(memory_budget="1KiB"), PlanError, r"no cut into 2 stages fits the memory budget of 0\.00 GiB"),
    ("concrete_unknown_key", dict(concrete_args={"mask": None}), AutosplitError, r"concrete_args key 'mask': VisionTransformer\.forward has no such parameter; it takes \(x, attn_mask"),
    ("concrete_fills_input", dict(concrete_args={"x": None}), AutosplitError, r"concrete_args key 'x' is forward parameter 0, which the 1 example input\(s\) already fill"),
    ("concrete_not_dict", dict(concrete_args=[("attn_mask", None)]), AutosplitError, r"concrete_args=\[\('attn_mask', None\)\]: expected a dict"),
    ("leaf_unknown_name", dict(leaf_modules=["Atention"]), AutosplitError, r"leaf_modules entry 'Atention': no submodule of VisionTransformer has that class name; close: Attention"),
    ("leaf_bad_import", dict(leaf_modules=["timm.layers.NoSuchBlock"]), AutosplitError, r"leaf_modules entry 'timm\.layers\.NoSuchBlock': cannot import it"),
    ("leaf_not_module_class", dict(leaf_modules=[int]), AutosplitError, r"leaf_modules entry <class 'int'> is not an nn\.Module class"),
    ("leaf_not_iterable", dict(leaf_modules=5), AutosplitError, r"leaf_modules=5: expected a list of nn\.Module classes"),
    ("bounds_short", dict(stage_bounds=[3]), AutosplitError, r"stage_bounds=\[3\]: 1 entries for 2 stages"),
    ("bounds_decreasing", dict(stage_bounds=[5, 2]), AutosplitError, r"stage_bounds=\[5, 2\]: not strictly increasing, stage 1 ends at segment 2 <= 5"),
    ("bounds_last_wrong", dict(stage_bounds=[1, 2]), AutosplitError, r"stage_bounds=\[1, 2\]: the last stage must end at the last segment, \d+ \(the graph has \d+ segments\), not 2"),
    ("bounds_negative", dict(stage_bounds=[-1, 0]), AutosplitError, r"stage_bounds=\[-1, 0\]: segment -1 < 0"),
    ("bounds_over_budget", dict(stage_bounds=[11, 23], memory_budget="1KiB"), PlanError, r"stage_bounds=\[11, 23\]: stage \d needs [\d.]+ MiB > the memory budget of 0\.00 MiB per stage; move the cut or raise the budget\n"),
    ("bounds_not_int", dict(stage_bounds=[1.0, 2.0]), AutosplitError, r"stage_bounds=\[1\.0, 2\.0\]: entries must be integers"),
    ("too_many_stages", dict(mesh=(40, 1, 1)), AutosplitError, r"pp\(40\) \* chunks_per_rank\(1\) = 40 stages, but the graph has only \d+ places to cut"),
    ("sequence_parallel_string", dict(sequence_parallel="yes"), AutosplitError, r"sequence_parallel='yes': expected True or False"),
]


@pytest.mark.parametrize("overrides,exc,match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_compile_call(overrides, exc, match):
    with pytest.raises(exc, match=match) as info:
        _call(**overrides)
    assert isinstance(info.value, AutosplitError)


@pytest.mark.parametrize("budget,expected", [("8GiB", 8 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1.5e9),
                                             (" 2 kib ", 2048), (4096, 4096), (1e9, 1e9)])
def test_memory_budget_forms(budget, expected):
    from autosplit.validate import memory_budget
    assert memory_budget(budget) == expected


def test_leaf_modules_by_name_and_by_path_trace_the_same_leaf():
    model = timm_cls(depth=2)
    by_name = autosplit.compile(model, mesh=(1, 1, 1), example_input=X, leaf_modules=["Attention"])
    by_path = autosplit.compile(model, mesh=(1, 1, 1), example_input=X, leaf_modules=["timm.models.vision_transformer.Attention"])
    for plan in (by_name, by_path):
        targets = {n.target for n in plan.graph.graph.nodes if n.op == "call_module"}
        assert {"blocks.0.attn", "blocks.1.attn"} <= targets


def test_leaf_name_shared_by_two_classes_is_ambiguous():
    class Attention(torch.nn.Module):        # same class name as timm's, another class
        def forward(self, x):
            return x

    model = timm_cls(depth=2)
    model.extra = Attention()
    with pytest.raises(AutosplitError, match=r"leaf_modules entry 'Attention' names 2 classes in the model"):
        autosplit.compile(model, mesh=(1, 1, 1), example_input=X, leaf_modules=["Attention"])


@pytest.mark.parametrize("pp_rank,tp_rank,match", [(2, 0, r"pp_rank=2 is outside 0\.\.1 \(pp=2\)"),
                                                   (-1, 0, r"pp_rank=-1 is outside 0\.\.1"),
                                                   (0, 1, r"tp_rank=1 is outside 0\.\.0 \(tp=1\)")])
def test_stage_modules_out_of_range(pp_rank, tp_rank, match):
    plan = _call()
    with pytest.raises(RankError, match=match) as info:
        plan.stage_modules(pp_rank, tp_rank)
    assert isinstance(info.value, AutosplitError) and isinstance(info.value, IndexError)


# ---- failures of our own code: a PlanError naming the node, never bad input, never a raw exception ----
def _corrupt_first(monkeypatch, target, args):
    """Make tracing return a graph whose first ``target`` method call gets impossible ``args``: a stand-in
    for a bug of ours that the model's own forward does not have."""
    import autosplit.passes.trace_model as tm
    real = tm.trace

    def broken(*a, **kwargs):
        gm = real(*a, **kwargs)
        node = next(n for n in gm.graph.nodes if n.target == target)
        node.args = (node.args[0], *args)
        gm.recompile()
        return gm
    monkeypatch.setattr(tm, "trace", broken)


def tiny_beit():
    """timm's beit: relative-position indices in non-persistent buffers (not in its state_dict)."""
    import timm
    return timm.create_model("beit_base_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                             depth=2, num_heads=2, num_classes=8)


@pytest.mark.parametrize("factory,target,args,where", [
    (lambda: timm_cls(depth=2), "reshape", (7, -1, 5), r"blocks\.0\.attn"),
    (tiny_beit, "transpose", (1, 7), r"patch_embed")], ids=["vit", "beit"])
def test_shape_failure_of_our_graph_is_a_plan_error_not_bad_input(monkeypatch, factory, target, args, where):
    """The model's own forward runs on the example (every parameter and buffer on meta, non-persistent
    ones included): the failure is ours, not the input's."""
    _corrupt_first(monkeypatch, target, args)
    with pytest.raises(PlanError, match=rf"(?s)shape propagation failed at node '{target}'.*in module '{where}'"
                                        r".*the model's own forward runs on this example_input.*autosplit bug") as info:
        _call(model=factory())
    assert "example_input has shape" not in str(info.value)


def test_model_forward_that_reads_values_and_takes_concrete_args_is_not_blamed_on_the_input(monkeypatch):
    """A forward that reads a tensor's value (``.item()``, impossible on meta) and a parameter fixed by
    concrete_args still runs for the check (on zeros, with those args): our graph's failure stays ours."""
    class Gate(torch.nn.Module):                                        # a leaf: traced whole
        def forward(self, h):
            return h * 0 if h.abs().sum().item() > 1e30 else h           # a value read: not on meta

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.gate, self.b = torch.nn.Linear(12, 8), Gate(), torch.nn.Linear(8, 4)

        def forward(self, x, scale=None):                               # (B, 3, 4) -> (B, 4)
            return self.b(self.gate(self.a(x.reshape(x.shape[0], -1))) * scale)

    import autosplit.passes.trace_model as tm
    real = tm.trace

    def broken(*a, **kwargs):
        gm = real(*a, **kwargs)
        node = next(n for n in gm.graph.nodes if n.target == "reshape")
        node.args = (node.args[0], 7, 5)
        gm.recompile()
        return gm
    monkeypatch.setattr(tm, "trace", broken)
    with pytest.raises(PlanError, match=r"(?s)node 'reshape'.*the model's own forward runs on this example_input"):
        autosplit.compile(Net(), mesh=(1, 1, 1), example_input=torch.randn(2, 3, 4), concrete_args={"scale": 2.0},
                          leaf_modules=[Gate], device="cpu")


def test_shape_failure_the_model_shares_still_shows_the_example():
    with pytest.raises(AutosplitError, match=r"(?s)example_input has shape \(2, 3, 16\).*the model's own forward "
                                             r"fails on it too") as info:
        _call(example_input=torch.randn(2, 3, 16))
    assert not isinstance(info.value, PlanError)


def _raise(exc):
    def fail(*args, **kwargs):
        raise exc
    return fail


@pytest.mark.parametrize("target,tp_kw,match", [
    ("autosplit.passes.sharding.factors.Factors.reshape", dict(mesh=(1, 2, 1)),
     r"the sharding engine's op rules failed at node 'flatten' \(call_method flatten\) in module 'patch_embed': "
     r"ZeroDivisionError: injected"),
    ("autosplit.passes.sharding.strategies.Enumerator.transition", dict(mesh=(1, 2, 1)),
     r"the sharding engine's redistributions failed at node '\w+' .* in module '[\w.<>]+': ZeroDivisionError: injected"),
    ("autosplit.passes.sharding.lower.Lowering.as_linear_2d", dict(mesh=(1, 4, 1), tp_mode="2d"),
     r"the sharding engine's lowering failed at node '\w+' \(call_\w+ \w+\) in module '[\w.]+': ZeroDivisionError: injected"),
    ("autosplit.passes.sharding.lower.Lowering.transition", dict(mesh=(1, 2, 1), sequence_parallel=True),
     r"the sharding engine's lowering failed at node '\w+' .* in module '[\w.<>]+': ZeroDivisionError: injected"),
    ("autosplit.passes.cut_points.FindCuts.call", dict(mesh=(2, 1, 1)),
     r"planning pass FindCuts failed: ZeroDivisionError: injected; this is an autosplit bug"),
])
def test_an_exception_in_our_rules_is_a_plan_error_naming_the_node(monkeypatch, target, tp_kw, match):
    """Every exception that escapes compile from our own code is a bug: it leaves as a PlanError that
    names the node and module path (or the pass) and says so, with the original as its cause."""
    monkeypatch.setattr(target, _raise(ZeroDivisionError("injected")))
    with pytest.raises(PlanError, match=match) as info:
        autosplit.compile(timm_cls(depth=2), example_input=torch.randn(4, 3, 32, 32), device="cpu", **tp_kw)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
