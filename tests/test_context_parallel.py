"""Context parallelism: tokens split over the cp axis for every op, attention included, trained equal to
one device (issue 52).

Models: "tp_hand" (tests/models.py: ``q @ k^T`` and ``attn @ v`` written out, 16 tokens), "tp_timm" (SDPA
and a class token: 17 tokens, padded on every cp), and the zoo's families (tests/models_zoo.py) with their
own attention arithmetic.
"""
import math

import pytest
import torch

import autosplit
from autosplit.errors import AutosplitError

from tests.checks_numerics import tp_dropout_masks
from tests.dist_checks import features, train_matches_single_device
from tests.checks_zoo import train_zoo
from tests.models import VARIANTS
from tests.models_zoo import ZOO, build

TOL = 1e-5


TRAIN = train_matches_single_device      # (name, mesh, schedule, chunks per rank, ...) on every rank


def _assert_equal(results, axes):
    for r in results:
        assert all(math.isfinite(v) for v in r["losses"]) and r["loss_diff"] <= TOL and r["param_diff"] <= TOL, r
        assert r["tp_axes"] == axes, r
    assert all(r["losses"] == results[0]["losses"] for r in results), "ranks disagree on the loss"


@pytest.mark.parametrize("name", ["tp_hand", "tp_timm"])
@pytest.mark.default_cases("tp_timm")
def test_cp2_trains_like_one_device(pool2, name):
    results = pool2.run(TRAIN, name, {"cp": 2}, "1f1b", 1)
    _assert_equal(results, ["cp"])
    assert sorted(r["cp"] for r in results) == [(0, 2), (1, 2)]


@pytest.mark.slow      # a further cp (padding on every cp is in the default tier at cp = 2)
@pytest.mark.parametrize("name", ["tp_hand", "tp_timm"])
def test_cp4_trains_like_one_device(pool4, name):
    """17 tokens on 4 ranks: the last rank holds 2 real rows and 3 padding rows."""
    _assert_equal(pool4.run(TRAIN, name, {"cp": 4}, "1f1b", 1), ["cp"])


@pytest.mark.parametrize("name", ["tp_hand", "tp_timm"])
@pytest.mark.default_cases("tp_hand")
def test_cp2_tp2_trains_like_one_device(pool4, name):
    """cp outermost, 1D tensor parallelism inside it: heads over tp_1d, the query tokens over cp."""
    results = pool4.run(TRAIN, name, {"cp": 2, "tp": 2}, "1f1b", 1)
    _assert_equal(results, ["cp", "tp_1d"])
    assert sorted((r["cp"], r["tp"]) for r in results) == [((c, 2), (t, 2)) for c in range(2) for t in range(2)]


def test_cp2_with_a_1f1b_pipeline(pool4):
    _assert_equal(pool4.run(TRAIN, "tp_timm", {"pp": 2, "cp": 2}, "1f1b", 1, microbatches=4), ["cp"])


def test_cp2_with_data_parallelism(pool4):
    """The gradient buckets span dp x cp: each cp rank's part summed, averaged over dp."""
    _assert_equal(pool4.run(TRAIN, "tp_hand", {"cp": 2, "dp": 2}, "1f1b", 1), ["cp"])


@pytest.mark.parametrize("name,unit", [("tp_timm", "layer"), ("tp_hand", "stage"), ("tp_hand", "layer"),
                                       ("tp_timm", "stage")])
@pytest.mark.default_cases("tp_hand-stage")
def test_cp2_with_fsdp(pool4, name, unit):
    """FSDP2 shards over dp x cp, in units of a layer or of the whole stage.  A unit all-gathers its
    parameters as one flat buffer in their registration order, which every rank of dp x cp must share;
    block rank 0's stage module listed them in the model's order, the others in the graph's, and under
    one unit per stage the hand-written ViT's forward came out wrong (0.06 off) before plan.py
    ``same_order``."""
    _assert_equal(pool4.run(TRAIN, name, {"cp": 2, "dp": 2}, "1f1b", 1, dp_shard=unit), ["cp"])


