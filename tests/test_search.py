"""Strategy search (autosplit/strategy, ``autosplit.search``): exact against compile, sound pruning.

Tiny models only: the searches here take about a second each.
"""
import dataclasses
import random
import re

import pytest
import torch

import autosplit
from autosplit.cost_model import get_profile
from autosplit.cost_model.step_time import predict_plan
from autosplit.passes.partition import balanced_bounds
from autosplit.strategy.cuts import _BLOCK, CutSolver
from autosplit.strategy.layout import LayoutGraph, trace_model

from tests.models import VARIANTS, tp_timm, tp_torchvision

VARIANTS_TIMM = VARIANTS["timm_cls"]

X = torch.empty(1, 3, 32, 32)


def _compiled(model, c, global_batch, device="h100"):
    b = global_batch // c.mesh[2] // c.options["num_microbatches"]
    return autosplit.compile(model, mesh=c.mesh, example_input=torch.empty(b, 3, 32, 32), device=device,
                             **c.options)


@pytest.mark.parametrize("tp,mode,sp,depth", [(1, "1d", False, None), (2, "1d", True, None), (4, "2d", False, None),
                                              (8, "2.5d", False, 2), (8, "3d", False, None)])
@pytest.mark.default_cases('1-1d-False-None', '4-2d-False-None')
def test_rescaled_graph_equals_a_fresh_compile(tp, mode, sp, depth):
    """Shapes and costs extrapolated to microbatch size b are those compile computes tracing at b (and at a
    size seen before, the values ``at`` kept for it)."""
    model = tp_timm()
    graph = LayoutGraph(trace_model(model, (X,)), (X,), tp, mode, sp, tp_depth=depth)
    for b in (4, 12, 4) if tp == 8 else (4, 10, 4):
        graph.at(b)
        extra = {"tp_2d_form": "allgather"} if mode in ("2d", "2.5d") else {}
        plan = autosplit.compile(model, mesh=(1, tp, 1), example_input=torch.empty(b, 3, 32, 32), tp_mode=mode,
                                 sequence_parallel=sp, tp_depth=depth, **extra)
        ours = [(n.name, n.meta["cost"], n.args) for n in graph.nodes]
        theirs = [(n.name, n.meta["cost"], n.args) for n in plan.graph.graph.nodes]
        assert [(a, c) for a, c, _ in ours] == [(a, c) for a, c, _ in theirs]
        assert [c.nbytes for c in graph.cuts] == [c.nbytes for c in autosplit.passes.cut_points.find_cuts(plan.graph)]


def test_cut_solver_is_balanced_bounds():
    rng = random.Random(0)
    for trial in range(150):
        K = rng.randint(1, 25)
        seg = [rng.choice([0.0, 1.0, 2.0, rng.random()]) for _ in range(K)]
        out = [rng.choice([0.0, 0.5, rng.random()]) for _ in range(K)]
        params = [rng.choice([0, 0, 5, 7]) for _ in range(K)] if trial % 2 else None
        solver = CutSolver(seg, out, params)
        for S in rng.sample(range(1, K + 1), min(K, 4)):
            assert solver.bounds(S) == balanced_bounds(seg, out, S, seg_params=params)
    # tables wider than a block of the solver's columns (cuts.py _BLOCK): the ~440 segments of a 48-block ViT
    for trial, K in enumerate((_BLOCK + 1, 2 * _BLOCK + 37)):
        seg = [rng.choice([0.0, 1.0, 2.0, rng.random()]) for _ in range(K)]
        out = [rng.choice([0.0, 0.5, rng.random()]) for _ in range(K)]
        params = [rng.choice([0, 0, 5, 7]) for _ in range(K)] if trial % 2 else None
        solver = CutSolver(seg, out, params)
        for S in (2, 7, K - 1, K):
            assert solver.bounds(S) == balanced_bounds(seg, out, S, seg_params=params)


def _measured_cpu():
    """A measured CPU profile: per-class compute fits, collective fits, a host shared by 8 ranks and a
    posting cost per transfer group."""
    import dataclasses
    from tests.test_measured_profile import CPU
    return dataclasses.replace(CPU, sharing=(1.0, 1.2, 1.6, 2.1, 2.5, 3.0, 3.4, 3.9), p2p_post=4e-4,
                               p2p_wake=3e-4)


