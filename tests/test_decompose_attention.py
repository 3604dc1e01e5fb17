"""nn.MultiheadAttention as graph ops (passes/decompose_attention.py): the same values and gradients as
the module, the dropout following the mode, the calls it keeps whole named, and a tp plan that splits
torchvision's ViT by heads with no module of its own."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

from autosplit.passes.decompose_attention import decompose_attention
from autosplit.passes.shape_prop import ExampleShapeProp
from autosplit.trace import trace


class _Attn(nn.Module):
    def __init__(self, batch_first: bool, dropout: float = 0.0, call=None):
        super().__init__()
        self.a = nn.MultiheadAttention(32, 4, batch_first=batch_first, dropout=dropout)
        self.batch_first = batch_first
        self.call = call or (lambda a, x: a(x, x, x, need_weights=False)[0])

    def forward(self, x):                                    # (B, N, 32)
        x = x if self.batch_first else x.transpose(0, 1)
        y = self.call(self.a, x)
        return y if self.batch_first else y.transpose(0, 1)


def _decomposed(model, x) -> tuple[fx.GraphModule, list[str]]:
    gm = trace(model)
    ExampleShapeProp((x,))(gm)
    return gm, decompose_attention(gm)


@pytest.mark.parametrize("batch_first", [True, False])
def test_same_values_and_gradients_as_the_module(batch_first):
    torch.manual_seed(0)
    model, x = _Attn(batch_first), torch.randn(3, 5, 32)
    gm, kept = _decomposed(model, x)
    assert kept == [] and not any(n.op == "call_module" for n in gm.graph.nodes)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = model(x1), gm(x2)
    (y1 * torch.arange(32.0)).sum().backward()
    (y2 * torch.arange(32.0)).sum().backward()
    torch.testing.assert_close(y2, y1, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(x2.grad, x1.grad, atol=1e-5, rtol=1e-5)
    for (name, p1), (_, p2) in zip(model.named_parameters(), gm.named_parameters()):
        torch.testing.assert_close(p2.grad, p1.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_dropout_follows_train_and_eval():
    model, x = _Attn(True, dropout=0.5), torch.randn(2, 6, 32)
    gm, _ = _decomposed(model, x)
    torch.manual_seed(1)
    trained = gm(x)
    gm.eval()
    torch.testing.assert_close(gm(x), model.eval()(x), atol=1e-6, rtol=1e-6)
    assert not torch.allclose(trained, gm(x))                  # it dropped in train mode


@pytest.mark.parametrize("call,why", [
    (lambda a, x: a(x, x, x, attn_mask=x.new_zeros(x.shape[1], x.shape[1]), need_weights=False)[0], "a mask"),
    (lambda a, x: a(x, x.flip(1), x, need_weights=False)[0], "different tensors"),
    (lambda a, x: a(x, x, x)[0] + a(x, x, x)[1].sum(), "weights (output 1) are read"),
])
def test_other_calls_are_kept_whole_and_named(call, why):
    gm, kept = _decomposed(_Attn(True, call=call), torch.randn(2, 6, 32))
    assert len(kept) >= 1 and all(why in line and line.startswith("a: nn.MultiheadAttention kept whole")
                                  for line in kept)


def test_torchvision_vit_is_split_by_heads_without_a_module_of_its_own():
    import autosplit
    from tests.models import tp_torchvision
    plan = autosplit.compile(tp_torchvision(), mesh=(1, 2, 1), example_input=torch.randn(4, 3, 32, 32))
    sdpa = [line for line in plan.tp_plan.regions if "[scaled_dot_product_attention" in line and "]: split on dim 1" in line]
    assert len(sdpa) == 2, plan.tp_plan.regions
    modules = {type(m).__name__ for gm in plan.stage_modules(0, 0) for m in gm.modules()}
    assert not {"MultiheadAttention", "LocalMultiheadAttention"} & modules, modules
