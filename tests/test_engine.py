"""The sharding engine (passes/sharding/): its pieces alone, and what it does on real timm models.

Terms:
  attention split -- under 1D, the attention's input projections (fused qkv, separate q/k/v, or an
                     ``F.linear`` of a fused weight) column-parallel and its output projection
                     row-parallel, read from ``plan.tp_plan.regions`` (one line per layer).
  brute force     -- every assignment of options to the nodes of a small problem, priced the way
                     solve.py's objective prices them: the integer program must find the same optimum.
"""
import dataclasses
import itertools
import random

import pytest
import torch

import autosplit
from autosplit.passes.sharding.factors import Factors, index_set, index_sets
from autosplit.passes.sharding.solve import solve
from autosplit.tp.shards import RankSlices
from tests import checks_zoo as C
from tests.models import tp_timm
from tests.models_zoo import IMAGE, build

TOL = 1e-5
REAL = ["beit", "eva02", "vit_relpos", "cait"]


def test_refining_a_factor_refines_its_whole_class():
    f = Factors()
    a, b = f.new(12), f.new(12)
    assert f.align([a], [b])                       # one logical dim
    f.split(a, [3, 4])                             # a reshape of a: (3, 4)
    assert [f.size[x] for x in f.flat([b])] == [3, 4]
    assert f.find(f.flat([a])[1]) == f.find(f.flat([b])[1])
    c = f.new(6)
    assert f.align([c], [f.flat([a])[0], f.new(2)])   # 6 pairs with (3, 2): c is refined to match
    assert [f.size[x] for x in f.flat([c])] == [3, 2]


def test_index_set_of_a_strided_factor():
    f = Factors()
    qkv = f.new(24)                                 # (3, heads 4, head_dim 2) after a reshape
    f.split(qkv, [3, 8])
    f.split(f.children[qkv][1], [4, 2])
    heads = f.flat([qkv])[1]
    got = index_set(f, [qkv], heads, 2, 1)          # rank 1 of 2 holds heads 2, 3 of each of q, k, v
    assert got.tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]


def test_rank_indices_cost_one_arange_not_one_per_rank():
    """A 1024-way layout of a 6144-wide ViT kept one full arange per rank and parameter (38 GB: the
    ViT-22B search was killed for memory); now every rank's indices view one arange, and a plan's
    per-rank slices are built only for the ranks read (the search reads rank 0's)."""
    f = Factors()
    width = f.new(4096)
    ranks = index_sets(f, [width], width, 1024)
    assert [r.tolist() for r in ranks[:2]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len({r.untyped_storage().data_ptr() for r in ranks}) == 1          # one arange for all 1024
    plan = autosplit.compile(tp_timm(), mesh=(1, 4, 1), example_input=torch.empty(2, 3, 32, 32), tp_mode="2d",
                             tp_2d_form="allgather")
    slices = [sp.slices for sp in plan.tp_plan.sharded.values()]
    assert slices and all(isinstance(s, RankSlices) and len(s) == 4 for s in slices)
    stored = [s for s in slices if len({ix.untyped_storage().data_ptr() for r in range(4) for ix in s[r].values()}) == 1]
    assert stored                                   # a stored split's ranks share one arange too
    lazy = RankSlices(1024, lambda r: {0: torch.tensor([r])})
    assert lazy[5][0].item() == 5 and lazy[-1][0].item() == 1023 and lazy._done.keys() == {5, 1023}
    with pytest.raises(IndexError):
        lazy[1024]


def _brute(nodes, edges, must):
    best = None
    for picks in itertools.product(*[range(len(c)) for c in nodes]):
        if any(not any(picks[v] == s for v, s in g) for g in must):
            continue
        total = sum(nodes[v][s] for v, s in enumerate(picks))
        for p, c, pairs in edges:
            if (picks[p], picks[c]) not in pairs:
                break
            total += pairs[(picks[p], picks[c])]
        else:
            best = total if best is None else min(best, total)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_solver_finds_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 6)
    nodes = [[rng.uniform(0, 5) for _ in range(rng.randint(1, 3))] for _ in range(n)]
    edges = []
    for c in range(1, n):
        for p in rng.sample(range(c), rng.randint(1, min(2, c))):
            pairs = {(a, b): rng.uniform(0, 3) for a in range(len(nodes[p])) for b in range(len(nodes[c]))
                     if rng.random() < 0.8}
            pairs.setdefault((0, 0), 1.0)       # always one way through
            edges.append((p, c, pairs))
    must = [[(n - 1, len(nodes[n - 1]) - 1)]] if rng.random() < 0.5 else []
    picks = solve(nodes, edges, must)
    total = sum(nodes[v][s] for v, s in enumerate(picks)) + sum(pairs[(picks[p], picks[c])] for p, c, pairs in edges)
    assert total == pytest.approx(_brute(nodes, edges, must) if _brute(nodes, edges, must) is not None
                                  else _brute(nodes, edges, []), rel=1e-6, abs=1e-9)


def _plan(name, mesh=(1, 2, 1), **kw):
    torch.manual_seed(0)
    x = torch.randn(2, 3, IMAGE[name], IMAGE[name])
    return autosplit.compile(build(name), mesh=mesh, example_input=x, device="cpu", **kw)