@pytest.mark.parametrize("world,budget,measured", [(4, None, False), (8, 400_000, False), (4, None, True)])
@pytest.mark.default_cases('4-None-False')
def test_pruned_search_equals_brute_force(world, budget, measured):
    model = tp_timm()
    kw = dict(global_batch=32, device=_measured_cpu() if measured else "h100", memory_budget=budget, top=8)
    pruned = autosplit.search(model, world, X, **kw)
    brute = autosplit.search(model, world, X, prune=False, **kw)
    assert pruned.pruned > 0 and brute.pruned == 0 and brute.evaluated > pruned.evaluated
    assert [(c.label, c.step_time, c.memory) for c in pruned] == [(c.label, c.step_time, c.memory) for c in brute]
    if budget is not None:
        assert any(r.kind == "memory" for r in brute.rejected)


@pytest.mark.parametrize("measured", [False, True, "nodes"])
@pytest.mark.slow       # (17 s; the default tier keeps test_search_cp's and test_step_pricing's search = compile checks)
def test_predictions_equal_compile(measured):
    """Every candidate's step time, memory and cut are what compile + predict_plan give (top 3 and a
    sample), with a datasheet profile, with a measured one (per-class fits, sharing, posting: the search once
    priced ops by the roofline while compile used the class fits), and on nodes of 2 GPUs (tp, dp and pipeline
    transfers across nodes priced over the network, in the search as in compile)."""
    model, batch = tp_timm(), 32
    device = _measured_cpu() if measured is True else "h100"
    if measured == "nodes":
        device = dataclasses.replace(get_profile("h100"), name="h100_2pernode", gpus_per_node=2)
    every = autosplit.search(model, 8, X, global_batch=batch, memory_budget=400_000, top=10**6, prune=False,
                             device=device, max_tp=None)          # (tp 4 and 8 on nodes of 2 too)
    picks = list(every[:3]) + random.Random(1).sample(list(every[3:]), 12 if not measured else 6)
    picks += [next(c for c in every if c.options["tp_mode"] == mode) for mode in ("2.5d", "3d")]
    for c in picks:
        plan = _compiled(model, c, batch, device)
        pred = predict_plan(plan, device=device)
        assert pred.total == pytest.approx(c.step_time, rel=1e-9), c.label
        assert pred.compute == pytest.approx(c.parts["compute"], rel=1e-9)
        assert (pred.tp_comm, pred.pp_comm, pred.dp_comm) == pytest.approx(
            (c.parts["tp_comm"], c.parts["pp_comm"], c.parts["dp_comm"]), rel=1e-9, abs=1e-15)
        assert tuple(plan.bounds) == c.bounds
        ranks = [sum(plan.stages[s].memory_bytes for s in plan.placement.stages(r)) for r in range(c.mesh[0])]
        assert max(ranks) == c.memory <= 400_000


@pytest.mark.slow      # 7 s; a rejection's reason is checked in the default tier too (the one-row BatchNorm case)
def test_rejections_say_why():
    model = tp_torchvision()                  # 4 heads
    result = autosplit.search(model, 8, X, global_batch=20, memory_budget=300_000, top=3)
    why = {r.kind: r.why for r in result.rejected}
    # tp=8 plans (the 4 heads' attention whole, its reason in the plan's summary); the grid modes refuse
    # rows their split does not divide (2D over q, 3D over q * q)
    grid = {r.why for r in result.rejected if r.kind == "tensor parallel"}
    assert "microbatch rows 5 % 2 != 0 (2d splits rows 2 ways)" in grid, grid
    assert "microbatch rows 5 % 4 != 0 (3d splits rows 4 ways)" in grid, grid
    assert "global_batch(20) % dp(8) = 4" in why["batch"]
    assert "dp_shard" in why["schedule"] and "memory" in why
    assert all(c.memory <= 300_000 for c in result)
    table = result.table()
    assert "rejected" in table and "tensor parallel" in table and result[0].label in table


def test_bad_arguments_are_refused():
    with pytest.raises(autosplit.AutosplitError, match="global_batch"):
        autosplit.search(tp_timm(), 4, X, global_batch=0)
    with pytest.raises(autosplit.AutosplitError, match="world_size"):
        autosplit.search(tp_timm(), 2.5, X, global_batch=8)


