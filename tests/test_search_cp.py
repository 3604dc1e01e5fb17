"""The strategy search with the cp axis (issue 52, "costed and searched"): cp layouts enumerated, priced
exactly as compile prices them, chosen where they win (long sequences, a batch smaller than the world, a
memory budget only they meet) and not where they lose (short sequences).

Tiny models on the meta device; each search takes a few seconds.
"""
import random

import pytest
import timm
import torch

import autosplit
from autosplit.cost_model import get_profile
from autosplit.cost_model.step_time import predict_plan
from autosplit.mesh import MeshShape
from autosplit.strategy.candidate import SearchMesh, describe
from autosplit.strategy.layout import ContextLayout, LayoutGraph, trace_model
from autosplit.strategy.space import layouts, shardings

from tests.models import tp_timm

X32 = torch.empty(1, 3, 32, 32)


def long_vit(img: int = 256):
    """ViT with 384 features, 6 heads, 2 blocks, patch 8: 1,025 tokens at 256 px, 65 at 64 px."""
    return timm.models.VisionTransformer(img_size=img, patch_size=8, embed_dim=384, depth=2, num_heads=6,
                                         num_classes=10)


def one_head_vit():
    """Activation-bound at 4,097 tokens: 32 features, one head (tensor parallelism cannot split its attention;
    cp splits its queries), 2 blocks."""
    return timm.models.VisionTransformer(img_size=256, patch_size=4, embed_dim=32, depth=2, num_heads=1,
                                         num_classes=10)


def _compiled(model, c, global_batch: int, image: int, device="h100"):
    b = global_batch // c.mesh.dp // c.options["num_microbatches"]
    return autosplit.compile(model, mesh=c.mesh, example_input=torch.empty(b, 3, image, image), device=device,
                             **c.options)


def _equal_compile(model, c, global_batch: int, image: int) -> None:
    """The candidate's step time, parts, cut and fullest rank's memory are compile's + predict_plan's."""
    plan = _compiled(model, c, global_batch, image)
    assert (plan.mesh.pp, plan.mesh.cp, plan.mesh.tp, plan.mesh.dp) == (c.mesh.pp, c.mesh.cp, c.mesh.tp, c.mesh.dp)
    pred = predict_plan(plan, device="h100")
    assert pred.total == pytest.approx(c.step_time, rel=1e-9), c.label
    assert (pred.compute, pred.tp_comm, pred.pp_comm, pred.dp_comm) == pytest.approx(
        (c.parts["compute"], c.parts["tp_comm"], c.parts["pp_comm"], c.parts["dp_comm"]), rel=1e-9, abs=1e-15)
    assert tuple(plan.bounds) == c.bounds, c.label
    ranks = [sum(plan.stages[s].memory_bytes for s in plan.placement.stages(r)) for r in range(c.mesh.pp)]
    assert max(ranks) == c.memory, c.label