@pytest.mark.parametrize("name", REAL)
def test_1d_splits_the_attention_of_real_models(name):
    """beit (relative position bias, q/v biases concatenated), eva02 (rotary q/k), vit_relpos (a bias
    MLP) and cait (talking heads, class attention): every block's attention input projections are
    column-parallel and its output projection row-parallel."""
    plan = _plan(name)
    lines = plan.tp_plan.regions
    blocks = {line.split(".attn")[0] for line in lines if ".attn" in line and line.startswith("blocks")}
    assert blocks, lines
    for block in blocks:
        attn = [line for line in lines if line.startswith(block + ".attn")]
        entries = [line for line in attn if ("qkv" in line or ".q:" in line or ".k:" in line or ".v:" in line
                                             or line.startswith(block + ".attn:") or " [linear" in line)]
        exits = [line for line in attn if ".attn.proj:" in line]
        assert entries and all(": column" in line for line in entries), attn
        assert exits and all(": row" in line for line in exits), attn


@pytest.mark.parametrize("name", REAL)
@pytest.mark.default_cases('beit')
def test_2d_plans_real_models(name):
    plan = _plan(name, mesh=(1, 4, 1), tp_mode="2d", num_microbatches=1)
    assert plan.tp_plan.forms and all(form == "allgather" for _, form in plan.tp_plan.forms)


@pytest.mark.slow       # pp x tp training: test_tensor_parallel's; these models: the zoo's (beit by default)
def test_real_models_train_like_one_device_with_pipeline_and_tp(pool4):
    """(2, 2, 1): pipeline stages of tensor-parallel blocks, 3 SGD steps against one device."""
    results = pool4.run(C.train_zoo, REAL, (2, 2, 1), "1d", timeout=400)
    for rank, per_model in enumerate(results):
        for name in REAL:
            r = per_model[name]
            assert "error" not in r and "refused" not in r, (rank, name, r)
            assert r["loss_diff"] <= TOL and r["param_diff"] <= TOL, (rank, name, r)


def test_explain_lists_every_candidate_with_its_cost():
    plan = _plan("beit")
    text = plan.explain("blocks.0.attn.proj")
    lines = [line for line in text.splitlines() if line.startswith("  ")]
    assert len(lines) >= 2 and sum("<- chosen" in line for line in lines) == 1, text
    assert "Partial from (Shard[" in text and "compute" in text and "redistribution" in text
    with pytest.raises(autosplit.AutosplitError, match="no node or module path"):
        plan.explain("blocks.0.nothing")


def test_auto_fits_the_memory_budget():
    """tp_mode="auto" (the engine alone): what a rank keeps (parameters x 4, saved activations) within
    the budget; a tighter budget keeps less; an impossible one is said, and planned for time alone."""
    from autosplit.cost_model import get_profile
    from autosplit.passes.shape_prop import MetaShapeProp
    from autosplit.passes.sharding.megatron import shard_1d
    from autosplit.trace import trace
    from tests.models import VARIANTS

    # priced by the plain roofline (datasheet peak, 4 us launches), where this tiny model's fastest layout
    # keeps more than the least it could: the constraint then has something to move
    roofline = dataclasses.replace(get_profile("h100"), gemm_efficiency=1.0, gemm_half_dim=0.0,
                                   bandwidth_efficiency=1.0, op_overhead=4e-6)

    def engine(budget):
        torch.manual_seed(0)
        gm = trace(VARIANTS["tp_timm"]())
        MetaShapeProp((torch.empty(2, 3, 32, 32, device="meta"),))(gm)
        return shard_1d(gm, 2, roofline, auto=True, memory_budget=budget)
    free = engine(None).sharding
    tight = engine(0.99 * free.memory)        # the free plan is near this tiny model's floor already
    assert tight.sharding.memory <= 0.99 * free.memory and not tight.notes
    none = engine(1000)
    assert any("no layout fits the memory budget" in n for n in none.notes), none.notes


@pytest.mark.parametrize("name", ["tp_timm", "tp_torchvision", "tp_hand"])
@pytest.mark.default_cases('tp_torchvision')
def test_auto_trains_like_one_device(pool2, name):
    """tp_mode="auto": whatever the engine picks (layers whole, split by tokens or by features), 3 steps
    equal single-device training."""
    from tests.dist_checks import train_matches_single_device
    for r in pool2.run(train_matches_single_device, name, (1, 2, 1), "1f1b", 1, tp_mode="auto"):
        assert r["loss_diff"] <= TOL and r["param_diff"] <= TOL, r


def _train_many(names, mesh):
    import tests.models_review  # noqa: F401  (registers the models in the worker)
    from tests.dist_checks import train_matches_single_device
    return {n: train_matches_single_device(n, mesh, "1f1b", 1) for n in names}


def test_lowering_edge_cases_train_like_one_device(pool2):
    """The review's models (tests/models_review.py): each split where a lowering mistake would change
    the numbers; 3 SGD steps equal single-device training on both ranks."""
    from tests.models_review import REVIEW
    for per_rank in pool2.run(_train_many, list(REVIEW), (1, 2, 1), timeout=400):
        for name, r in per_rank.items():
            assert r["loss_diff"] <= TOL and r["param_diff"] <= TOL, (name, r)
