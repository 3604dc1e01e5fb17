"""The step priced as the runtime runs it (issue 51): optimizer, dp pieces, FSDP prefetch, recomputed
collectives, collectives priced once, loss all-reduces per axis; the sharding engine's Partial,
shared collectives and real microbatch; the search and ``mesh="auto"`` under autocast, and the CLI flag.

Each test pins one fix; all are cheap (tiny models, one small search).
"""
import pytest
import torch
import torch.fx as fx
from torch import nn

import autosplit
from autosplit.cost_model import get_profile
from autosplit.cost_model.comm import all_gather_time, all_reduce_time, reduce_scatter_time
from autosplit.cost_model.roofline import node_time
from autosplit.cost_model.sharding import DP_BUCKET_BYTES, dp_cost
from autosplit.cost_model.step_time import StageTimes, plan_stage_times, predict_plan, predict_step, step_collectives
from autosplit.passes.sharding.engine import analyse
from autosplit.passes.sharding.solve import solve
from autosplit.passes.sharding.strategies import P
from autosplit.passes.shape_prop import MetaShapeProp

from tests.models import tp_timm

H100 = get_profile("h100")
X = torch.empty(1, 3, 32, 32)


# ---- the step ------------------------------------------------------------------------------------------
def test_optimizer_step_is_its_own_part_and_follows_the_class():
    from autosplit.cost_model.optimizer_step import optimizer_kind
    adamw, sgd = optimizer_kind(torch.optim.AdamW), optimizer_kind(torch.optim.SGD)
    assert (adamw.name, adamw.passes) == ("adamw", 20) and (sgd.name, sgd.passes) == ("sgd", 3)
    momentum = optimizer_kind(torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9))
    assert momentum.name == "sgd_momentum" and momentum.passes == 8
    opt = adamw.time(4e9, 200, H100)          # 1e9 float32 parameters: 20 x 4 GB at the achievable bandwidth
    assert opt == pytest.approx(80e9 / (H100.mem_bandwidth * H100.bandwidth_efficiency) +
                                8 * 5 * H100.op_overhead)
    base = predict_step("1f1b", 1, 2, 1, [StageTimes(fwd=1.0, bwd=2.0)])
    with_opt = predict_step("1f1b", 1, 2, 1, [StageTimes(fwd=1.0, bwd=2.0, opt=0.5)])
    assert with_opt.optimizer == 0.5 and with_opt.total == pytest.approx(base.total + 0.5)
    assert with_opt.compute == base.compute and with_opt.bubble == pytest.approx(base.bubble)


def test_plan_predicted_step_prices_the_users_optimizer():
    from autosplit.cost_model.optimizer_step import optimizer_kind
    plan = autosplit.compile(tp_timm(), mesh=(1, 1, 1), example_input=torch.empty(4, 3, 32, 32), device="h100")
    adamw, sgd = plan.predicted_step(), plan.predicted_step(optimizer=torch.optim.SGD)
    params = plan.stages[0].param_bytes
    assert adamw.optimizer == pytest.approx(optimizer_kind("adamw").time(params, len(plan.stages[0].params), H100))
    assert 0 < sgd.optimizer < adamw.optimizer and adamw.total - sgd.total == pytest.approx(
        adamw.optimizer - sgd.optimizer)


def test_ddp_buckets_each_pay_their_latency_at_their_size():
    size = 100 * 2**20 + 1000                     # four full buckets and a small remainder
    cost = dp_cost(size, 0.0, 8, 4, None, H100)
    assert cost.buckets == 5
    assert cost.time == pytest.approx(4 * all_reduce_time(DP_BUCKET_BYTES, 8, H100) + all_reduce_time(1000, 8, H100))
    assert cost.time > all_reduce_time(size, 8, H100)        # one large message was the old price


