"""Ops written the way real code writes them (tests/models_edge.py): implicit, negative and keyword dims,
shape reads of split tensors, in-place writes, slices whose bounds are traced.  Each plans under every
tensor-parallel mode and trains equal to single-device training in real gloo worlds (1D at (1, 2, 1),
2D at (1, 4, 1)); timm's pit and samvit, once refused by a tracing bug, train at (2, 1, 1) and (1, 2, 1).
A failure of our own rules reaches the user as a PlanError naming the node and module path."""
from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
import torch.nn.functional as F

import autosplit
from autosplit.errors import PlanError
from autosplit.trace import trace
from tests.dist_checks import train_matches_single_device
from tests.models import VARIANTS
from tests.models_edge import EDGE_VARIANTS, EdgeViT, tiny_pit, tiny_samvit

TOL = 1e-5
EDGE = [f"edge_{v}" for v in EDGE_VARIANTS]
MIXED = ["edge_mixed_a", "edge_mixed_b"]          # every variant, in two models (for the trained tests)
X = torch.randn(2, 3, 32, 32)


def train_many(names, mesh, **kw) -> dict:
    """``train_matches_single_device`` for each model (one pool task: the workers import this module,
    which registers the edge models in VARIANTS)."""
    warnings.filterwarnings("ignore", message="Implicit dimension choice")
    return {name: train_matches_single_device(name, mesh, "1f1b", 1, steps=2, **kw) for name in names}


def _assert_equal(results):
    for per_rank in results:
        for name, r in per_rank.items():
            assert r["loss_diff"] <= TOL and r["param_diff"] <= TOL, (name, r)


# ---- tracing --------------------------------------------------------------------------------------
def test_traced_slice_bounds_are_graph_values_and_mode_constants_inside_slices_follow_the_mode():
    """``x[:, :n]`` with a traced n pairs the two modes' graphs through the slice (no mode constant holding
    a node); a bound that differs between modes becomes a ModeSwitch inside the slice."""
    torch.manual_seed(0)
    model = EdgeViT("slice_traced")
    gm = trace(model)
    for training in (True, False):
        model.train(training)
        gm.train(training)
        assert torch.equal(gm(X), model(X)), f"training={training}"


def test_inplace_writes_whose_result_is_unused_are_kept():
    """``h.add_(g)`` whose result nothing reads still writes h: dead-code elimination must keep it."""
    torch.manual_seed(0)
    for name in ("inplace", "inplace_alias"):
        model = EdgeViT(name)
        assert torch.equal(trace(model)(X), model(X)), name


def test_inplace_is_named_alike_in_method_and_function_form():
    """``x.relu_()``, ``torch.relu_(x)`` and ``x += y`` write their operand; ``a & b`` (operator.and_) does not."""
    import operator
    from autosplit.passes.op_names import inplace_base, op_name, writes_input
    g = torch.fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    cases = [(g.call_method("relu_", (x,)), "relu_", "relu"), (g.call_function(torch.relu_, (x,)), "relu_", "relu"),
             (g.call_function(F.relu_, (x,)), "relu_", "relu"), (g.call_function(operator.iadd, (x, y)), "iadd", "add"),
             (g.call_function(F.relu, (x,), {"inplace": True}), "relu", "relu"),
             (g.call_function(operator.and_, (x, y)), "and", None), (g.call_function(operator.__add__, (x, y)), "add", None)]
    for node, name, base in cases:
        assert (op_name(node, None), inplace_base(node), writes_input(node)) == (name, base, base is not None), node


@pytest.mark.parametrize("read,match", [
    ("whole", r"'new_ones' \(new_ones\) uses its whole shape \(read by '\w+'\)"),
    ("slice", r"'getitem_1' reads a slice of its shape that includes dim 2")])
