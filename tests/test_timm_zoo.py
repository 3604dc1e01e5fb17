"""Sixteen ViT-family architectures nobody on this project wrote (tests/models_zoo.py, built tiny): each plans
at (2,1,1) and (1,2,1), and at (1,4,1) with tp_mode="2d" plans or is refused with a PlanError naming the
node and the module; every one that plans trains equal to one device in real gloo worlds (issue 33).

Terms:
  reference -- single-device SGD training of the same model on the same batches (tests/checks_zoo.py);
               for the BatchNorm models (xcit, levit: batch statistics in training mode) gradient
               accumulation over the same 2 microbatches, each forwarded separately (GPipe's semantics).
  TOL       -- fp32 tolerance on losses and on every entry of the state dict (parameters and buffers,
               BatchNorm running statistics included) after 3 steps; measured up to 5e-7.
"""
import re

import pytest
import torch

import autosplit
from autosplit.errors import REPORT, AutosplitError, PlanError
from tests import checks_zoo as C
from tests.models_zoo import IMAGE, ZOO, build

TOL = 1e-5
NAMES = list(ZOO)
# The default tier's part of the zoo (the heavy tier runs all sixteen): the plainest, a bias made by cat
# with a relative position bias (beit), BatchNorm and attention over channels (xcit).
DEFAULT_ZOO = ("vit", "beit", "xcit")
_TRAINED: dict = {}       # (mesh, tp_mode, names) -> per-rank results of C.train_zoo: one pool task each


def _compile(name: str, mesh, tp_mode: str):
    model = build(name)
    x = torch.randn(C.BATCH // C.MICROBATCHES, 3, IMAGE[name], IMAGE[name])
    return model, autosplit.compile(model, mesh=mesh, example_input=x, tp_mode=tp_mode, device="cpu",
                                    num_microbatches=C.MICROBATCHES)


@pytest.mark.parametrize("mesh", [(2, 1, 1), (1, 2, 1)])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.default_cases(*(f"{name}-{mesh}" for name in DEFAULT_ZOO for mesh in ("mesh0", "mesh1")))
def test_plans_1d(name, mesh):
    """Every model plans under a pipeline of 2 and 1D tensor parallelism of 2, and the ranks' modules
    hold every parameter of the model (pp: each in one stage; tp: a shard or a copy on each rank)."""
    model, plan = _compile(name, mesh, "1d")
    want = {n for n, _ in model.named_parameters()}
    pp, tp = mesh[0], mesh[1]
    assert plan.n_stages == pp
    for t in range(tp):
        held = [n for r in range(pp) for m in plan.stage_modules(r, t) for n, _ in m.named_parameters()]
        assert sorted(held) == sorted(want), (t, set(want) ^ set(held))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.default_cases(*DEFAULT_ZOO)
def test_2d_plans_or_refuses_naming_node_and_module(name):
    """tp_mode="2d" at (1,4,1): a plan whose ranks hold every parameter, or a PlanError (not another
    kind of error) that names the node it cannot split and a module of the model it sits in."""
    try:
        model, plan = _compile(name, (1, 4, 1), "2d")
    except AutosplitError as exc:
        msg = str(exc)
        assert isinstance(exc, PlanError), f"refused with {type(exc).__name__}, not PlanError: {msg}"
        assert REPORT not in msg, f"an autosplit bug, not a refusal: {msg}"
        assert "2D tensor parallelism cannot split it" in msg, msg
        model = build(name)
        # a submodule's path, or the model itself: "<root>" (autosplit/errors.py) or its class name
        modules = {p for p, _ in model.named_modules() if p} | {"<root>"}
        assert re.search(r"node '\w+'", msg), msg
        assert set(re.findall(r"'([^']+)'", msg)) & modules or type(model).__name__ in msg, \
            f"names no module of {type(model).__name__}: {msg}"
        return
    want = sorted(n for n, _ in model.named_parameters())
    for t in range(4):
        assert sorted(n for m in plan.stage_modules(0, t) for n, _ in m.named_parameters()) == want, t
    assert plan.tp_plan.sharded, "2D plan splits no parameter"


def _trained(request, mesh, tp_mode, names=tuple(NAMES), **kw):
    """Every model of ``names`` trained on ``mesh`` in one pool task, run by the first test that asks; a
    failure of the task itself is kept too, so that the other models' tests fail at once instead of
    running it again (after a timeout, on a pool that was killed)."""
    key = (mesh, tp_mode, tuple(names))
    if key not in _TRAINED:
        pool = request.getfixturevalue(f"pool{mesh[0] * mesh[1] * mesh[2]}")
        try:
            _TRAINED[key] = pool.run(C.train_zoo, list(names), mesh, tp_mode, timeout=400, **kw)
        except Exception as exc:
            _TRAINED[key] = exc
    if isinstance(_TRAINED[key], Exception):
        raise _TRAINED[key]
    return _TRAINED[key]


def _check(results, name):
    for rank, per_model in enumerate(results):
        r = per_model[name]
        assert "error" not in r and "refused" not in r, (rank, r)
        assert r["loss_diff"] <= TOL and r["param_diff"] <= TOL, (rank, r)


@pytest.mark.parametrize("mesh", [(2, 1, 1), (1, 2, 1)])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.default_cases(*(f"{name}-mesh1" for name in DEFAULT_ZOO))   # tp=2; pp=2 and the rest are slow
def test_trains_like_one_device(request, name, mesh):
    """3 SGD steps, 2 microbatches of 4 rows: losses and state dict equal to the reference.  The default
    tier's cases train only DEFAULT_ZOO (one task), the slow ones all sixteen (one task per mesh)."""
    names = NAMES if request.node.get_closest_marker("slow") else DEFAULT_ZOO
    _check(_trained(request, mesh, "1d", names), name)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow
def test_2d_trains_like_one_device(request, name):
    """(1,4,1) tp_mode="2d": every model that plans trains equal to the reference; one that
    parallelize refuses must be one that offline planning refuses too (the refusal itself is judged by
    test_2d_plans_or_refuses_naming_node_and_module)."""
    results = _trained(request, (1, 4, 1), "2d")
    if "refused" in results[0][name]:
        with pytest.raises(AutosplitError):
            _compile(name, (1, 4, 1), "2d")
        pytest.skip(f"refused at planning: {results[0][name]['refused'][:200]}")
    _check(results, name)


# 2.5D and 3D on 8 ranks: each mode on a part of the zoo (all sixteen train like one device in both
# modes, docs/benchmarks.md; the suite keeps the parts that differ most: a bias made by cat (beit, whose
# v_bias gradient was wrong under 3D before lower.py's copy), talking heads (cait), BatchNorm (xcit,
# levit), relative positions (vit_relpos)).
GRID_ZOO = {"3d": ("beit", "cait", "xcit"), "2.5d": ("vit_relpos", "levit")}
GRID_KW = {"3d": {}, "2.5d": {"tp_depth": 2}}


@pytest.mark.parametrize("mode,name", [(m, n) for m, names in GRID_ZOO.items() for n in names])
@pytest.mark.world8
def test_grid_modes_train_like_one_device(request, mode, name):
    """(1,8,1) tp_mode="3d" (2x2x2) and "2.5d" (tp_depth=2): 3 SGD steps equal to the reference."""
    _check(_trained(request, (1, 8, 1), mode, GRID_ZOO[mode], **GRID_KW[mode]), name)
