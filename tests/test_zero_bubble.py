"""Zero-bubble pipelines (issue 11): I / W actions, the V placement, zb-h1 and zb-v under the simulator,
the split-backward pass, and equivalence with single-device training in real gloo processes.

Terms: pp ranks, m microbatches; F, I, W one time step each in the simulator ("unit" costs), so
1F1B's backward B = I + W would be two.  in flight: F ran, I not; pending W: I ran, W not.
"""
import copy
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autosplit
from autosplit.cost_model.step_time import deferred_w_stages
from autosplit.passes.split_backward import split_weight_gemms
from autosplit.schedule import (Action, ActionKind, Placement, build_schedule, check_schedule, flatten, lower,
                                parse_item, simulate)
from autosplit.tp.local_modules import RowParallelLinear
from autosplit.weight_grad import DEFERRED, SplitConv, SplitLinear, split_linear
from tests import checks_zero_bubble as Z
from tests.models import VARIANTS

TOL = 1e-5
I, W = ActionKind.I, ActionKind.W


# ---- simulator -------------------------------------------------------------------------------------
def test_zb_h1_idle_is_a_third_of_1f1b_and_memory_no_more():
    """Unit F = I = W: every rank idles (pp-1)(F + I - W) = pp-1 steps once m >= pp (1F1B with
    B = I + W idles (pp-1)(F + B) = 3(pp-1)); peak in flight never above 1F1B's, for pp <= 8, m <= 32."""
    for pp in range(1, 9):
        for m in range(1, 33):
            result = check_schedule("zb-h1", pp, m)           # raises ScheduleDeadlock if it cannot finish
            assert result.steps == 3 * m + result.idle[0]
            if m >= pp:
                assert result.idle == [pp - 1] * pp, (pp, m, result.idle)
            one_f_one_b = check_schedule("1f1b", pp, m).peak_activations
            assert all(a <= b for a, b in zip(result.peak_activations, one_f_one_b)), (pp, m)
            assert all(w <= r + 1 for r, w in enumerate(result.peak_pending_w)), (pp, m)   # W delay + 1


@pytest.mark.slow      # a further zero-bubble schedule (5 s); zb-h1 stays in the default tier
def test_zb_v_idle_is_only_the_unavoidable_start():
    """Unit chunk costs: rank pp-1 cannot start before pp-1 forwards went by, so no schedule idles less
    than pp-1 steps per rank; zb-v idles exactly that once m >= 2pp-1 (the paper's "zero bubble":
    rate (pp-1)/(6m+pp-1) -> 0).  Peak in flight 2*min(pp, m) chunk-microbatches: pp stage-microbatches
    of half a stage each, 1F1B's peak."""
    for pp in range(1, 9):
        for m in range(1, 33):
            result = check_schedule("zb-v", pp, m, 2)
            if m >= 2 * pp - 1:
                assert result.idle == [pp - 1] * pp, (pp, m, result.idle)
                assert Fraction(sum(result.idle), result.steps * pp) == Fraction(pp - 1, 6 * m + pp - 1)
            assert max(result.peak_activations) <= 2 * min(pp, m), (pp, m, result.peak_activations)


def test_every_action_once_and_w_after_its_i():
    for name, v in (("zb-h1", 1), ("zb-v", 2)):
        for pp, m in ((2, 3), (4, 8), (5, 7)):
            sched = build_schedule(name, pp, m, v)
            seen = [a for acts in sched.actions.values() for a in acts]
            assert sorted(map(str, seen)) == sorted(f"{s}{k}{i}" for s in range(pp * v) for k in "FIW"
                                                    for i in range(m))
            for acts in sched.actions.values():
                for k, a in enumerate(acts):
                    if a.kind is W:
                        assert Action(a.stage, I, a.microbatch) in acts[:k]