def test_every_block_rank_lists_its_stage_tensors_in_one_order():
    x = torch.randn(2, 3, 32, 32)
    for name, mesh in (("tp_hand", {"cp": 2}), ("tp_timm", {"cp": 2, "tp": 2})):
        plan = autosplit.compile(VARIANTS[name](), mesh=mesh, example_input=x)
        orders = {tuple(n for n, _ in plan.stage_modules(0, t)[0].named_parameters()) for t in range(plan.mesh.block)}
        assert len(orders) == 1, (name, orders)


OWN_ATTENTION = ["vit", "beit", "eva02", "samvit"]   # class token; relative-position bias; rotary; windows


def _zoo_equal(results, names):
    for rank, per_model in enumerate(results):
        for name in names:
            r = per_model[name]
            assert "error" not in r and "refused" not in r, (rank, name, r)
            assert r["loss_diff"] <= TOL and r["param_diff"] <= TOL, (rank, name, r)


def test_families_with_their_own_attention_arithmetic_train_like_one_device(pool2):
    """timm's ViT (class token: 17 tokens padded on 2 ranks), beit (a relative-position bias table added
    to the logits), eva02 (rotary embedding on the tokens after the prefix), samvit (windowed blocks
    padded to the window, a global block with decomposed relative position): cp=2, 3 SGD steps."""
    _zoo_equal(pool2.run(train_zoo, OWN_ATTENTION, {"cp": 2}, timeout=400), OWN_ATTENTION)


def test_windows_inside_one_rank_need_no_communication():
    """samvit at 64 px, one image per microbatch: 2 rows of 4 x 4 windows, no padding.  The window
    partition (``F.pad`` by zeros, views, a permute) keeps the rows of windows split over cp, so each rank
    attends within its own windows, with no collective inside the windowed block; the global block's
    decomposed relative position (two einsums) runs on each rank's query rows.  Before pad and einsum had
    rules, both were gathered whole around every windowed block."""
    plan = autosplit.compile(build("samvit_windows"), mesh={"cp": 2}, example_input=torch.randn(1, 3, 64, 64),
                             num_microbatches=1)
    graph = plan.stage_modules(0, 1)[0].graph
    moves = [n for n in graph.nodes if n.op == "call_function" and getattr(n.target, "__name__", "").endswith(
        ("gather", "all_to_all", "reduce_scatter", "all_reduce"))]
    assert moves and not [n for n in moves if "blocks.0" in str(n.meta.get("module_path", ""))], \
        [(n.name, n.meta.get("module_path")) for n in moves]
    lines = plan.summary().splitlines()
    assert "no communication" in next(line for line in lines if line.startswith("  blocks.0.attn"))
    assert "no communication" not in next(line for line in lines if line.startswith("  blocks.1.attn"))
    assert not [line for line in lines if "einsum" in line and "no sharding rule" in line]


@pytest.mark.slow
def test_windows_inside_one_rank_train_like_one_device(pool2):
    """The plan above (one image per microbatch, 8 per step), cp = 2, 3 SGD steps."""
    results = pool2.run(train_zoo, ["samvit_windows"], {"cp": 2}, num_microbatches=8, timeout=400)
    _zoo_equal(results, ["samvit_windows"])


@pytest.mark.slow
def test_every_zoo_family_trains_like_one_device_cp2(pool2):
    names = sorted(set(ZOO) - set(OWN_ATTENTION))
    _zoo_equal(pool2.run(train_zoo, names, {"cp": 2}, timeout=600), names)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["auto", "all_to_all"])
def test_layouts_under_perturbed_prices_train_like_one_device(pool2, attention):
    """The cp program solved under perturbed prices (tests/checks_layouts.py): the layouts other profiles
    would pick (parameters read sliced, sums scattered onto tokens, moves between heads and tokens) train
    equal to one device too."""
    from tests.checks_layouts import train_perturbed
    names = ["vit", "beit", "eva02", "samvit"]
    for per_seed in pool2.run(train_perturbed, names, [1], {"cp": 2}, "1d", cp_attention=attention, timeout=600):
        _zoo_equal(list(per_seed.values()), names)


