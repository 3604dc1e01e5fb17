"""The kernel model (cost_model/kernels.py): GEMM shapes from graphs, efficiency by shape, and the
built-in GPU profiles against published timings (a few rows of timm's tables, copied with their source).

The full comparison is benchmarks/bench_gpu_tables.py (every ViT row of the tables); these rows keep the
built-in profiles from drifting away from it."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import autosplit
from autosplit.cost_model import get_profile
from autosplit.cost_model.flops import NodeCost
from autosplit.cost_model.kernels import gemm_efficiency, gemm_shape, kernel_parts, optimizer_step_time
from autosplit.passes.shape_prop import ExampleShapeProp


class Ops(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 48)
        self.conv = nn.Conv2d(3, 16, 4, stride=4)

    def forward(self, x, img, q, k, v):
        h = self.fc(x)                                         # (2, 10, 48)
        s = torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2))   # (8, 10, 12)
        a = F.scaled_dot_product_attention(q, k, v)            # (2, 4, 10, 16)
        return h, s, a, self.conv(img)


def test_gemm_shapes_read_from_the_graph():
    gm = fx.symbolic_trace(Ops())
    inputs = [torch.randn(2, 10, 32), torch.randn(2, 3, 16, 16), torch.randn(2, 4, 10, 16),
              torch.randn(2, 4, 12, 16), torch.randn(2, 4, 12, 16)]
    ExampleShapeProp(inputs)(gm)
    shapes = {n.name: gemm_shape(n) for n in gm.graph.nodes}
    assert shapes["fc"] == (1, 20, 48, 32)                     # (batch, m = tokens, n = out, k = in)
    assert shapes["bmm"] == (8, 10, 12, 16)
    assert shapes["scaled_dot_product_attention"] == (8, 10, 12, 16)
    assert shapes["conv"] == (1, 2 * 4 * 4, 16, 3 * 4 * 4)     # implicit GEMM: positions x Cout x Cin*k*k
    assert shapes["flatten"] is None and shapes["transpose"] is None


def test_small_and_skinny_gemms_run_below_the_large_gemm_rate():
    h100 = get_profile("h100")
    big = gemm_efficiency(h100, (1, 8192, 8192, 8192))
    assert 0.8 * h100.gemm_efficiency < big < h100.gemm_efficiency
    assert gemm_efficiency(h100, (1, 8192, 8192, 64)) < 0.8 * big       # a skinny k
    assert gemm_efficiency(h100, (1, 32, 32, 32)) < 0.5 * big
    plain = dataclasses.replace(h100, gemm_efficiency=1.0, gemm_half_dim=0.0)
    assert gemm_efficiency(plain, (1, 16, 16, 16)) == 1.0              # the plain roofline


def test_kernel_parts_compute_memory_and_launches():
    p = dataclasses.replace(get_profile("h100"), gemm_efficiency=0.5, gemm_half_dim=0.0, attention_efficiency=0.5,
                            bandwidth_efficiency=0.5, op_overhead=1e-5)
    gemm = NodeCost(fwd_flops=int(1e12), bwd_flops=int(2e12), fwd_bytes=1000, bwd_bytes=2000)
    (fa, fw), (ba, bw) = kernel_parts(gemm, torch.bfloat16, p, "matmul", (1, 4096, 4096, 4096))
    assert fw == pytest.approx(1e12 / (989e12 * 0.5)) and bw == pytest.approx(2 * fw)
    assert (fa, ba) == (1e-5, 2e-5)                                    # dX and dW: two launches
    (_, aw), _ = kernel_parts(gemm, torch.bfloat16, p, "attention", (1, 4096, 4096, 4096))
    assert aw == pytest.approx(2 * fw)
    copy = NodeCost(fwd_bytes=int(1e9), bwd_bytes=int(1e9))
    (_, cw), (cb, _) = kernel_parts(copy, torch.float32, p, "pointwise")
    assert cw == pytest.approx(1e9 / (3.35e12 * 0.5)) and cb == 1e-5
    assert optimizer_step_time(1e9, 10, p) == pytest.approx(5e9 / (3.35e12 * 0.5) + 10 * 1e-5)


# Published rows (huggingface/pytorch-image-models results/, see ../shared/reference/gpu-tables/README.md):
#   benchmark-train-amp-nchw-pt112-cu113-rtx3090.csv  vit_base_patch16_224: batch 192, 490.391 ms per step
#   benchmark-infer-amp-nchw-pt291-cu128-4090.csv      vit_base_patch16_224: batch 1024, 342.132 ms per forward
#   benchmark-infer-amp-nchw-pt291-cu128-4090.csv      vit_small_patch16_224: batch 1024, 124.63 ms per forward
@pytest.mark.parametrize("device,model,batch,train,published_ms", [
    ("rtx3090", "vit_base_patch16_224", 192, True, 490.391),
    ("rtx4090", "vit_base_patch16_224", 1024, False, 342.132),
    ("rtx4090", "vit_small_patch16_224", 1024, False, 124.63)])
@pytest.mark.default_cases('rtx4090-vit_small_patch16_224-1024-False-124.63')
def test_builtin_profiles_predict_published_timm_rows(device, model, batch, train, published_ms):
    timm = pytest.importorskip("timm")
    timm.layers.set_fused_attn(not train)        # the PyTorch 1.12 row ran timm's unfused attention
    try:
        with torch.device("meta"):
            m = timm.create_model(model, pretrained=False)
        x = torch.empty(batch, 3, 224, 224, device="meta")
        plan = autosplit.compile(m, mesh=(1, 1, 1), example_input=x, device=device, autocast=torch.float16,
                                 num_microbatches=1)
    finally:
        timm.layers.set_fused_attn(True)
    stage, profile = plan.stages[0], get_profile(device)
    seconds = stage.fwd_time
    if train:                                    # + backward + timm's SGD step (momentum, Nesterov; 12 passes)
        params = list(m.parameters())
        seconds += stage.bwd_time + optimizer_step_time(sum(p.numel() * 4 for p in params), len(params), profile,
                                                        traffic=12, launches=5)
    assert seconds * 1e3 == pytest.approx(published_ms, rel=0.15)
