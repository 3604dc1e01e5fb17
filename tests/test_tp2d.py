"""2D tensor parallelism (tp_mode="2d", a q x q grid): equal to single-device training in real gloo worlds,
with pipeline and data parallelism, in both linear forms; plans that split every parameter q^2 ways;
clear errors for what 2D cannot split."""
import pytest
import torch

import autosplit
from autosplit.errors import AutosplitError
from autosplit.tp import ops as C
from tests.dist_checks import train_matches_single_device
from tests.models import VARIANTS

TOL = 1e-5


def _check(results):
    for r in results:
        assert r["loss_diff"] <= TOL and r["param_diff"] <= TOL, r


@pytest.mark.parametrize("name", ["tp_timm", "tp_timm_avgpool", "tp_torchvision", "tp_hand", "tp_swiglu"])
@pytest.mark.default_cases('tp_timm')
def test_2d_four_ranks(pool4, name):
    """(1, 4, 1): class-token and average-pool timm ViTs, torchvision's (nn.MultiheadAttention), a hand-written
    one with separate q/k/v linears, SwiGLU with qk-norm."""
    _check(pool4.run(train_matches_single_device, name, (1, 4, 1), "1f1b", 1, tp_mode="2d"))


@pytest.mark.slow
def test_2d_summa_form(pool4):
    """The broadcast (SUMMA) form of every linear gives the same training as single-device."""
    _check(pool4.run(train_matches_single_device, "tp_hand", (1, 4, 1), "1f1b", 1, tp_mode="2d",
                     tp_2d_form="summa"))


@pytest.mark.parametrize("name,mesh,schedule,chunks,m", [
    ("tp_timm", (2, 4, 1), "1f1b", 1, 4),
    ("tp_torchvision", (2, 4, 1), "interleaved", 2, 4),
    ("tp_timm_avgpool", (1, 4, 2), "1f1b", 1, 2),          # 4 rows per replica: 2 per microbatch
    ("tp_hand", (1, 4, 2), "1f1b", 1, 2),
    ("tp_timm", (2, 4, 1), "zb-h1", 1, 4),               # zero-bubble: 2D's linear_2d keeps its W in I
])
def test_2d_with_pipeline_and_data_parallel(pool8, name, mesh, schedule, chunks, m):
    _check(pool8.run(train_matches_single_device, name, mesh, schedule, chunks, microbatches=m, tp_mode="2d"))


def test_2d_with_sharded_data_parallel(pool8):
    """dp_shard (FSDP2 over dp) around 2D stage modules: each rank's blocks sharded once more over dp."""
    _check(pool8.run(train_matches_single_device, "tp_timm_avgpool", (1, 4, 2), "1f1b", 1, microbatches=2,
                     tp_mode="2d", dp_shard="stage"))


def _plan(name="tp_timm", mesh=(1, 4, 1), batch=4, **kw):
    torch.manual_seed(0)
    return autosplit.compile(VARIANTS[name](), mesh=mesh, example_input=torch.randn(batch, 3, 32, 32),
                             tp_mode="2d", device="cpu", **kw)


def test_every_parameter_split_q_squared_ways():
    """Each tp rank holds 1/q^2 of every parameter of this model (widths divide by q^2), and
    the fused qkv rows follow heads: rank (i, j) has column j's heads, row i's input features."""
    plan = _plan()
    model = VARIANTS["tp_timm"]()
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    for t in range(4):
        local = {n: p.numel() for m in plan.stage_modules(0, t) for n, p in m.named_parameters()}
        assert set(local) == set(sizes)
        for n, numel in local.items():
            # head.bias: 10 classes, 5 per grid column, which do not split over 2 rows: whole over tp_row
            assert numel * (2 if n == "head.bias" else 4) == sizes[n], (t, n, numel, sizes[n])
    qkv = plan.tp_plan.sharded["blocks.0.attn.qkv.weight"]     # (96, 32): rows (3, 4 heads, 8)
    rows_col1 = torch.cat([torch.arange(16, 32), torch.arange(48, 64), torch.arange(80, 96)])
    assert torch.equal(qkv.slices[1][0], rows_col1) and torch.equal(qkv.slices[1][1], torch.arange(16))
    assert torch.equal(qkv.slices[3][0], rows_col1) and torch.equal(qkv.slices[3][1], torch.arange(16, 32))


def test_dump_names_both_axes(tmp_path):
    plan = _plan()
    plan.dump(tmp_path)
    code = (tmp_path / "pp0_tp3" / "stage0.py").read_text()
    assert "'tp_row'" in code and "'tp_col'" in code and "linear_2d" in code and "layer_norm_2d" in code
    summary = plan.summary()
    assert "2d): tp_row 2 x tp_col 2" in summary and "allgather: 9" in summary


def test_summa_named_in_summary():
    assert "summa: 9" in _plan(tp_2d_form="summa").summary()


