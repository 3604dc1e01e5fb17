"""Tracing with concrete shapes (autosplit/trace_concrete.py): a module whose forward branches on a shape
is traced through, not refused or kept whole, and its Linears are split under tensor parallelism; each
decision is a shape guard that refuses other shapes clearly; a branch on tensor values is still refused.

Terms: ShapeNet and the reference: tests/checks_concrete_trace.py.  TOL: fp32 tolerance on the losses
and on every entry of the state dict after 3 SGD steps.
"""
import pytest
import timm
import torch
from torch import nn

import autosplit
from autosplit.errors import TraceError
from autosplit.trace import trace
from autosplit.trace_concrete import ShapeGuardError
from autosplit.trace_notes import leaf_lines
from tests import checks_concrete_trace as C

TOL = 1e-5
LINEARS = [f"blocks.{b}.{name}" for b in range(2) for name in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]


def _x(rows: int = 4, width: int = C.IMAGE) -> torch.Tensor:
    return torch.randn(rows, 3, C.IMAGE, width, generator=torch.Generator().manual_seed(2))


def test_shape_branches_are_traced_and_their_linears_split_at_tp2():
    """The resolution assert, the window padding and the cached position table are decided from the
    example's shapes: every Linear of every block is a node of the graph and split over tp = 2 (torch.fx
    alone refused the model: 'symbolically traced variables cannot be used as inputs to control flow')."""
    plan = autosplit.compile(C.build(), mesh=(1, 2, 1), example_input=_x(), device="h100")
    for path in LINEARS:
        assert f"{path}.weight" in plan.tp_plan.sharded, path
    text = plan.summary()
    assert "shape guards: 5 decisions" in text, text
    for line in ("assert x.shape[2] == self.img_size[0]", "if W % ws or H % ws:",
                 "side = int(N ** 0.5)"):
        assert line in text, line
    assert "kept whole" not in text and "ops without a cost rule" not in text


def test_guard_refuses_other_shapes_and_lets_other_rows_run():
    """The plan's graph holds the branch taken for 12 x 12 images: other rows run (no decision read
    them) and match the model; a width whose window padding differs, or another height (the model's
    assert), is refused with the decision's source line and both values."""
    model = C.build()
    plan = autosplit.compile(model, mesh=(1, 1, 1), example_input=_x(), num_microbatches=1)
    stage = plan.modules[0]
    three = _x(rows=3)
    torch.testing.assert_close(stage(three)[0], model(three))
    with pytest.raises(ShapeGuardError, match=r"(?s)checks_concrete_trace\.py:\d+ \(`if W % ws or H % ws:`\).*"
                                              r"bool\(\.\.\.\) = True.*gives False.*Plan again"):
        stage(_x(width=16))          # 8 tokens wide: a multiple of the window, no padding
    taller = torch.randn(2, 3, 16, C.IMAGE)
    with pytest.raises(ShapeGuardError, match=r"assert x\.shape\[2\] == self\.img_size\[0\].*gives False"):
        stage(taller)


def test_trains_like_one_device_at_1_2_1(pool2):
    for res in pool2.run(C.train_shape_net, (1, 2, 1)):
        assert res["keys_equal"]
        assert res["loss_diff"] < TOL and res["param_diff"] < TOL, res
        assert set(f"{p}.weight" for p in LINEARS) <= set(res["sharded"]), res["sharded"]


class _Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:                 # a tensor's values: unknown when planning
            return x * 2
        return x


class _OnDevice(nn.Module):
    def forward(self, x):
        if x.device.type == "cuda":     # the device: another run may differ
            return x * 2
        return x


@pytest.mark.parametrize("gate, line, why", [
    (_Gate, r"if x\.sum\(\) > 0:", "it is a tensor's values"),
    (_OnDevice, r"if x\.device\.type == \"cuda\":", "read from a tensor's device, dtype or requires_grad")])
def test_value_and_device_branches_are_still_refused(gate, line, why):
    model = nn.Sequential(nn.Linear(4, 4), gate())
    with pytest.raises(TraceError, match=rf"(?s)module '1'.*{why}.*test_concrete_trace\.py:\d+: {line}.*leaf_modules"):
        autosplit.compile(model, mesh=(1, 1, 1), example_input=torch.randn(2, 4))


def test_timm_no_trace_module_is_traced_and_split():
    """timm registers twins' LocallyGroupedAttn (it pads to a window multiple) as not traceable by fx; it
    was kept whole, its Linears replicated.  Now each block's q/kv/proj are split at tp = 2."""
    model = timm.create_model("twins_svt_small", pretrained=False, img_size=32, embed_dims=(32, 64),
                              num_heads=(2, 2), depths=(1, 1), sr_ratios=(2, 1), mlp_ratios=(2, 2), wss=(3, 3),
                              num_classes=10)
    plan = autosplit.compile(model, mesh=(1, 2, 1), example_input=torch.randn(2, 3, 32, 32))
    assert "blocks.0.0.attn.qkv.weight" in plan.tp_plan.sharded
    assert "blocks.0.0.attn.proj.weight" in plan.tp_plan.sharded
    assert "kept whole" not in plan.summary()


def test_leaves_that_remain_are_named_with_why():
    """A registered module whose trace still fails (efficientvit's LiteMLA branches on its device) and a
    user's leaf stay whole, each named with its reason."""
    model = timm.create_model("efficientvit_b0", pretrained=False, num_classes=10, depths=(1, 1, 1, 1, 1))
    gm = trace(model, 1, example_inputs=(torch.empty(1, 3, 64, 64, device="meta"),))
    assert leaf_lines(gm) == [
        "kept whole (a leaf, replicated under tp): LiteMLA at stages.2.blocks.1.context_module.main, "
        "stages.3.blocks.1.context_module.main: timm registers LiteMLA as not traceable by torch.fx, and tracing "
        "it with concrete shapes failed: TraceError: symbolically traced variables cannot be used as inputs to "
        "control flow (it is read from a tensor's device, dtype or requires_grad, which a run may change)"]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.fc = _Gate(), nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))

        def forward(self, x):
            return self.gate(self.fc(x))
    plan = autosplit.compile(Net(), mesh=(1, 1, 1), example_input=torch.randn(2, 4), leaf_modules=[_Gate])
    assert "kept whole (a leaf, replicated under tp): _Gate at gate: listed in leaf_modules" in plan.summary()