def test_deferring_stages_are_those_where_some_w_moves():
    """Only a stage with a W away from its I, or (on a GPU: ``early_send``) one that hands its input
    gradient on, gains from the split; the runtime keeps the others fused and the cost model prices
    their I as the whole backward.  The first stage never defers where every W follows its I."""
    from autosplit.schedule import deferring_stages
    cases = {("zb-h1", 2, 8): ({1}, {1}), ("zb-h1", 4, 8): ({1, 2, 3}, {1, 2, 3}), ("zb-h1", 2, 1): (set(), {1}),
             ("zb-v", 2, 8): ({1, 2}, {1, 2, 3}), ("zb-v", 2, 2): (set(), {1, 2, 3}),
             ("zb-v", 4, 8): ({1, 2, 3, 4, 5, 6}, set(range(1, 8)))}
    for (name, pp, m), (cpu, gpu) in cases.items():
        acts = build_schedule(name, pp, m, 2 if name == "zb-v" else 1).actions
        assert deferring_stages(acts) == cpu and deferring_stages(acts, early_send=True) == gpu, (name, pp, m)
        for lst in acts.values():         # every other stage: each I is directly followed by its own W
            for a, b in zip(lst, lst[1:]):
                if a.kind is I and a.stage not in cpu:
                    assert b == Action(a.stage, W, a.microbatch), (name, pp, m, a, b)
    assert deferring_stages({0: [Action(0, F, 0), Action(0, I, 0), Action(0, F, 1), Action(0, W, 0)]}) == {0}
    assert deferring_stages({0: [Action(0, F, 0), Action(0, I, 0)]}) == {0}      # a W that never comes
    # the cost model's rule: the profile's device decides the early hand-offs, tp > 1 splits everything
    assert deferred_w_stages("zb-v", 2, 8, 2, 1, "cpu") == {1, 2}
    assert deferred_w_stages("zb-v", 2, 8, 2, 1, "cuda") == {1, 2, 3}
    assert deferred_w_stages("zb-h1", 2, 8, 1, 2, "cpu") == {0, 1}
    assert deferred_w_stages("1f1b", 2, 8, 1, 2, "cpu") == set()


def test_w_before_i_and_mixed_kinds_are_refused():
    sched = build_schedule("zb-h1", 2, 2)
    acts = sched.actions[1]
    k = acts.index(Action.parse("1W0"))
    acts.insert(1, acts.pop(k))
    with pytest.raises(ValueError, match=r"rank 1 position 1 \(1W0\): W before the I of stage 1 microbatch 0"):
        lower(sched)
    sched = build_schedule("zb-h1", 2, 1)
    sched.actions[0] = [Action.parse(x) for x in ("0F0", "0B0")]
    with pytest.raises(ValueError, match="mixes B with I / W"):
        lower(sched)


