"""parallelize: pipeline + data-parallel training equals single-device training (real gloo processes)."""
import pytest

from tests.dist_checks import train_matches_single_device

TOL = 1e-5


def _assert_equal(results):
    for r in results:
        assert r["loss_diff"] <= TOL and r["param_diff"] <= TOL, r
    assert all(r["losses"] == results[0]["losses"] for r in results), "ranks disagree on the loss"


@pytest.mark.parametrize("name", ["timm_cls", "torchvision", "hand"])
@pytest.mark.parametrize("mesh", [(2, 1, 1), (1, 1, 2)])
@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_two_ranks_equal_single_device(pool2, name, mesh, schedule, chunks):
    _assert_equal(pool2.run(train_matches_single_device, name, mesh, schedule, chunks))


@pytest.mark.parametrize("name", ["timm_cls", "torchvision", "hand"])
@pytest.mark.parametrize("mesh", [(4, 1, 1), (2, 1, 2)])
@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_four_ranks_equal_single_device(pool4, name, mesh, schedule, chunks):
    _assert_equal(pool4.run(train_matches_single_device, name, mesh, schedule, chunks))