def test_shape_reads_that_1d_cannot_make_global_are_named(read, match):
    """The whole shape handed on, or a slice of it over the split dim, would carry local sizes: the
    tensor read is never split there (the linears split around it), and explain() names the read."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(12, 16), torch.nn.Linear(16, 4)

        def forward(self, x):                                               # (B, 3, 4) -> (B, 3, 4)
            h = F.gelu(self.fc1(x.reshape(x.shape[0], 1, 12).expand(-1, 3, -1)))   # (B, 3, 16)
            if read == "whole":
                h = h + h.new_ones(h.shape)
            else:
                h = h * (h.shape[1:][1] / 16)
            return self.fc2(h)

    plan = autosplit.compile(Net(), mesh=(1, 2, 1), example_input=torch.randn(2, 3, 4), device="cpu")
    gelu = next(n for n in plan.graph.graph.nodes if n.name == "gelu")
    assert not isinstance(gelu.meta["spec"]["tp"], Shard), gelu.meta["spec"]
    assert re.search(match, plan.explain("gelu")), plan.explain("gelu")


def test_implicit_softmax_dim_is_torchs():
    from autosplit.passes import op_dims
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for ndim in range(6):
            assert op_dims.implicit_softmax_dim(ndim) == F._get_softmax_dim("softmax", ndim, 3)


# ---- planning ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mesh,kw", [((1, 2, 1), {}), ((1, 2, 1), {"sequence_parallel": True}),
                                     ((1, 4, 1), {"tp_mode": "2d"})], ids=["1d", "1d-sp", "2d"])
@pytest.mark.filterwarnings("ignore:Implicit dimension choice")
@pytest.mark.default_cases('1d')
def test_edge_models_plan_under_every_tp_mode(mesh, kw):
    """Keyword, negative and implicit dims, shape reads and in-place ops: each model plans, with both
    Megatron regions of every block split."""
    for name in EDGE + MIXED:
        torch.manual_seed(0)
        model = VARIANTS[name]()
        plan = autosplit.compile(model, mesh=mesh, example_input=X, device="cpu", **kw)
        lines = plan.tp_plan.regions
        if kw.get("tp_mode") == "2d":     # every linear of every block split over the grid
            linears = [line for line in lines if line.startswith("blocks.") and ": whole" not in line
                       and (".fc" in line or ".qkv" in line or ".proj" in line or ".gate" in line)]
            assert len(linears) >= 4 * len(model.blocks), (name, lines)
        else:                             # Megatron: the attention's and the MLP's row-parallel exits
            assert sum(": row," in line for line in lines) == 2 * len(model.blocks), (name, lines)


def test_implicit_softmax_over_a_split_dim_is_never_computed_on_blocks():
    """F.softmax(x) of a 4-D tensor normalizes dim 1, not -1: where dim 1 is the channel dim 2D splits,
    the softmax must see every channel (a softmax over q blocks would be wrong)."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.head = torch.nn.Conv2d(3, 8, 8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.head(F.softmax(self.conv(x)).mean(dim=(2, 3)))  # (B, 8, 4, 4): softmax over channels

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autosplit.compile(Net(), mesh=(1, 4, 1), example_input=X, tp_mode="2d", device="cpu")
    softmax = next(n for n in plan.graph.graph.nodes if n.name == "softmax")
    assert softmax.meta["spec"]["tp_col"] == Replicate(), softmax.meta["spec"]
    assert softmax.args[0].meta["spec"]["tp_col"] == Replicate()        # its input gathered, or never split


def test_inplace_write_is_never_made_on_a_copy_of_its_target():
    """``t.add_(x)`` with t whole and x split: cutting t into a copy would land the write in the copy,
    which later readers of t do not see; the engine keeps the written operand as it is (x is brought
    to t's placement instead), so the write reaches ``t.mean``."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Conv2d(3, 8, 8, 8), torch.nn.Linear(8, 8)
            self.base = torch.nn.Parameter(torch.zeros(1, 16, 8))

        def forward(self, x):
            x = self.embed(x).flatten(2).transpose(1, 2)                    # (B, 16, 8): split over the grid
            t = self.base.expand(x.shape[0], -1, -1).clone()                # whole
            t.add_(x)
            return self.head(t.mean(dim=1))

    plan = autosplit.compile(Net(), mesh=(1, 4, 1), example_input=X, tp_mode="2d", device="cpu")
    add_ = next(n for n in plan.graph.graph.nodes if n.name == "add_")
    assert add_.args[0].name == "clone" and add_.args[0].meta["spec"] == add_.meta["spec"]


@pytest.mark.parametrize("mesh", [(2, 1, 1), (1, 2, 1)])
@pytest.mark.parametrize("factory", [tiny_pit, tiny_samvit], ids=["pit", "samvit"])
@pytest.mark.default_cases('pit-mesh0', 'samvit-mesh1')
def test_timm_pit_and_samvit_plan(factory, mesh):
    torch.manual_seed(0)
    autosplit.compile(factory(), mesh=mesh, example_input=X, device="cpu")


# ---- training equal to one device ---------------------------------------------------------------
def test_edge_models_train_equal_under_1d(pool2):
    _assert_equal(pool2.run(train_many, MIXED, (1, 2, 1), timeout=600))


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["gather", "all_to_all"])
def test_edge_models_train_equal_under_cp(pool2, attention):
    """The tokens split over cp = 2: the hand-written scores and softmaxes get key copies, the einsum
    attention too (an einsum is one class per subscript: the keys' letter holds the queries' class, so
    the keys are copied), the padded tokens are gathered first; both attention lowerings.  (Mixed model
    b reads ``numel()`` of 15 tokens split with padding: refused by name, as 1D+SP refuses it.)"""
    names = ["edge_mixed_a", "edge_einsum_mlp"]
    _assert_equal(pool2.run(train_many, names, {"cp": 2}, cp_attention=attention, timeout=600))
    torch.manual_seed(0)
    plan = autosplit.compile(VARIANTS["edge_mixed_a"](), mesh={"cp": 2}, example_input=X, cp_attention=attention)
    einsums = [n for n in plan.graph.graph.nodes if n.target is torch.functional.einsum or n.target is torch.einsum]
    assert einsums and all(n.meta["spec"]["cp"] != Replicate() for n in einsums)      # split, not run whole


@pytest.mark.slow
def test_edge_models_train_equal_under_2d(pool4):
    _assert_equal(pool4.run(train_many, MIXED, (1, 4, 1), tp_mode="2d", timeout=600))


@pytest.mark.slow
def test_timm_pit_and_samvit_train_equal(pool2):
    for mesh in ((2, 1, 1), (1, 2, 1)):
        _assert_equal(pool2.run(train_many, ["edge_pit", "edge_samvit"], mesh, timeout=600))