def test_fsdp_layer_gathers_are_prefetched_per_unit_and_microbatch():
    from autosplit.cost_model.step_time import fsdp_exposed
    unit, k = 50 * 2**20, 4
    cost = dp_cost(k * unit, unit, 8, 3, "layer", H100)
    one = all_gather_time(unit, 8, H100)
    assert cost.units == k and cost.gather == pytest.approx(k * one)
    assert cost.time == pytest.approx(k * reduce_scatter_time(unit, 8, H100))
    assert fsdp_exposed(cost.gather, k, compute=1.0) == pytest.approx(one)       # compute hides all but the first
    assert fsdp_exposed(cost.gather, k, compute=0.0) == pytest.approx(cost.gather)
    fwd, bwd = 1e-3, 2e-3
    stage = StageTimes(fwd=fwd, bwd=bwd, gather_fwd=fsdp_exposed(cost.gather, k, fwd),
                       gather_bwd=fsdp_exposed(cost.gather, k, bwd), dp=cost.time)
    pred = predict_step("1f1b", 1, 3, 1, [stage])
    # every forward and backward of the 3 microbatches waits for its exposed gathers, counted as dp
    exposed = 3 * (stage.gather_fwd + stage.gather_bwd)
    assert pred.compute == pytest.approx(3 * (fwd + bwd))
    assert pred.dp_comm == pytest.approx(exposed + cost.time)
    assert pred.total == pytest.approx(3 * (fwd + bwd) + exposed + cost.time)


def test_loss_is_summed_by_one_all_reduce_per_axis():
    gather = all_gather_time(40 * 8, 8, H100)
    assert step_collectives(H100, 8, (2, 2, 2)) == pytest.approx(gather + 3 * all_reduce_time(16, 2, H100))
    assert step_collectives(H100, 8, (1, 8, 1)) == pytest.approx(gather + all_reduce_time(16, 8, H100))
    assert step_collectives(H100, 1, (1, 1, 1)) == 0.0


@pytest.fixture(scope="module")
def tp_plans():
    x = torch.empty(4, 3, 32, 32)
    return {r: autosplit.compile(tp_timm(), mesh=(1, 2, 1), example_input=x, device="h100", recompute=r)
            for r in (None, "stage")}


def test_collectives_are_priced_once(tp_plans):
    nodes = [n for n in tp_plans[None].graph.graph.nodes if getattr(n.target, "comm_kind", None)
             and not getattr(n.target, "cost_rule", None)]
    assert nodes
    for n in nodes:                # communication only (comm.py), never also a memory-bound op
        assert node_time(n, H100) == (0.0, 0.0), n.name


def test_recomputation_runs_the_forward_collectives_again(tp_plans):
    plain, again = (plan_stage_times(tp_plans[r]) for r in (None, "stage"))
    assert plain[0].tp_fwd > 0
    assert again[0].tp_bwd == pytest.approx(plain[0].tp_bwd + plain[0].tp_fwd)
    assert again[0].send == pytest.approx(plain[0].send)