def test_the_space_has_cp_layouts():
    """cp in every divisor >= 2 of the world, 1D tensor parallelism without sequence parallelism inside it
    (tp >= 1, cp * tp dividing W), listed after every cp = 1 layout; both FSDP units beside cp."""
    every = layouts(8)
    cp = [(lay.cp, lay.tp) for lay in every if lay.cp > 1]
    assert cp == [(2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (8, 1)]
    assert all(lay.tp_mode == "1d" and not lay.sequence_parallel and lay.tp_depth is None and lay.unit == 1
               for lay in every if lay.cp > 1)
    assert every[:len(layouts(8, context=False))] == layouts(8, context=False)
    assert all(lay.cp == 1 for lay in layouts(8, context=False))
    assert [s for s, why in shardings(2, "1f1b") if why is None] == [False, "stage", "layer"]   # cp or not


def test_search_mesh_is_a_mesh_shape_that_reads_as_the_tuple():
    m = SearchMesh(pp=2, tp=4, dp=8)
    assert isinstance(m, MeshShape) and m.cp == 1 and m.size == 64
    assert m == (2, 4, 8) and m[2] == 8 and tuple(m) == (2, 4, 8) and hash(m) == hash((2, 4, 8))
    pp, tp, dp = m
    assert (pp, tp, dp) == (2, 4, 8)
    c = SearchMesh(pp=1, tp=2, dp=4, cp=2)
    assert c != (1, 2, 4) and c == MeshShape(pp=1, tp=2, dp=4, cp=2) and c.block == 4 and c.size == 16
    assert MeshShape.parse(c) == MeshShape(pp=1, tp=2, dp=4, cp=2)
    assert describe(m, {"num_microbatches": 4, "tp_mode": "1d"}) == "(2,4,8) 1d 1f1b m4"
    assert describe(c, {"num_microbatches": 1, "tp_mode": "1d"}) == "(pp=1,cp=2,tp=2,dp=4) 1d 1f1b m1"
    assert describe((1, 1, 2), {"num_microbatches": 1}) == "(1,1,2) 1f1b m1"


@pytest.mark.parametrize("cp,tp", [(2, 1), (2, 2)])
@pytest.mark.default_cases("2-2")
def test_cp_graph_at_any_size_equals_compile(cp, tp):
    """A cp layout's graph, rewritten at the plan's b as compile rewrites it (built at 2 and 3 rows,
    rescaled to b), has compile's nodes, costs and cut points at any microbatch count (the rewrite
    prices none: passes/sharding/context.py)."""
    model = tp_timm()
    traced = trace_model(model, (X32,))
    for m, b in [(4, 1), (4, 4), (1, 3), (2, 16)]:
        graph = LayoutGraph(traced, (X32,), tp, "1d", False, cp=cp, rows=b)
        assert graph.tp == cp * tp and (graph.cp, graph.tp_inner) == (cp, tp)
        graph.at(b)
        plan = autosplit.compile(model, mesh={"cp": cp, "tp": tp}, example_input=torch.empty(b, 3, 32, 32),
                                 num_microbatches=m)
        ours = [(n.name, n.meta["cost"]) for n in graph.nodes]
        theirs = [(n.name, n.meta["cost"]) for n in plan.graph.graph.nodes]
        assert ours == theirs, (m, b)
        assert [c.nbytes for c in graph.cuts] == [c.nbytes for c in autosplit.passes.cut_points.find_cuts(plan.graph)]


@pytest.mark.parametrize("family", ["timm", "torchvision", "eva02", "beit", "hand"])
@pytest.mark.default_cases("beit")
def test_identical_layers_rewrite_alike_under_cp(family):
    """The engine's program breaks ties between equal-priced plans alike in every layer (solve.py
    *ties*), so the search rewrites four identical blocks and copies them (passes/repeats.py ``expand``)
    at every cp layout.  Before, the solver's own choice between tied optima (an all-to-all before or
    after a permute) differed between blocks for beit at cp = 2 and 4 and eva02 at cp = 2, and the
    search rewrote the whole graph (ViT-H/14: 0.4 s a layout expanded, 2.2-3.1 s whole)."""
    from autosplit.model_layers import layer_paths
    from autosplit.passes.repeats import reduce
    from tests.test_repeats import FAMILIES
    model = FAMILIES[family]()
    traced = trace_model(model, (X32,))
    repeats = reduce(traced, layer_paths(model))
    for cp, tp in [(2, 1), (4, 1), (2, 2)]:
        assert LayoutGraph(traced, (X32,), tp, "1d", False, repeats=repeats, cp=cp).expanded, (cp, tp)


@pytest.mark.slow      # the default tier copies layers under cp in test_identical_layers_rewrite_alike_under_cp
@pytest.mark.parametrize("family", ["timm", "hand"])
def test_cp_layers_copied_price_as_the_whole_rewrite(family):
    """The search rewrites four of a model's identical blocks and copies the rest (passes/repeats.py): for
    a cp layout the copies price as the whole rewrite does (every stage cut's time, bytes and activations,
    at three sizes).  Node for node the two may differ where the engine's program has equal-priced
    optima: an all-to-all placed before or after a permute of the same bytes (the 4-block and the
    6-block program break that tie differently in block 0)."""
    from collections import Counter
    from autosplit.model_layers import layer_paths
    from autosplit.passes.repeats import reduce
    from autosplit.strategy.costing import Group
    from tests.test_repeats import FAMILIES
    profile = get_profile("h100")
    model = FAMILIES[family]()
    traced, layers = trace_model(model, (X32,)), layer_paths(model)
    repeats = reduce(traced, layers)
    for cp, tp in [(2, 1), (2, 2)]:
        whole = LayoutGraph(traced, (X32,), tp, "1d", False, cp=cp)
        copied = LayoutGraph(traced, (X32,), tp, "1d", False, repeats=repeats, cp=cp)
        assert not whole.expanded and copied.expanded
        ops = [Counter((n.op, str(n.target).split(" at ")[0], n.meta.get("module_path")) for n in g.nodes)
               for g in (whole, copied)]
        assert ops[0] == ops[1]
        for b in (2, 3, 5):
            whole.at(b), copied.at(b)
            assert [(c.position, c.nbytes) for c in whole.cuts] == [(c.position, c.nbytes) for c in copied.cuts], b
            g1, g2 = (Group(g, b, None, profile, layers, 1000) for g in (whole, copied))
            assert g1.seg.time == pytest.approx(g2.seg.time, rel=1e-12) and g1.seg.params == g2.seg.params, b
            last = len(g1.segments) - 1
            for stages in (2, 3):
                cut = g1.bounds(stages)
                assert cut == g2.bounds(stages)
                starts = [0, *[c + 1 for c in cut[:-1]]]
                assert [g1.activations(s, e) for s, e in zip(starts, cut)] == \
                       [g2.activations(s, e) for s, e in zip(starts, cut)]
            one, two = (g.stages([last // 3, 2 * last // 3, last])[1] for g in (g1, g2))
            assert one == two, b


@pytest.mark.slow      # 10 s; the default tier checks search = compile for cp in test_cp_graph_at_any_size_equals_compile
def test_cp_candidates_equal_compile():
    """Every cp candidate priced is what compile + predict_plan give: the first few and a sample over
    schedules, recomputation, dp sharding, microbatch counts and sizes (b = 1 among them)."""
    model, batch = tp_timm(), 8
    every = autosplit.search(model, 4, X32, global_batch=batch, top=10**6, prune=False, device="h100")
    cps = [c for c in every if c.mesh.cp > 1]
    assert {(c.mesh.cp, c.mesh.tp) for c in cps} == {(2, 1), (2, 2), (4, 1)}
    assert all(c.options["tp_mode"] == "1d" and not c.options["sequence_parallel"]
               and c.options["cp_attention"] == "auto" for c in cps)
    picks = cps[:2] + random.Random(0).sample(cps[2:], 2)
    picks += [next(c for c in cps if c.options["schedule"] == "zb-h1"),
              next(c for c in cps if c.options["dp_shard"] == "layer"),
              next(c for c in cps if c.options["dp_shard"] == "stage"),
              next(c for c in cps if batch // c.mesh.dp // c.options["num_microbatches"] == 1 and c.mesh.pp > 1)]
    for c in {c.label: c for c in picks}.values():
        _equal_compile(model, c, batch, 32)


@pytest.mark.slow
def test_a_budget_only_cp_meets_picks_cp_and_compile_agrees():
    """Without a budget a cp = 1 configuration wins; under a budget below every cp = 1 configuration's
    memory the search picks a cp layout (one head: tensor parallelism cannot split the attention, cp splits
    its queries), and compile of it predicts the step, cut and memory the search priced."""
    model, batch = one_head_vit(), 4
    x = torch.empty(1, 3, 256, 256)
    assert autosplit.search(model, 4, x, global_batch=batch, top=1, device="h100")[0].mesh.cp == 1
    without = autosplit.search(model, 4, x, global_batch=batch, top=10**6, prune=False, device="h100",
                               context_parallel=False)
    budget = min(c.memory for c in without) - 1
    ranked = autosplit.search(model, 4, x, global_batch=batch, top=3, device="h100", memory_budget=budget)
    assert ranked and all(c.mesh.cp > 1 and c.memory <= budget for c in ranked), ranked.table()
    assert any(r.kind == "memory" and r.mesh.cp == 1 for r in ranked.rejected)
    assert ranked[0].options["memory_budget"] == budget
    _equal_compile(model, ranked[0], batch, 256)


def test_long_sequences_pick_cp_and_short_ones_do_not():
    """One image per step on 4 ranks: at 1,025 tokens cp is chosen; at 65 tokens, where cp's key gathers
    cost more than its split saves, 1D tensor parallelism (cp candidates priced, and slower)."""
    long = autosplit.search(long_vit(256), 4, torch.empty(1, 3, 256, 256), global_batch=1, top=5, device="h100")
    assert long[0].mesh.cp > 1, long.table()
    short = autosplit.search(long_vit(64), 4, torch.empty(1, 3, 64, 64), global_batch=1, top=5, device="h100")
    assert short[0].mesh.cp == 1, short.table()
    assert any(c.mesh.cp > 1 for c in short)              # considered, and slower
    assert "tp+cp comm" in short.table() and "cp=" in short.table()


@pytest.mark.slow
def test_pruned_cp_search_equals_brute_force():
    """The bounds a cp layout is pruned with before it is rewritten (layout.py ``ContextLayout``: the
    single-device graph's floors split cp * tp ways) never drop a configuration of the top ones."""
    model, x = long_vit(256), torch.empty(1, 3, 256, 256)
    kw = dict(global_batch=2, device="h100", top=3)     # pp, dp and cp meshes: 87 configurations priced
    pruned = autosplit.search(model, 4, x, **kw)
    brute = autosplit.search(model, 4, x, prune=False, **kw)
    assert pruned.pruned > 0 and brute.evaluated > pruned.evaluated
    assert [(c.label, c.step_time, c.memory) for c in pruned] == [(c.label, c.step_time, c.memory) for c in brute]
    assert any(c.mesh.cp > 1 for c in brute)


def test_context_parallel_false_is_the_search_without_cp():
    model, x = long_vit(256), torch.empty(1, 3, 256, 256)
    without = autosplit.search(model, 4, x, global_batch=1, top=3, device="h100", context_parallel=False)
    assert all(c.mesh.cp == 1 for c in without) and "tp+cp comm" not in without.table()
    assert not any(r.mesh.cp > 1 for r in without.rejected)


class _Mlp(torch.nn.Module):
    """No tokens: no attention, no linear over a (B, N, C) activation."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_cp_refusals_are_said_and_inherited():
    """A model without tokens: every cp configuration refused with the rewrite's reason; a layout refused
    once is refused at every b, and so is a layout whose cp and tp are multiples of its."""
    x = torch.empty(1, 32)
    ranked = autosplit.search(_Mlp(), 4, x, global_batch=2, top=3, device="h100", prune=False)
    assert ranked and all(c.mesh.cp == 1 for c in ranked)
    why = [r.why for r in ranked.rejected if r.mesh.cp > 1 and r.kind == "tensor parallel"]
    assert why and all("the graph has no token dim" in w for w in why), why[:2]
    traced = trace_model(_Mlp(), (x,))
    single = LayoutGraph(traced, (x,), 1, "1d", False)
    failures = []
    two, four = (ContextLayout(traced, (x,), cp, 1, get_profile("h100"), None, None, single, failures)
                 for cp in (2, 4))
    assert two.resolve(1) is None and two.refusal(1).startswith("cp=2: the graph has no token dim")
    assert two.resolve(3) is None and two.refusal(3) == two.refusal(1) and len(failures) == 1
    assert four.resolve(1) is None and four.refusal(1) == f"as for cp=2, tp=1 (divisors): {two.refusal(1)}"


def test_mesh_auto_takes_a_cp_candidate(monkeypatch):
    """``parallelize(mesh="auto")``'s arguments: the first candidate's MeshShape with its cp axis, a
    microbatch of its size, its options."""
    from autosplit.runtime.auto_mesh import auto_arguments
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    chosen = auto_arguments(long_vit(256), torch.empty(1, 3, 256, 256), 1, {"device": "h100"}, None)
    mesh = chosen["mesh"]
    assert isinstance(mesh, MeshShape) and mesh.cp > 1 and mesh.size == 4 and mesh.dp == 1
    assert chosen["example_input"].shape == (1, 3, 256, 256) and chosen["num_microbatches"] == 1
    assert chosen["cp_attention"] == "auto" and chosen["tp_mode"] == "1d" and not chosen["sequence_parallel"]


@pytest.mark.slow
def test_autocast_dp_shard_candidates_equal_compile():
    """Under autocast compile prices FSDP's gathers of half-precision copies (passes/stage_bounds.py):
    the search's dp_shard candidates too (they once priced float32 gathers)."""
    model, batch = tp_timm(), 8
    every = autosplit.search(model, 4, X32, global_batch=batch, top=10**6, prune=False, device="h100",
                             autocast=torch.bfloat16, context_parallel=False)
    for shard in ("stage", "layer"):
        _equal_compile(model, next(c for c in every if c.options["dp_shard"] == shard and c.mesh.pp == 2), batch, 32)


@pytest.mark.slow
def test_cli_table_shows_cp(capsys):
    from autosplit.__main__ import main
    assert main(["search", "tests.test_search_cp:long_vit", "--world", "4", "--global-batch", "1", "--top", "3"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line[:1].isdigit()]
    assert len(rows) == 3 and "cp=" in rows[0] and "tp+cp comm" in out


def auto_cp_matches_single_device(batch: int = 1, steps: int = 3, lr: float = 0.1):
    """On every rank of a pool: ``parallelize(mesh="auto")`` with one image per step (the search picks
    cp), SGD steps against one device."""
    from tests.dist_checks import batches, reference_training
    from tests.models import VARIANTS
    torch.manual_seed(0)
    model = VARIANTS["timm_cls"]()
    xs, ys = batches(steps, batch)
    ref_losses, ref_state = reference_training(model, xs, ys, lr)
    pm = autosplit.parallelize(model, mesh="auto", global_batch=batch, device="h100",
                               loss_fn=torch.nn.CrossEntropyLoss())
    opt = torch.optim.SGD(pm.parameters(), lr=lr)
    losses = []
    for x, y in zip(xs, ys):
        losses.append(pm.step(x, y))            # the cp x tp block shares the microbatch (dp = 1)
        opt.step()
        opt.zero_grad()
    state = pm.full_state_dict()
    m = pm.plan.mesh
    return {"loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "param_diff": max((state[k] - ref_state[k]).abs().max().item() for k in ref_state),
            "mesh": (m.pp, m.cp, m.tp, m.dp)}


@pytest.mark.slow
def test_parallelize_auto_with_cp_trains_like_one_device(pool2):
    """Every rank runs the search, which picks cp = 2 for one image per step on 2 ranks, and trains."""
    from tests.models import VARIANTS
    choice = autosplit.search(VARIANTS["timm_cls"](), 2, X32, global_batch=1, device="h100")[0]
    assert choice.mesh.cp == 2
    for r in pool2.run(auto_cp_matches_single_device):
        assert r["mesh"] == (choice.mesh.pp, 2, choice.mesh.tp, choice.mesh.dp)
        assert r["loss_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, r