def test_v_placement_and_its_local_handoff():
    place = Placement(4, 2, "v")
    assert [place.stages(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert all(place.stage(place.rank(s), place.chunk(s)) == s for s in range(8))
    lists = lower(build_schedule("zb-v", 4, 8, 2))
    comm = [a for items in lists.values() for a in flatten(items) if not a.is_compute]
    assert not [a for a in comm if {a.stage, a.peer_stage} == {3, 4}]        # stays on rank 3
    assert {str(a) for a in comm if a.stage == 7 and a.kind.is_recv} == {f"7RECV_F{i}" for i in range(8)}
    with pytest.raises(ValueError, match=r"7F0 is in rank 1.s list but stage 7 lives on rank 0 \(V placement"):
        simulate({0: [], 1: [Action.parse("7F0")]}, 8, Placement(2, 4, "v"))


@pytest.mark.parametrize("text", ["1I3", "0W2", "12I0"])
def test_i_w_text_form(text):
    assert str(parse_item(text)) == text and parse_item(text).kind in (I, W)


def test_grid_literal_zb_h1():
    assert check_schedule("zb-h1", 2, 2).format_grid().splitlines()[1:] == [
        "   0  0F0     .", "   1  0F1     1F0", "   2  .       1I0", "   3  0I0     1F1",
        "   4  0W0     1I1", "   5  0I1     1W0", "   6  0W1     1W1"]


def test_schedule_names_and_chunks_checked():
    with pytest.raises(ValueError, match=r"schedule='zb-v' runs two chunks per rank.*got chunks_per_rank=3"):
        build_schedule("zb-v", 2, 4, 3)
    with pytest.raises(autosplit.AutosplitError, match=r"schedule='zb-v' runs two chunks per rank"):
        autosplit.compile(VARIANTS["timm_cls"](), mesh=(2, 1, 1), example_input=torch.randn(2, 3, 32, 32),
                          schedule="zb-v", chunks_per_rank=1)


def test_plan_uses_the_v_placement():
    plan = autosplit.compile(VARIANTS["timm_cls"](), mesh=(2, 1, 1), example_input=torch.randn(2, 3, 32, 32),
                             schedule="zb-v", chunks_per_rank=2, num_microbatches=4)
    assert [(s.pp_rank, s.chunk) for s in plan.stages] == [(0, 0), (1, 0), (1, 1), (0, 1)]
    assert [m is plan.modules[s] for m, s in zip(plan.stage_modules(0), (0, 3))] == [True, True]
    assert "3I0" in plan.schedule_grid and "0W3" in plan.schedule_grid


# ---- the split-backward pass ------------------------------------------------------------------------
def _grads(module, x, key=None, autocast=None):
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        out = module(x)
    out = out[0] if isinstance(out, tuple) else out
    if key is None:
        out.float().square().sum().backward()
    else:
        before = {id(p): None if p.grad is None else p.grad.clone() for p in module.parameters()}
        with DEFERRED.collecting(key):
            out.float().square().sum().backward()
        for p in DEFERRED.weights(key):                                 # deferred, not yet written
            assert (p.grad is None) if before[id(p)] is None else torch.equal(p.grad, before[id(p)])
        DEFERRED.run(key)
    return {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("name,count", [("timm_cls", 18), ("torchvision", 10), ("hand", 26), ("shared_weight", 14)])
@pytest.mark.default_cases('torchvision-10')   # the leaf MultiheadAttention kept fused
def test_split_pass_defers_and_matches_fused(name, count):
    """Every weight GEMM found from the graph (Linear and Conv modules, F.linear on a parameter; not the
    leaf MultiheadAttention); over two microbatches the deferred gradients add up to the fused ones."""
    torch.manual_seed(0)
    model = VARIANTS[name]()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 4, 3, 32, 32)
    plan = autosplit.compile(model, example_input=x[0])
    split, names = split_weight_gemms(plan.stage_modules(0)[0])
    assert len(names) == count, names
    for k in range(2):
        got = _grads(split, x[k], key=(0, k))
        want = _grads(ref, x[k])
    assert max((got[n] - want[n]).abs().max().item() for n in want) <= 1e-6
    assert dict(split.named_parameters()).keys() == dict(plan.stage_modules(0)[0].named_parameters()).keys()


def test_split_pass_under_autocast_and_what_stays_fused():
    torch.manual_seed(0)

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.same = nn.Conv2d(3, 4, 3, padding="same")        # string padding: stays fused
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.row = RowParallelLinear(4, 5)                    # F.linear without its bias
            self.frozen = nn.Linear(5, 5)
            self.frozen.requires_grad_(False)

        def forward(self, x):
            y = self.conv(self.same(x)).mean(dim=(2, 3))
            return self.frozen(self.row(y) + self.row.bias)

    class Tracer(torch.fx.Tracer):      # the row-parallel linear as a leaf, as the tp rewrite leaves it
        def is_leaf_module(self, m, qualname):
            return isinstance(m, RowParallelLinear) or super().is_leaf_module(m, qualname)

    model = Odd()
    gm = torch.fx.GraphModule(model, Tracer().trace(model))
    split, names = split_weight_gemms(gm)
    assert names == ["conv", "row"]
    assert isinstance(split.get_submodule("conv"), SplitConv) and isinstance(split.get_submodule("row"), SplitLinear)
    assert not isinstance(model.conv, SplitConv)                  # the user's model is untouched
    x = torch.randn(2, 3, 8, 8)
    got = _grads(split, x, key="k", autocast=torch.bfloat16)
    want = _grads(copy.deepcopy(model), x, autocast=torch.bfloat16)
    for n in want:
        if want[n] is not None:
            assert got[n].dtype == torch.float32 and torch.allclose(got[n], want[n], rtol=2e-2, atol=2e-3), n


def test_w_writes_into_grad_and_hooked_weights_go_through_autograd(monkeypatch):
    """W adds a hook-free weight's gradient into ``.grad`` by the GEMM itself (no autograd call; a tied
    weight's two uses add up, onto what earlier microbatches left); a weight with a post-accumulate hook
    goes through autograd, its hook firing once per W with the complete gradient (autograd also fires
    it during I, without one: see autosplit/weight_grad.py)."""
    torch.manual_seed(0)
    lin, tied, hooked = nn.Linear(6, 6), nn.Parameter(torch.randn(6, 6)), nn.Linear(6, 3)
    seen = []
    hooked.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad if p.grad is None else p.grad.clone()))
    ref = copy.deepcopy((lin, tied, hooked))

    def model(x, lin, tied, hooked, split):
        linear = split_linear if split else F.linear
        h = linear(torch.tanh(linear(x, lin.weight, lin.bias)), tied)
        return linear(linear(h, tied), hooked.weight, hooked.bias)          # (B, N, 3)

    calls = []
    backward = torch.autograd.backward
    monkeypatch.setattr(torch.autograd, "backward", lambda *a, **k: (calls.append(a[0]), backward(*a, **k)))
    for k in range(2):          # the second microbatch adds onto the first one's .grad
        x = torch.randn(2, 5, 6)
        with DEFERRED.collecting(("t", k)):
            backward(model(x, lin, tied, hooked, True).square().sum())
        n_hooks, calls[:] = len(seen), []
        DEFERRED.run(("t", k))
        assert len(seen) == n_hooks + 1 and calls == [[hooked.weight]]     # only the hooked weight: autograd
        model(x, *ref, False).square().sum().backward()
    for got, want in zip((lin.weight, lin.bias, tied, hooked.weight), (ref[0].weight, ref[0].bias, ref[1], ref[2].weight)):
        assert torch.allclose(got.grad, want.grad, atol=1e-5), (got.grad - want.grad).abs().max()
    assert torch.allclose(seen[-1], ref[2].weight.grad, atol=1e-5)