# ---- the sharding engine -------------------------------------------------------------------------------
class _RowThenScale(nn.Module):
    """fc1 column-parallel, fc2 row-parallel: its Partial sum flows through `* 2` before the sum."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256, bias=False), nn.Linear(256, 64, bias=False)

    def forward(self, x):
        return self.fc2(self.fc1(x)) * 2


def _traced(module, x):
    gm = fx.symbolic_trace(module)
    MetaShapeProp((x,))(gm)
    return gm


def test_partial_values_are_priced_whole():
    gm = _traced(_RowThenScale(), torch.empty(8, 64, device="meta"))
    sh, _ = analyse(gm, 4, H100, defer=True)
    mul = next(n for n in gm.graph.nodes if n.op == "call_function")
    ns = sh.nodes[mul]
    partial = [k for k, s in enumerate(ns.options) if s.out == P]
    assert partial
    for k in partial:              # every rank holds the whole summand: full time, full saved bytes
        assert ns.compute[k] == pytest.approx(ns.compute[0])
        assert ns.memory[k] == pytest.approx(ns.memory[0])
    fc2 = next(n for n in gm.graph.nodes if n.target == "fc2")
    row = next(k for k, s in enumerate(sh.nodes[fc2].options) if s.out == P)
    assert sh.nodes[fc2].compute[row] > sh.nodes[fc2].compute[0] / 4   # 1/4 of the FLOPs, the whole output


def test_one_collective_per_producer_is_priced_once():
    # node 0 (the producer) R only; consumers 1..3: option 0 whole (compute 1.0), option 1 split (compute
    # 0.5) needing a collective of 0.9 from the producer, the same one for all three (one key)
    nodes = [[0.0], [1.0, 0.5], [1.0, 0.5], [1.0, 0.5]]
    edges = [(0, c, {(0, 0): 0.0, (0, 1): 0.9}, {(0, 1): ("copy",)}) for c in (1, 2, 3)]
    assert solve(nodes, edges) == [0, 1, 1, 1]            # 0.9 once < 3 x 0.5 saved
    assert solve(nodes, [e[:3] for e in edges]) == [0, 0, 0, 0]   # per edge, 2.7 > 1.5: the old price


class _QKV(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(64, 64) for _ in range(3))

    def forward(self, x):
        return self.q(x) + self.k(x) * self.v(x)


def test_engine_shares_the_input_copy_of_split_projections():
    gm = _traced(_QKV(), torch.empty(8, 16, 64, device="meta"))
    _, pr = analyse(gm, 4, H100, defer=True)
    x = next(i for i, v in enumerate(pr.order) if v.op == "placeholder")
    keyed = [e for e in pr.edges if e[0] == x and len(e) > 3 and e[3]]
    assert len(keyed) == 3                              # q, k and v read x: one key set each
    keys = [set(e[3].values()) for e in keyed]
    assert keys[0] & keys[1] & keys[2]                  # the same collective, so priced once


def test_auto_prices_the_plans_own_microbatch():
    plan = autosplit.compile(tp_timm(), mesh=(1, 2, 1), example_input=torch.empty(8, 3, 32, 32), device="h100",
                             tp_mode="auto", num_microbatches=4)
    sh = plan.tp_plan.sharding
    assert sh is not None and sh.price_vals is None     # the graph's own 8 rows, not 2
    assert sh.enum.microbatches == 4


# ---- autocast in the search ----------------------------------------------------------------------------
def test_search_with_autocast_prices_what_compile_plans():
    model, batch = tp_timm(), 16
    fp32 = autosplit.search(model, 4, X, global_batch=batch, top=3)
    bf16 = autosplit.search(model, 4, X, global_batch=batch, top=3, autocast=torch.bfloat16)
    assert all(c.options["autocast"] is torch.bfloat16 for c in bf16)
    assert all("autocast" not in c.options for c in fp32)
    best = {c.label: c for c in fp32}
    same = [c for c in bf16 if c.label in best]
    assert same and all(c.parts["compute"] < best[c.label].parts["compute"] for c in same)
    c = bf16[0]
    b = batch // c.mesh[2] // c.options["num_microbatches"]
    plan = autosplit.compile(model, mesh=c.mesh, example_input=torch.empty(b, 3, 32, 32), device="h100", **c.options)
    assert plan.autocast == "bfloat16"
    assert predict_plan(plan).total == pytest.approx(c.step_time, rel=1e-9)
    with pytest.raises(autosplit.AutosplitError, match="autocast"):
        autosplit.search(model, 4, X, global_batch=batch, autocast=torch.float64)


def test_mesh_auto_searches_under_autocast(monkeypatch):
    from autosplit.runtime.auto_mesh import auto_arguments
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    chosen = auto_arguments(tp_timm(), torch.empty(1, 3, 32, 32), 8, {"device": "h100"}, torch.bfloat16)
    assert chosen["autocast"] is torch.bfloat16
    assert chosen["example_input"].shape[0] * chosen["num_microbatches"] * chosen["mesh"][2] == 8


def test_cli_search_takes_autocast(capsys):
    from autosplit.__main__ import main
    assert main(["search", "tests.models:tp_timm", "--world", "2", "--global-batch", "8", "--top", "2",
                 "--autocast", "bf16", "--optimizer", "sgd"]) == 0
    out = capsys.readouterr().out
    assert "autocast bf16" in out and "optimizer sgd" in out and "step ms" in out