def test_max_tp_leaves_out_wider_tensor_parallelism():
    """max_tp caps the tp degree (a cp layout's tp inside its cp ranks): "node" (the default) at the
    profile's gpus_per_node, an int at itself, None nowhere; what it leaves out is listed with the
    arithmetic, and what it keeps is priced and ranked as without the cap."""
    model = tp_timm()
    one = dataclasses.replace(get_profile("h100"), name="h100_1pernode", gpus_per_node=1)
    kw = dict(global_batch=16, top=10**6, prune=False)
    capped = autosplit.search(model, 2, X, device=one, **kw)
    every = autosplit.search(model, 2, X, device=one, max_tp=None, **kw)
    assert {c.mesh.tp for c in capped} == {1} and {c.mesh.tp for c in every} == {1, 2}
    assert any(c.mesh.cp > 1 for c in capped)
    assert [(c.label, c.step_time) for c in capped] == [(c.label, c.step_time) for c in every if c.mesh.tp == 1]
    why = {r.why for r in capped.rejected if r.kind == "max_tp"}
    assert why == {"tp(2) > max_tp(1) = gpus_per_node of 'h100_1pernode': tensor parallelism stays inside a node "
                   "(search's max_tp)"}
    assert not any(r.kind == "max_tp" for r in every.rejected)
    explicit = autosplit.search(model, 2, X, device="h100", max_tp=1, **kw)         # (8 per node)
    assert {c.mesh.tp for c in explicit} == {1}
    assert {r.why for r in explicit.rejected if r.kind == "max_tp"} == {"tp(2) > max_tp(1)"}
    for bad in (0, "all", True, 2.0):
        with pytest.raises(autosplit.AutosplitError, match=r"max_tp=.*expected \"node\", a positive int or None"):
            autosplit.search(model, 2, X, global_batch=16, max_tp=bad)