# ---- equivalence with single-device training (gloo, strict transport) --------------------------------
def _check(results, name, schedule=None, mesh=None, m=None, device_type="cuda"):
    """Equal to single-device training; the stages that queued weight gradients are exactly those the
    cost model prices a separate W for (``deferred_w_stages``: under zb-h1 / zb-v the stages where some
    W does not directly follow its I; the others keep their GEMMs fused), and at least one did."""
    for r in results:
        assert r["loss_diff"] <= TOL and r["param_diff"] <= TOL, r
    got = set().union(*(r["deferring"] for r in results))
    if schedule is not None:
        # the worlds plan with the H100 profile unless told (train_with_deferral): a GPU's splits the
        # early hand-offs too
        want = deferred_w_stages(schedule, mesh[0], m, 2 if schedule == "zb-v" else 1, mesh[1], device_type)
        # torchvision's attention is a leaf MultiheadAttention (fused): at pp=4 a stage may hold nothing else
        assert got == want or name == "torchvision" and got < want, (got, sorted(want))
        assert got or not want, "no weight gradient was deferred"
    else:
        assert got, "no weight gradient was deferred"


@pytest.mark.parametrize("name,schedule,m", [
    ("timm_cls", "zb-h1", 2), ("timm_cls", "zb-h1", 8), ("timm_cls", "zb-v", 2), ("timm_cls", "zb-v", 8),
    ("torchvision", "zb-v", 4), ("hand", "zb-h1", 4), ("shared_weight", "zb-v", 4), ("shared_weight", "zb-h1", 8)])
@pytest.mark.default_cases('torchvision-zb-v-4', 'shared_weight-zb-h1-8')
def test_pp2_matches_single_device(pool2, name, schedule, m):
    _check(pool2.run(Z.train_with_deferral, name, (2, 1, 1), schedule, m), name, schedule, (2, 1, 1), m)