def test_the_gradient_sum_over_dp_x_cp_is_priced():
    """The buckets sum each gradient over the dp x cp ranks of a tp coordinate, and FSDP shards over them:
    at cp = 2 the plan prices the sync a dp = 2 plan does (it priced dp alone, so cp's sync looked free),
    at cp = 2, dp = 2 a group of 4, and FSDP's per-rank state is a quarter."""
    x = torch.randn(4, 3, 32, 32)

    def plan(mesh, **kw):
        torch.manual_seed(0)
        return autosplit.compile(VARIANTS["tp_timm"](), mesh=mesh, example_input=x, device="h100", **kw)

    cp, dp, both = (plan(m).predicted_step().dp_comm for m in ({"cp": 2}, {"dp": 2}, {"cp": 2, "dp": 2}))
    assert cp == pytest.approx(dp) and both > 1.5 * dp
    saved = [plan(m).stages[0].memory_bytes - plan(m, dp_shard="layer").stages[0].memory_bytes
             for m in ({"dp": 4}, {"cp": 2, "dp": 2})]       # FSDP's saving: the state over 4 ranks in both
    assert saved[0] > 0 and saved[1] == saved[0]


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, {"dp_shard": "layer"}], ids=["buckets", "fsdp"])
def test_predict_clip_accumulate_load_with_cp(pool4, kw):
    """cp=2, dp=2: predict, the global gradient norm (over dp x cp under FSDP), no_sync accumulation
    (the parts summed once, at the synchronising step), load_full_state_dict, recomputation."""
    for r in pool4.run(features, {"cp": 2, "dp": 2}, **kw):
        assert r["predict"] <= TOL and r["clip_norm"] <= 1e-6 and r["clip_params"] <= TOL, r
        assert r["accumulate"] <= TOL and r["load"] == 0.0, r
        assert r["checkpoint"] <= TOL and r["checkpoint_blocks"] <= TOL, r


def test_mesh_with_a_cp_axis_parses_and_lays_out_the_block_innermost():
    from autosplit.mesh import MeshShape, node_layout_note
    m = MeshShape.parse({"pp": 2, "cp": 2, "tp": 2, "dp": -1}, world_size=16)
    assert (m.pp, m.cp, m.tp, m.dp, m.block, m.size) == (2, 2, 2, 2, 4, 16)
    assert MeshShape.parse("pp=2,cp=2,tp=2,dp=2") == m == MeshShape(pp=2, tp=2, dp=2, cp=2)
    assert MeshShape.parse((2, 2, 1)) == MeshShape(2, 2, 1) and MeshShape.parse((2, 2, 1)).cp == 1
    # rank = ((pp * dp + dp_rank) * cp + cp_rank) * tp + tp_rank: tp innermost, then cp
    c = m.coord_of(m.rank_of(pp=1, tp=3, dp=1))
    assert (c.pp, c.dp, m.cp_of(c.tp), m.tp_of(c.tp)) == (1, 1, 1, 1) and m.rank_of(1, 3, 1) == 15
    assert str(m) == "(pp=2, cp=2, tp=2, dp=2)"
    with pytest.raises(AutosplitError, match=r"pp\(2\) \* cp\(2\) \* tp\(2\) \* dp\(1\) != WORLD_SIZE\(16\)"):
        MeshShape.parse({"pp": 2, "cp": 2, "tp": 2}, world_size=16)
    with pytest.raises(AutosplitError, match="unknown axis 'sp'"):
        MeshShape.parse({"sp": 2})
    with pytest.raises(AutosplitError, match="'axis=size' pairs"):
        MeshShape.parse("pp=1,cp")
    assert "cp*tp=2*4=8 > 4 GPUs per node" in node_layout_note(MeshShape(cp=2, tp=4), 4)


def test_cp_beside_grid_modes_or_sequence_parallelism_is_refused_by_name():
    for kw, what in (({"tp_mode": "2d"}, "tp_mode='2d'"), ({"sequence_parallel": True}, "sequence_parallel=True")):
        with pytest.raises(AutosplitError, match=f"cp=2 splits the tokens of every op.*{what}"):
            autosplit.compile(VARIANTS["tp_hand"](), mesh={"cp": 2, "tp": 4}, example_input=torch.randn(2, 3, 32, 32),
                              **kw)