def test_cli_prints_the_table(capsys):
    from autosplit.__main__ import main
    assert main(["search", "tests.models:tp_timm", "--world", "4", "--global-batch", "16", "--memory-budget", "400KB",
                 "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "autosplit search" in out and "step ms" in out and "rejected" in out
    assert len([line for line in out.splitlines() if line[:1].isdigit()]) == 3
    assert main(["search", "tests.models:tp_timm", "--world", "4", "--global-batch", "16", "--max-tp", "1"]) == 0
    rows = [line.split()[1] for line in capsys.readouterr().out.splitlines() if line[:1].isdigit()]
    tps = [re.fullmatch(r"\((?:pp=\d+,cp=\d+,tp=(\d+),dp=\d+|\d+,(\d+),\d+)\)", row).groups() for row in rows]
    assert tps and all("1" in t for t in tps), rows
    with pytest.raises(SystemExit):
        main(["search", "tests.models:tp_timm", "--world", "4", "--global-batch", "16", "--max-tp", "0"])


def test_parallelize_auto_trains_like_one_device(pool2):
    """Every rank runs the same search and picks its first candidate; training equals one device."""
    from tests.checks_search import auto_mesh_errors, auto_mesh_matches_single_device
    out = pool2.run(auto_mesh_matches_single_device)
    choice = autosplit.search(VARIANTS_TIMM(), 2, X, global_batch=8, device="h100")[0]
    for rank, r in enumerate(out):
        assert r["loss_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, r
        assert r["mesh"] == choice.mesh and r["m"] == choice.options["num_microbatches"]
        assert r["schedule"] == choice.options["schedule"]
        assert len(r["logged"]) == (1 if rank == 0 else 0)
    errors = pool2.run(auto_mesh_errors)
    for e in errors:
        assert "mesh='auto' needs global_batch" in e[0] and "on CPU needs device=" in e[1]


def test_cli_plans_with_the_measured_profile_fitted_to_the_model(capsys, tmp_path, monkeypatch):
    """--device measured reads this machine's cached profile for --world ranks; --fit rescales it to the
    model; without a cached profile the error says how to measure one."""
    from autosplit.__main__ import main
    from autosplit.cost_model import profile_cache
    monkeypatch.setenv("AUTOSPLIT_PROFILE_DIR", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    try:
        args = ["search", "tests.models:tp_timm", "--world", "2", "--global-batch", "8", "--top", "2",
                "--device", "measured"]
        assert main(args) == 2
        assert "python -m autosplit profile --ranks 2 --threads 1" in capsys.readouterr().err
        torch.set_num_threads(1)
        profile_cache.save(profile_cache.machine_key("cpu", 2), _measured_cpu())
        assert main(args + ["--fit"]) == 0
        out = capsys.readouterr().out
        assert "cpu (test), fitted to the model at microbatch 2 and 8" in out and "step ms" in out
        assert main(["search", "tests.models:tp_timm", "--world", "2", "--global-batch", "8", "--fit"]) == 2
        assert "--fit rescales a measured profile" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)


def test_batch_norm_over_features_is_searched_without_one_row_microbatches():
    """A BatchNorm1d over (B, C) features refuses one row in training mode: the search traces at 2 rows
    and rejects candidates whose microbatch would have one, naming the layer and its values per channel,
    instead of failing the whole search."""
    from tests.models_bn import LeViTLike
    ranked = autosplit.search(LeViTLike(), 4, X, global_batch=8, device="h100", top=50)
    assert ranked and all(8 // c.mesh[2] // c.options["num_microbatches"] >= 2 for c in ranked)
    why = [r.why for r in ranked.rejected if r.why.startswith("microbatch rows 1 < 2: ")]
    assert why and all("head_bn (BatchNorm1d, batch statistics in training mode) sees 1 value per channel per "
                       "row (2 at 2 rows)" in w for w in why), why[:1]


def test_batch_norm_2d_keeps_one_row_microbatches():
    """A BatchNorm2d sees H*W values per channel in one row: a model with only those (XCiT-like) is
    searched with 1-row microbatches too."""
    from tests.models_bn import XCiTLike
    ranked = autosplit.search(XCiTLike(), 4, X, global_batch=4, device="h100", top=50)
    assert any(4 // c.mesh[2] // c.options["num_microbatches"] == 1 for c in ranked), ranked.table()
    assert not [r.why for r in ranked.rejected if "rows" in r.why and "<" in r.why]


@pytest.mark.parametrize("family", ["tp_timm", "tp_torchvision", "eva02"])
@pytest.mark.default_cases('tp_timm')
def test_compute_floors_bound_every_layout(family):
    """The floors the search prunes with (strategy/floors.py): a built layout's equals the compute compile
    prices (its nodes' roofline times, without recomputation and collectives); a grid layout's, taken
    from the single-device graph before the rewrite, stays under the compute of the rewritten graph."""
    import timm
    from autosplit.strategy.costing import _node_parts
    from autosplit.strategy.layout import DeferredLayout
    models = {"tp_timm": tp_timm, "tp_torchvision": tp_torchvision,
              "eva02": lambda: timm.create_model("eva02_tiny_patch14_224", pretrained=False, img_size=32,
                                                 patch_size=4, embed_dim=64, depth=2, num_heads=4)}
    model = models[family]()
    profile = get_profile("h100")
    traced = trace_model(model, (X,))
    single = LayoutGraph(traced, (X,), 1, "1d", False, profile)
    for tp, mode, depth in [(1, "1d", None), (2, "1d", None), (4, "2d", None), (8, "2.5d", 2), (8, "3d", None)]:
        build = lambda: LayoutGraph(traced, (X,), tp, mode, False, profile, tp_depth=depth)  # noqa: E731
        graph = build()
        deferred = DeferredLayout(build, tp, graph.unit, single) if graph.unit > 1 else None
        for b in (graph.unit, 2 * graph.unit, 5 * graph.unit):
            graph.at(b)
            parts = _node_parts(graph, b, profile)
            compute = float(parts[:, :2].sum())
            floor = graph.floors(b, profile)[0]
            assert floor == pytest.approx(compute, rel=1e-9), (tp, mode, b)
            if deferred is not None:
                assert deferred.floors(b, profile)[0] <= compute * (1 + 1e-9), (tp, mode, b)
                assert deferred.floors(b, profile)[0] > single.floors(b, profile)[0] / tp   # tighter than 1/tp
