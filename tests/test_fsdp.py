"""Sharded data parallelism (issue 12): ``parallelize(..., dp_shard=...)`` shards each stage over dp with
FSDP2 (runtime/parallel/fsdp.py).  Real gloo processes against single-device training; the cost model's
sharded memory (cost_model/sharding.py) offline."""
import pytest
import torch

import autosplit
from autosplit.cost_model import H100 as PROFILE
from autosplit.cost_model.sharding import dp_cost
from tests import checks_fsdp as C
from tests.models import VARIANTS

TOL = 1e-5
BF16_TOL = 5e-3     # bf16 all-gathered parameters vs fp32 ones under autocast; measured 1.2e-3 (params), 2e-4 (loss)


def _check(results, sharded_somewhere=True):
    for r in results:
        assert r["loss_diff"] <= TOL and r["param_diff"] <= TOL, r
    if sharded_somewhere:
        assert all(r["sharded"] > 0 for r in results), "dp_shard left a rank without sharded parameters"


@pytest.mark.slow       # sharded training is also checked by test_rebuilt_on_the_same_mesh_after_close
def test_dp4_and_pipeline_dp2(pool4):
    """(1,1,4) per stage, (2,1,2) per layer with clip_grad_norm_, (2,1,2) interleaved with the cost
    model's choice, (1,2,2) with sequence parallelism (norms stay replicated, the rest sharded)."""
    rs = pool4.run(C.adamw_matches, "hand", (1, 1, 4), batch=16, dp_shard="stage")
    _check(rs)
    assert all(r["sharded"] == r["params"] for r in rs), rs[0]
    rs = pool4.run(C.adamw_matches, "timm_cls", (2, 1, 2), dp_shard="layer", clip=0.05)
    _check(rs)
    for r in rs:    # the global norm over pp and the dp shards equals the single-device one
        assert max(abs(a - b) for a, b in r["norms"]) <= 1e-5 * r["norms"][0][1], r["norms"]
    rs = pool4.run(C.adamw_matches, "torchvision", (2, 1, 2), schedule="interleaved", chunks=2, dp_shard=True)
    _check(rs)
    assert rs[0]["plan_dp_shard"] == "stage"     # no memory budget: the granularity with the least traffic
    rs = pool4.run(C.adamw_matches, "tp_timm", (1, 2, 2), dp_shard="layer", sequence_parallel=True)
    _check(rs)
    assert all(0 < r["sharded"] < r["params"] for r in rs), rs[0]    # the tp partial-sum norms are left out


# Issue 50 item 8: right after parallelize, a model not built on meta under dp_shard -- beyond the user's
# own model (their untrained copy, documented to stay theirs; the check leaves its storages out) -- each
# rank holds about its shards: <= 0.6 x its stages' parameter bytes at dp = 2 (shards are 0.5 x; the
# rest is small index tables).  Failed before release_plan_values: at (1, 2, 2) the plan's cached
# tp-local stages stayed alive (1.14 x on tp rank 0, 1.69 x on tp rank 1: its own stage module too,
# held by the shared graph's owning_module).  At tp = 1 the plan's modules are the user's, so (1, 1, 2)
# and (2, 1, 2) passed before too; they keep that so.
HELD = 0.6


def _held(results):
    for r in results:
        assert r["sharded"] > 0 and r["held"] <= HELD * r["stage"], r


def test_non_meta_model_sharded_holds_only_its_shards(pool2):
    _held(pool2.run(C.held_beyond_user_model, "timm_cls", (1, 1, 2)))


@pytest.mark.parametrize("name,mesh,dp_shard", [("tp_timm", (1, 2, 2), "stage"), ("tp_timm", (1, 2, 2), "layer"),
                                                ("timm_cls", (2, 1, 2), "stage")],
                         ids=["tp2-stage", "tp2-layer", "pp2-stage"])
@pytest.mark.default_cases("tp2-stage")
def test_non_meta_model_sharded_holds_only_its_shards_with_tp_and_pp(pool4, name, mesh, dp_shard):
    _held(pool4.run(C.held_beyond_user_model, name, mesh, dp_shard=dp_shard))


@pytest.mark.slow      # a further case of FSDP2 (6 s): rebuilt after close
def test_rebuilt_on_the_same_mesh_after_close(pool4):
    """close() destroys the groups; torch's DTensor caches key on mesh equality (not the groups), so a
    module rebuilt on the same mesh got the destroyed groups back from them after its AdamW steps
    ("Could not resolve the process group registered under the name 11").  World.close empties them."""
    runs = [("timm_cls", (2, 1, 2), {"dp_shard": "layer"}),
            ("torchvision", (2, 1, 2), {"schedule": "interleaved", "chunks": 2, "dp_shard": True})]
    for per_run in pool4.run(C.rebuilt_after_close, runs):
        for r in per_run:
            assert r["loss_diff"] <= TOL and r["param_diff"] <= TOL, r