@pytest.mark.parametrize("name,mesh", [("tp_timm", {"cp": 2}), ("tp_hand", {"cp": 4})], ids=["timm-cp2", "hand-cp4"])
@pytest.mark.default_cases("timm-cp2")
def test_ulysses_all_to_all_trains_like_one_device(request, name, mesh):
    """cp_attention="all_to_all": q, k, v moved from tokens split to heads split by all-to-alls, attention
    on whole sequences, the output moved back (17 tokens padded on every cp)."""
    pool = request.getfixturevalue(f"pool{mesh.get('cp', 1) * mesh.get('tp', 1)}")
    results = pool.run(TRAIN, name, mesh, "1f1b", 1, microbatches=2, cp_attention="all_to_all")
    _assert_equal(results, ["cp"])


# prices under which the engine runs tp_timm's attention projection on heads at 8 rows (tests/checks_layouts.py
# ``perturbed_prices``): the H100 profile's own put it on tokens (an all-to-all back costs less than the sum)
HEADS_PROJECTION_SEED = 2


def _projection_on_heads(mesh):
    """The rank-0 program of tp_timm at 8 rows under HEADS_PROJECTION_SEED: the projection's weight sliced
    over cp, its sum reduce-scattered onto token rows and the bias added after."""
    from tests.checks_layouts import perturbed_prices
    with perturbed_prices(HEADS_PROJECTION_SEED):
        plan = autosplit.compile(VARIANTS["tp_timm"](), mesh=mesh, example_input=torch.randn(8, 3, 32, 32),
                                 num_microbatches=1, device="h100", cp_attention="all_to_all")
    code = str(plan.stage_modules(0, 1)[0].code)
    assert "reduce_scatter + blocks_0_attn_proj_bias" in code, code


@pytest.mark.parametrize("name,attention", [("tp_timm", "all_to_all"), ("timm_cls", "auto")])
@pytest.mark.default_cases("tp_timm-all_to_all")
def test_one_microbatch_per_step_trains_like_one_device(pool2, name, attention):
    """One microbatch of 8 rows, the attention projection run on heads (perturbed prices: its weight
    sliced over cp, its sum reduce-scattered onto token rows) and the bias added to each rank's rows, so
    the bias's gradient is a part per cp rank, the weight's whole.  Trained 0.02 off before the bias was
    counted a part (lower.py ``_bias_on_rows``)."""
    from tests.checks_layouts import train_under_perturbed_prices
    _projection_on_heads({"cp": 2})
    results = pool2.run(train_under_perturbed_prices, HEADS_PROJECTION_SEED, name, {"cp": 2}, "1f1b", 1,
                        microbatches=1, device="h100", cp_attention=attention)
    _assert_equal(results, ["cp"])


@pytest.mark.parametrize("name", ["tp_timm", "tp_hand"])
@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.default_cases("1-tp_timm")
def test_ulysses_beside_tp_trains_like_one_device(pool4, name, microbatches):
    """cp x tp = 2 x 2, cp_attention="all_to_all": tp_1d splits the heads with the weights, the all-to-all
    splits each tp rank's heads over cp (the heads dim nested tp_1d outermost).  Under the perturbed
    prices above the attention projection's sum is partial over both axes (its input split on the heads
    over both): its bias was added after each of the two sums, 0.1 off, before lower.py added it after
    the last only."""
    from tests.checks_layouts import train_under_perturbed_prices
    _projection_on_heads({"cp": 2, "tp": 2})
    results = pool4.run(train_under_perturbed_prices, HEADS_PROJECTION_SEED, name, {"cp": 2, "tp": 2}, "1f1b", 1,
                        microbatches=microbatches, device="h100", cp_attention="all_to_all")
    _assert_equal(results, ["cp", "tp_1d"])


def test_the_cp_rewrite_does_not_depend_on_the_microbatch_count():
    """On cp the runtime sums every gradient with dp's buckets, whole or a part (lower.py *replicated
    axis*), so reading a parameter whole into a token-split op costs no collective there, and tp inside
    cp is priced at one microbatch as the fixed 1D layouts are: the same program at m = 1 and 4.
    Before, the engine charged cp a once-a-step sum per such read (1/m of an all-reduce): tp_timm's rank
    program at cp = 2 differed between m = 1 and m = 4, and the strategy search rewrote every cp layout
    once per microbatch count."""
    from autosplit.passes.sharding.strategies import Enumerator
    x = torch.randn(2, 3, 32, 32)
    for mesh in ({"cp": 2}, {"cp": 2, "tp": 2}):
        codes = {m: str(autosplit.compile(VARIANTS["tp_timm"](), mesh=mesh, example_input=x, num_microbatches=m,
                                          device="h100").stage_modules(0, 1)[0].code) for m in (1, 4)}
        assert codes[1] == codes[4], mesh
    plan = autosplit.compile(VARIANTS["tp_timm"](), mesh={"cp": 2}, example_input=x, device="h100")
    enum = plan.tp_plan.sharding.enum
    assert isinstance(enum, Enumerator) and not enum.split_params
    weight = next(n for n in plan.tp_plan.root.graph.nodes if n.op == "get_attr" and n.target.endswith("qkv.weight"))
    assert enum.transition(weight, "R", "R", None, 1e6, True) == 0.0


