"""2.5D (Tesseract: tp_depth layers of a q x q grid) and 3D (a q x q x q cube) tensor parallelism, as the
sharding engine's layouts: equal to single-device training in real gloo worlds, with pipelines; plans
that split parameters as the modes promise; clear errors for sizes that do not factor."""
import pytest
import torch

import autosplit
from autosplit.errors import AutosplitError
from tests.dist_checks import train_matches_single_device
from tests.models import VARIANTS

TOL = 1e-5
MODES = {"2.5d": {"tp_mode": "2.5d", "tp_depth": 2}, "3d": {"tp_mode": "3d"}}


def _check(results):
    for r in results:
        assert r["loss_diff"] <= TOL and r["param_diff"] <= TOL, r


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", ["tp_timm", "tp_hand"])
def test_eight_ranks(pool8, mode, name):
    """(1, 8, 1), 3 SGD steps of 2 microbatches of 4 rows (rows split 4 ways: 2.5D d*q, 3D q*q)."""
    _check(pool8.run(train_matches_single_device, name, (1, 8, 1), "1f1b", 1, microbatches=2, **MODES[mode]))