def _block_collectives(plan, block="blocks.0."):
    """(op name, axis) -> count, for one transformer block of tp rank 0's graph."""
    counts = {}
    for n in plan.stage_modules(0, 0)[0].graph.nodes:
        if getattr(n.target, "comm_kind", None) and str(n.meta.get("module_path", "")).startswith(block):
            axis = next((a for a in n.args if isinstance(a, str) and a.startswith("tp")), None)
            key = (n.target.__name__, axis)
            counts[key] = counts.get(key, 0) + 1
    return counts


def test_collectives_per_block():
    """Per block: 4 linears (qkv, proj, fc1, fc2), 2 layer norms (statistics summed over tp_col), and the
    4 norm parameters + 4 linear biases gathered over tp_row; nothing else."""
    counts = _block_collectives(_plan())
    assert counts == {("linear_2d", "tp_row"): 4, ("layer_norm_2d", "tp_col"): 2, ("all_gather", "tp_row"): 8}, counts


@pytest.mark.parametrize("tp,msg", [(2, "nearest squares: 1 = 1x1 and 4 = 2x2"), (8, "4 = 2x2 and 9 = 3x3")])
def test_tp_must_be_square(tp, msg):
    with pytest.raises(AutosplitError, match=msg.replace("(", r"\(")):
        _plan(mesh=(1, tp, 1))


def test_rows_must_divide_by_q():
    with pytest.raises(AutosplitError, match=r"3 rows, which do not divide by q\(2\)"):
        _plan(batch=3)


def test_heads_that_do_not_divide_by_q_stay_whole_on_tp_col():
    plan = _plan("timm_avgpool")                   # 3 heads on a 2x2 grid: the attention runs whole over tp_col
    lines = dict(line.split(": ", 1) for line in plan.tp_plan.regions)
    sdpa = next(v for k, v in lines.items() if k.startswith("blocks.0.attn [scaled_dot_product_attention"))
    assert sdpa.startswith("whole: "), sdpa
    assert lines["blocks.0.mlp.fc1"].startswith("column")


def test_sequence_parallel_is_1d_only():
    with pytest.raises(AutosplitError, match="sequence_parallel=True applies to tp_mode='1d'"):
        _plan(sequence_parallel=True)


@torch.fx.wrap
def _odd_mix(x):
    return x.roll(1, -1)                      # an op the engine has no rule for


def test_op_without_rule_runs_on_gathered_channels():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Conv2d(3, 16, 8, 8)
            self.head = torch.nn.Linear(16, 4)

        def forward(self, x):
            x = self.embed(x).flatten(2).transpose(1, 2)          # (B, N, C/q) split channels
            return self.head(_odd_mix(x).mean(1))                 # mixes the split channels

    plan = autosplit.compile(Odd(), mesh=(1, 4, 1), example_input=torch.randn(4, 3, 32, 32), tp_mode="2d",
                             device="cpu")
    assert any("'_odd_mix'" in note and "no sharding rule" in note and "gathered whole" in note
               for note in plan.tp_plan.notes), plan.tp_plan.notes
    code = plan.stage_modules(0, 3)[0].code
    assert code.index("gather(transpose, 0, 'tp_row'") < code.index("_odd_mix(")   # the rows gathered before it


def test_layer_norm_2d_matches_layer_norm_on_meta_shapes():
    x = torch.empty(2, 5, 8, device="meta")
    assert C.layer_norm_2d(x, 16, None, None, 1e-5, "tp_col").shape == x.shape
    assert C.linear_2d(x, torch.empty(6, 8, device="meta"), "tp_row", "tp_col", 2).shape == (2, 5, 6)


@pytest.mark.parametrize("mode,sp", [("1d", False), ("1d", True), ("2d", False)])
@pytest.mark.default_cases('2d-False')
def test_tensor_parallel_plans_under_autocast(mode, sp):
    """Planning tp > 1 under bf16 autocast (failed before: a collective's dtype was taken from a real meta
    tensor inside the fake-tensor pass); the pipeline boundary carries activations only, no gathered
    parameter (2D's parameter gathers go to the stage of their user)."""
    torch.manual_seed(0)
    plan = autosplit.compile(VARIANTS["tp_timm"](), mesh=(2, 4, 1), example_input=torch.randn(4, 3, 32, 32),
                             tp_mode=mode, sequence_parallel=sp, autocast=torch.bfloat16, device="h100")
    boundary = plan.stages[0].outputs
    assert boundary and all(len(t.shape) == 3 for t in boundary), boundary


def test_load_full_state_dict_round_trip(pool4):
    from tests import checks_tp2d
    for r in pool4.run(checks_tp2d.load_round_trip, "tp_timm"):
        assert r["state_diff"] == 0 and r["loss_diff"] <= TOL, r


def test_clip_grad_norm_counts_each_parameter_once(pool4):
    from tests import checks_tp2d
    for r in pool4.run(checks_tp2d.clip_norm_matches, "tp_timm"):
        assert r["norm_diff"] <= 1e-5 * max(1.0, r["norm"]), r
