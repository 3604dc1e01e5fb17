"""Offline tensor-parallel planning: layouts found from the graph, shards, errors and notes."""
import re

import pytest
import torch
from torch import nn

import autosplit
from tests.models import VARIANTS


def _plan(name, mesh=(1, 2, 1), **kw):
    torch.manual_seed(0)
    return autosplit.compile(VARIANTS[name](), mesh=mesh, example_input=torch.randn(2, 3, 32, 32), **kw)


def test_fused_qkv_is_split_by_heads_not_thirds():
    plan = _plan("tp_timm")                     # width 32, 4 heads of 8: qkv rows are (3, 4, 8)
    rows = [s[0] for s in plan.tp_plan.sharded["blocks.0.attn.qkv.weight"].slices]
    expected0 = torch.cat([torch.arange(0, 16), torch.arange(32, 48), torch.arange(64, 80)])
    assert torch.equal(rows[0], expected0)
    assert torch.equal(rows[1], expected0 + 16)
    cols = plan.tp_plan.sharded["blocks.0.attn.proj.weight"]
    assert cols.dims == [1] and torch.equal(cols.slices[0][1], torch.arange(16))
    assert cols.boxes(1) == [((0, 16), (32, 16), (0, 0))]                  # one contiguous block
    assert [b[0] for b in plan.tp_plan.sharded["blocks.0.attn.qkv.weight"].boxes(1)] == \
        [(16, 0), (48, 0), (80, 0)]                                         # q, k, v heads of rank 1


def test_local_shapes_and_shape_constants():
    plan = _plan("tp_timm")
    module = plan.stage_modules(0, 1)[0]
    params = dict(module.named_parameters())
    assert params["blocks.0.attn.qkv.weight"].shape == (48, 32)     # 3 * 2 local heads * 8
    assert params["blocks.0.mlp.fc2.weight"].shape == (32, 32)      # 64 hidden / 2
    assert params["head.weight"].shape == (5, 32)                   # the head is column-parallel too
    code = module.code
    assert re.search(r"reshape\(\w+, \w+, 3, 2, 8\)", code)          # 4 heads -> 2 local heads
    assert "copy_to_axis" in code and "all_reduce" in code and "'tp'" in code


def test_multihead_attention_sharded_by_heads():
    """torchvision's nn.MultiheadAttention reaches the engine as its ops (passes/decompose_attention.py):
    its fused in-projection split by heads, its out-projection by input features."""
    plan = _plan("tp_torchvision")
    lines = [r for r in plan.tp_plan.regions if r.startswith("encoder.layers.encoder_layer_0.self_attention")]
    assert lines[0].endswith("column, output 96 features by a factor of 4 (48 per rank)"), lines
    assert "split on dim 1 (4 -> 2 per rank)" in lines[1] and "row, input 32 features" in lines[2], lines
    local = dict(plan.stage_modules(0, 1)[0].named_parameters())
    assert local["encoder.layers.encoder_layer_0.self_attention.in_proj_weight"].shape == (48, 32)
    assert local["encoder.layers.encoder_layer_0.self_attention.out_proj.weight"].shape == (32, 16)


def test_heads_that_do_not_divide_stay_whole_and_say_why():
    plan = _plan("timm_avgpool")                # 3 heads of 16 on 2 ranks; the MLP still splits
    lines = dict(line.split(": ", 1) for line in plan.tp_plan.regions)
    assert lines["blocks.0.attn.qkv"].startswith("whole: ") and "3 does not divide by 2" in lines["blocks.0.attn.qkv"]
    assert "16 is needed whole by 'scaled_dot_product_attention'" in lines["blocks.0.attn.proj"]
    assert lines["blocks.0.mlp.fc1"].startswith("column")
    assert "blocks.0-2:" in plan.summary() and "3 does not divide by 2" in plan.summary()


@torch.fx.wrap
def _odd_mix(x):
    return x.roll(1, -1)                      # an op the engine has no rule for


def test_op_without_rule_runs_on_gathered_features_and_is_reported():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            return self.fc2(_odd_mix(self.fc1(x)))   # mixes the features: whole for it

    plan = autosplit.compile(Odd(), mesh=(1, 2, 1), example_input=torch.randn(2, 8))
    assert plan.tp_plan.regions[0].startswith("fc1: column") and plan.tp_plan.regions[1].startswith("fc2: row")
    assert any("_odd_mix" in n and "no sharding rule" in n and "fc1 gathered whole" in n for n in plan.tp_plan.notes)
    assert "note: '_odd_mix'" in plan.summary()
    code = plan.stage_modules(0, 1)[0].code
    assert code.index("gather(fc1") < code.index("_odd_mix(")


def test_sequence_parallel_shards_tokens_between_regions():
    plan = _plan("tp_hand", sequence_parallel=True)
    code = plan.modules[0].code
    assert code.count("reduce_scatter(") == 4 and code.count("all_gather(") == 4
    assert "local_slice(" in code and "gather(norm" in code


def test_dump_has_per_rank_code(tmp_path):
    plan = _plan("tp_timm", mesh=(2, 2, 1))
    plan.dump(tmp_path)
    for r in range(2):
        for t in range(2):
            assert (tmp_path / f"pp{r}_tp{t}").is_dir()
    assert "'tp'" in (tmp_path / "pp0_tp1" / "stage0.py").read_text()


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("name", ["tp_timm", "tp_torchvision", "tp_hand"])
@pytest.mark.default_cases('tp_hand-False')
def test_no_parameter_in_two_stages(name, sp):
    """A row-parallel layer's bias is read after its all-reduce: no cut may fall between the two."""
    for pp in (2, 3, 4, 5):
        for device in ("h100", "a100"):
            plan = _plan(name, mesh=(pp, 2, 1), sequence_parallel=sp, device=device)
            for t in range(2):
                names = [set(dict(m.named_parameters())) for r in range(pp) for m in plan.stage_modules(r, t)]
                assert sum(map(len, names)) == len(set().union(*names)), (pp, device, t)
