"""Forward tensor-parallel all-reduces overlapped with row chunks' compute (passes/tp_overlap.py):
which nodes the pass chunks and which it leaves alone (decided from ops and shapes), and equality with
single-device training in real gloo worlds, with pipelines, zero-bubble, dp and checkpointing."""
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autosplit
from autosplit.passes.tp_overlap import find_runs
from autosplit.tp import ops
from tests.dist_checks import train_matches_single_device
from tests.models import VARIANTS

TOL = 1e-5
MODELS = ["tp_timm", "tp_torchvision", "tp_hand", "tp_swiglu"]


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _plan(model, chunks, mesh=(1, 2, 1), rows=4, **kw):
    return autosplit.compile(model, mesh=mesh, example_input=torch.randn(rows, 3, 32, 32), tp_overlap_chunks=chunks,
                             **kw)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.default_cases('tp_torchvision')
def test_every_block_all_reduce_is_started_and_waited_per_chunk(name):
    """Each forward all-reduce of a block becomes one start and one wait per chunk, and some chunk's
    wait comes after another chunk's compute (what it overlaps); the stage's interface is unchanged."""
    torch.manual_seed(0)
    model = VARIANTS[name]()
    plain = _plan(model, 1).stage_modules(0)[0]
    for chunks in (2, 3):
        gm = _plan(model, chunks).stage_modules(0)[0]
        before, after = _targets(plain), _targets(gm)
        reduces = before.count(ops.all_reduce)
        assert reduces >= 2, reduces
        assert after.count(ops.all_reduce_start) == chunks * reduces and after.count(ops.wait) == chunks * reduces
        assert ops.all_reduce not in after
        assert [n.name for n in gm.graph.find_nodes(op="placeholder")] == \
            [n.name for n in plain.graph.find_nodes(op="placeholder")]
        nodes = list(gm.graph.nodes)
        hidden = {}                              # all-reduce -> does some chunk's wait follow compute?
        for i, n in enumerate(nodes):
            if n.target is ops.wait:
                start = nodes.index(n.args[0])
                between = [m for m in nodes[start + 1:i] if m.op == "call_module" or m.target is F.linear]
                key = n.args[0].name.rsplit("_start_c", 1)[0]
                hidden[key] = hidden.get(key, False) or bool(between)
        assert len(hidden) == reduces and all(hidden.values()), hidden


def test_dumped_program_names_the_chunks(tmp_path):
    plan = _plan(VARIANTS["tp_timm"](), 2)
    plan.dump(tmp_path)
    code = (tmp_path / "pp0_tp1" / "stage0.py").read_text()
    assert "all_reduce_start_c0" in code and "tensor_split" in code and "torch.cat" in code


class _Net(nn.Module):
    """A block whose row-parallel output meets ``mix`` after the all-reduce."""

    def __init__(self, mix):
        super().__init__()
        self.fc1, self.fc2, self.mix = nn.Linear(16, 32), nn.Linear(32, 16), mix
        self.head, self.norm = nn.Linear(16, 4), nn.LayerNorm(16)

    def forward(self, x):                       # (B, 16)
        # column, then row parallel: an all-reduce after fc2 (the norm needs the 16 features whole,
        # so the engine keeps them replicated between the linears, as Megatron does)
        h = self.fc2(F.gelu(self.fc1(self.norm(x))))
        return self.head(self.mix(x + h))


def _runs(mix, rows=4):
    model = _Net(mix)
    plan = autosplit.compile(model, mesh=(1, 2, 1), example_input=torch.randn(rows, 16))
    gm = plan.stage_modules(0)[0]
    return [[n.name for n in r] for r in find_runs(gm, [], 2)], gm


def test_row_mixing_ops_end_the_run():
    """Ops that read other rows (a mean over the batch, a batch norm) or draw random numbers (dropout)
    are never chunked; the run stops before them.  Row-wise ones (an identity) stay inside."""
    runs, _ = _runs(nn.Identity())
    assert len(runs) == 1 and any("mix" in n for n in runs[0]) and any("head" in n for n in runs[0]), runs
    for mix in (lambda t: t - t.mean(0, keepdim=True), nn.BatchNorm1d(16), nn.Dropout(0.1)):
        runs, gm = _runs(mix)
        names = [n for r in runs for n in r]
        assert names and not any("mix" in n or "mean" in n or "sub" in n for n in names), runs
        assert runs[0][-1] == "add", runs         # the run with fc2's all-reduce ends before the mix


def test_too_few_rows_leaves_the_graph_alone():
    runs, _ = _runs(nn.Identity(), rows=1)
    assert runs == []


def test_broadcast_operands_are_used_whole():
    """An operand broadcast along dim 0 ((1, N, C) or fewer dims) is not split; one with the rows is."""
    from autosplit.passes.tp_overlap import activation_args
    graph = torch.fx.Graph()
    x, y, b = graph.placeholder("x"), graph.placeholder("y"), graph.placeholder("b")
    add = graph.call_function(operator.add, (x, y))
    add_b = graph.call_function(operator.add, (x, b))
    x.meta["val"] = add.meta["val"] = add_b.meta["val"] = torch.empty(4, 5, 8, device="meta")
    y.meta["val"] = torch.empty(4, 5, 8, device="meta")
    b.meta["val"] = torch.empty(1, 5, 8, device="meta")
    gm = torch.fx.GraphModule(nn.Module(), graph)
    assert activation_args(gm, add, 4) == [0, 1] and activation_args(gm, add_b, 4) == [0]
    b.meta["val"] = torch.empty(2, 5, 8, device="meta")          # neither the rows nor broadcast
    assert activation_args(gm, add_b, 4) is None


def test_option_is_checked():
    with pytest.raises(autosplit.AutosplitError, match="tp_overlap_chunks"):
        _plan(VARIANTS["tp_timm"](), 0)


# ---- equality with single-device training, real gloo processes -----------------------------------
def _assert_equal(results):
    for r in results:
        assert r["loss_diff"] <= TOL and r["param_diff"] <= TOL, r
    assert all(r["losses"] == results[0]["losses"] for r in results), "ranks disagree on the loss"


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.default_cases('tp_timm')
def test_tp2_overlapped_equals_single_device(pool2, name):
    _assert_equal(pool2.run(train_matches_single_device, name, (1, 2, 1), "1f1b", 1, microbatches=2,
                            tp_overlap_chunks=2))


def test_uneven_chunks_equal_single_device(pool2):
    """4 rows in 3 chunks (2, 1, 1)."""
    _assert_equal(pool2.run(train_matches_single_device, "tp_timm", (1, 2, 1), "1f1b", 1, microbatches=2,
                            tp_overlap_chunks=3))


@pytest.mark.parametrize("name, mesh, schedule, kw", [
    ("tp_timm", (2, 2, 1), "zb-h1", {}),
    ("tp_hand", (2, 2, 1), "1f1b", {"recompute": "block"}),
    ("tp_torchvision", (1, 2, 2), "1f1b", {}),
    ("tp_timm", (1, 2, 2), "1f1b", {"dp_shard": "layer"}),
    ("tp_swiglu", (1, 4, 1), "1f1b", {}),
])
@pytest.mark.default_cases('tp_timm-mesh0-zb-h1-kw0')
def test_four_ranks_overlapped_equals_single_device(pool4, name, mesh, schedule, kw):
    _assert_equal(pool4.run(train_matches_single_device, name, mesh, schedule, 1, microbatches=2,
                            tp_overlap_chunks=2, **kw))