@pytest.mark.slow
def test_accumulate_predict_load_bf16(pool4):
    """no_sync accumulation over steps, predict, load_full_state_dict; bf16 autocast gathers bf16 copies
    of float32 shards (FSDP2's MixedPrecisionPolicy)."""
    for r in pool4.run(C.accumulate_and_predict, "timm_cls", (2, 1, 2), dp_shard="layer"):
        assert r["param_diff"] <= TOL and r["predict"] <= TOL and r["load"] == 0, r
    for r in pool4.run(C.accumulate_and_predict, "tp_swiglu", (1, 2, 2), dp_shard="stage", recompute="block"):
        assert r["param_diff"] <= TOL and r["predict"] <= TOL and r["load"] == 0, r
    for r in pool4.run(C.bf16_close, "hand", (1, 1, 4), batch=16, dp_shard="stage"):
        assert r["dtypes"] == ["torch.float32"], r
        assert r["loss_diff"] <= BF16_TOL and r["param_diff"] <= BF16_TOL, r


@pytest.mark.slow
def test_readme_recipe_without_example_input(pool4):
    """The README's recipe: no example_input, the optimizer built over ``parameters()`` before the first
    step, which re-plans the provisional plan and puts the new graphs into the FSDP-wrapped modules.
    Setting a GraphModule's graph recompiles it on its class, FSDP2's subclass there, whose ``__call__``
    then called itself (RecursionError) on timm and torchvision models alike."""
    runs = [("timm_cls", (2, 1, 2), "layer"), ("torchvision", (2, 1, 2), "stage"),
            ("tp_timm", (1, 2, 2), "stage"), ("tp_torchvision", (1, 2, 2), "layer")]
    for name, mesh, shard in runs:
        # microbatches of 2 rows: not the provisional plan's 1, so the first step re-plans
        _check(pool4.run(C.adamw_matches, name, mesh, dp_shard=shard, example=False, microbatches=2))


def test_pp_tp_dp_eight_ranks(pool8):
    """(2,2,2): 1F1B per layer; interleaved per stage by the README's recipe (no example_input: the
    first step re-plans the sharded modules, see test_readme_recipe_without_example_input)."""
    _check(pool8.run(C.adamw_matches, "tp_hand", (2, 2, 2), dp_shard="layer"))
    _check(pool8.run(C.adamw_matches, "tp_timm", (2, 2, 2), schedule="interleaved", chunks=2, dp_shard="stage",
                     example=False, microbatches=2))


def test_budget_that_fails_replicated_passes_sharded():
    """The cost model counts parameters, gradients and Adam moments / dp when sharded, so a memory budget
    too small for the replicated plan fits; True picks "stage" when it fits, else "layer".  The cut is
    fixed (the replicated plan's): with a free cut some other cut of the unsharded state may fit the
    same budget, and which one the planner prefers follows the profile's speeds (CI once found one)."""
    model = VARIANTS["timm_cls"](depth=8)
    x = torch.empty(2, 3, 32, 32, device="meta")
    replicated = autosplit.compile(model, mesh=(2, 1, 4), example_input=x, device=PROFILE)
    kw = dict(mesh=(2, 1, 4), example_input=x, device=PROFILE, stage_bounds=replicated.bounds)
    stage = autosplit.compile(model, dp_shard="stage", **kw)
    layer = autosplit.compile(model, dp_shard="layer", **kw)
    peak = [max(s.memory_bytes for s in p.stages) for p in (replicated, stage, layer)]
    assert peak[0] > peak[1] > peak[2], peak
    budget = peak[2]           # the per-layer plan's peak: neither replicated nor per-stage sharding fits
    for shard, name in ((False, ""), ("stage", r" \(dp state sharded per stage\)")):
        with pytest.raises(autosplit.PlanError, match=r"stage_bounds=\[\d+, \d+\]: stage \d needs [\d.]+ MiB "
                           rf"> the memory budget of [\d.]+ MiB per stage{name}"):
            autosplit.compile(model, memory_budget=budget, dp_shard=shard, **kw)
    chosen = autosplit.compile(model, memory_budget=budget, dp_shard=True, **kw)
    assert chosen.dp_shard == "layer" and max(s.memory_bytes for s in chosen.stages) <= budget
    assert "sharded per layer" in chosen.summary() and "sharded" not in replicated.summary()
    # a free cut under the budget: the planner finds one that fits (any sharding), or says none does
    free = autosplit.compile(model, mesh=(2, 1, 4), example_input=x, device=PROFILE, memory_budget=budget,
                             dp_shard=True)
    assert max(s.memory_bytes for s in free.stages) <= budget
    # traffic: replicated all-reduce 2(n-1)/n P; "stage" one all-gather + one reduce-scatter of P
    assert dp_cost(1000, 0, 4, 8, None, "cpu").traffic_bytes == 1500
    assert dp_cost(1000, 0, 4, 8, "stage", "cpu").traffic_bytes == 1500
    assert dp_cost(1000, 100, 4, 8, "layer", "cpu").traffic_bytes == 750 * 17


def test_bad_dp_shard_is_refused():
    with pytest.raises(autosplit.AutosplitError, match="dp_shard='rows'"):
        autosplit.parallelize(VARIANTS["hand"](), mesh=(1, 1, 1), dp_shard="rows")
