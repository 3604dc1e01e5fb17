"""1D tensor parallelism (Megatron layout found from the graph) equals single-device training."""
import pytest

from tests.dist_checks import train_matches_single_device

TOL = 1e-5
MODELS = ["tp_timm", "tp_torchvision", "tp_hand"]


def _assert_equal(results):
    for r in results:
        assert r["loss_diff"] <= TOL and r["param_diff"] <= TOL, r
    assert all(r["losses"] == results[0]["losses"] for r in results), "ranks disagree on the loss"


@pytest.mark.parametrize("name", MODELS + ["tp_swiglu"])
def test_tp2(pool2, name):
    _assert_equal(pool2.run(train_matches_single_device, name, (1, 2, 1), "1f1b", 1))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("mesh", [(1, 4, 1), (2, 2, 1)])
def test_tp_four_ranks(pool4, name, mesh):
    _assert_equal(pool4.run(train_matches_single_device, name, mesh, "1f1b", 1))