def test_cpu_profile_keeps_the_hand_off_stages_fused(pool2):
    """Planned with a CPU profile, zb-v at pp=2, m=8 splits only stages 1 and 2 (its first and last
    stage run every W right after its I: fused there, their I runs the whole backward), and training
    still equals single-device."""
    from tests.test_measured_profile import CPU
    results = pool2.run(Z.train_with_deferral, "timm_cls", (2, 1, 1), "zb-v", 8, device=CPU)
    _check(results, "timm_cls", "zb-v", (2, 1, 1), 8, device_type="cpu")
    assert set().union(*(r["deferring"] for r in results)) == {1, 2}


@pytest.mark.parametrize("name,schedule,mesh,m,kw", [
    ("timm_cls", "zb-h1", (4, 1, 1), 4, {}), ("hand", "zb-v", (4, 1, 1), 8, {}),
    ("torchvision", "zb-h1", (4, 1, 1), 8, {}),
    ("tp_timm", "zb-v", (2, 2, 1), 4, {"sequence_parallel": True}), ("tp_hand", "zb-h1", (2, 2, 1), 2, {}),
    ("timm_cls", "zb-v", (2, 1, 2), 2, {}), ("shared_weight", "zb-h1", (2, 1, 2), 4, {})])
@pytest.mark.default_cases('tp_hand-zb-h1-mesh4-2-kw4')
def test_pp4_tp_dp_matches_single_device(pool4, name, schedule, mesh, m, kw):
    results = pool4.run(Z.train_with_deferral, name, mesh, schedule, m, **kw)
    _check(results, name, schedule, mesh, m)
    if mesh[2] > 1:         # buckets still launch during the step: armed at each stage's last W
        assert all(sum(r["early"]) > 0 for r in results), [r["early"] for r in results]


def test_cost_model_prices_i_and_w():
    """W of a weight GEMM is one GEMM of the forward's FLOPs; I is the rest of the backward; the summary
    shows W per stage for zero-bubble plans."""
    from autosplit.cost_model import get_profile
    from autosplit.cost_model.roofline import node_time
    from autosplit.cost_model.weight_grad import split_backward_time
    from autosplit.passes.split_backward import weight_gemm_nodes
    plan = autosplit.compile(VARIANTS["timm_cls"](), mesh=(2, 1, 1), example_input=torch.randn(64, 3, 32, 32),
                             schedule="zb-h1", num_microbatches=2)
    for s in plan.stages:
        assert 0 < s.w_time < s.bwd_time
    assert "W ms per stage" in plan.summary()
    gm = plan.graph
    (fc,) = [n for n in weight_gemm_nodes(gm) if n.target == "blocks.0.mlp.fc1"]
    fwd, bwd = node_time(fc, get_profile("h100"))
    i_time, w_time = split_backward_time([fc], {fc}, "h100")
    assert i_time + w_time == pytest.approx(bwd) and w_time == pytest.approx(fwd, rel=0.5)
    assert split_backward_time([fc], set(), "h100") == (pytest.approx(bwd), 0.0)


@pytest.mark.parametrize("name,kw", [("tp_timm", {}), ("tp_torchvision", {"sequence_parallel": True})])
@pytest.mark.default_cases('tp_timm-kw0')
def test_tp_backward_overlaps_weight_grads(pool2, name, kw):
    """1F1B under tp: the entries' input-gradient all-reduce (reduce-scatter under sequence parallelism)
    is in flight while the queued weight-gradient GEMMs run; training still equals single-device."""
    results = pool2.run(Z.train_with_deferral, name, (1, 2, 1), "1f1b", 2, **kw)
    _check(results, name)
    assert all(r["overlapped"] > 0 for r in results), [r["overlapped"] for r in results]


@pytest.mark.slow
def test_tp_overlap_with_dp_buckets(pool4):
    """tp x dp under 1F1B: autograd fires a weight's post-accumulate hook during the backward that
    deferred its gradient, so arming the buckets before that backward launched them without the
    weight gradients (param diff 1e-4, found by test_tp_pp_dp_eight_ranks); they are armed after it."""
    results = pool4.run(Z.train_with_deferral, "tp_timm", (1, 2, 2), "1f1b", 2)
    _check(results, "tp_timm")
    assert all(r["overlapped"] > 0 and sum(r["early"]) > 0 for r in results), results