def test_the_cost_model_chooses_each_attentions_lowering():
    """"auto" prices both lowerings per attention; "gather" and "all_to_all" force one, and the per-rank
    program shows it (all_gather of the keys, or all_to_all of q, k, v)."""
    x = torch.randn(4, 3, 32, 32)
    code = {mode: str(autosplit.compile(VARIANTS["tp_timm"](), mesh={"cp": 2}, example_input=x, cp_attention=mode)
                      .stage_modules(0, 1)[0].code) for mode in ("gather", "all_to_all")}
    assert "all_to_all(" not in code["gather"] and code["gather"].count("all_gather(") == 4    # k and v, 2 blocks
    assert "all_gather(" not in code["all_to_all"] and code["all_to_all"].count("all_to_all(") == 4
    lines = autosplit.compile(VARIANTS["tp_timm"](), mesh={"cp": 2}, example_input=x).summary().splitlines()
    assert "(the cheaper by the cost model)" in next(line for line in lines if line.startswith("context parallel"))
    assert sum("blocks." in line and ("all-to-all'd" in line or "all-gathered" in line) for line in lines) == 2
    with pytest.raises(AutosplitError, match="cp_attention"):
        autosplit.compile(VARIANTS["tp_timm"](), mesh={"cp": 2}, example_input=x, cp_attention="ring")
    # 4 heads: cp x tp = 2 x 2 divides them (all-to-all), 4 x 2 does not (gather)
    two, four = (str(autosplit.compile(VARIANTS["tp_timm"](), mesh={"cp": c, "tp": 2}, example_input=x,
                                       cp_attention="all_to_all").stage_modules(0, 1)[0].code) for c in (2, 4))
    assert two.count("all_to_all(") == 4 and "all_gather(" not in two
    assert "all_to_all(" not in four and four.count("all_gather(") == 4
    lines = autosplit.compile(VARIANTS["tp_timm"](), mesh={"cp": 4, "tp": 2}, example_input=x,
                              cp_attention="all_to_all").summary().splitlines()
    assert sum("cp x tp = 8 divides none of the head counts" in line for line in lines) == 2   # says why


def test_dropout_masks_differ_across_cp_ranks(pool2):
    """Every dropout on token-split activations draws its own mask on each cp rank (the block rank's
    fork: passes/tp_random.py); the head's dropout, on the whole pooled token, the same everywhere."""
    r0, r1 = pool2.run(tp_dropout_masks, mesh={"cp": 2})
    split = {"pos_drop"} | {f"blocks.{i}.{m}" for i in (0, 1) for m in ("mlp.drop1", "mlp.drop2", "attn.proj_drop")}
    assert set(r0["masks"]) == split | {"head_drop"}
    for name in split:
        a, b = r0["masks"][name], r1["masks"][name]
        assert a.shape == b.shape and (a != b).float().mean() > 0.1, f"{name}: the same mask on both cp ranks"
    assert (r0["masks"]["head_drop"] == r1["masks"]["head_drop"]).all()
    assert (r0["rng"] == r1["rng"]).all()


@pytest.mark.inductor
@pytest.mark.parametrize("attention", ["gather", "all_to_all"])
def test_compiled_stages_with_cp(pool2, attention):
    """torch.compile'd stages (the traceable collectives: all_gather, all_to_all as custom ops)."""
    _assert_equal(pool2.run(TRAIN, "tp_timm", {"cp": 2}, "1f1b", 1, microbatches=2, cp_attention=attention,
                            compile_stages={"backend": "aot_eager"}), ["cp"])
