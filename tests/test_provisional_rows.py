"""A provisional plan (no example_input) under a grid tp mode picks rows the layout allows (issue 50,
item 5).  It used to plan 1 row, which 2D / 2.5D / 3D refuse ("the microbatch has 1 rows, which do
not divide by q(2)") before the user sent a microbatch at all."""
import pytest
import torch

from autosplit.options import PlanOptions
from autosplit.runtime.rank_plan import provisional_rows
from tests.checks_provisional import grid_wrong_rows, grid_without_example
from tests.models import VARIANTS

TOL = 1e-5


@pytest.mark.parametrize("tp_mode,tp,depth,rows", [
    ("1d", 4, None, 1), ("auto", 4, None, 1), ("2d", 4, None, 2), ("2d", 9, None, 3),
    ("2.5d", 8, 2, 4), ("2.5d", 18, 2, 6), ("3d", 8, None, 4), ("3d", 27, None, 9), ("2d", 1, None, 1)])
def test_provisional_rows_follow_the_layout(tp_mode, tp, depth, rows):
    """2D q, 2.5D d * q, 3D q * q: the ways the layout splits a microbatch's rows (tp/axes.py)."""
    options = PlanOptions(tp_mode=tp_mode, tp_depth=depth)
    assert provisional_rows(VARIANTS["tp_timm"](), (3, 32, 32), options, tp) == rows


@pytest.mark.parametrize("tp_mode,tp,rows", [("1d", 1, 2), ("2d", 4, 2), ("2d", 9, 6), ("3d", 27, 18)])
def test_provisional_rows_with_batch_statistics(tp_mode, tp, rows):
    """A BatchNorm1d over (B, C) features needs 2 rows: the provisional rows are the least common
    multiple of that and the layout's ways (3D q * q = 9 gives 18)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    assert provisional_rows(model, (8,), PlanOptions(tp_mode=tp_mode), tp) == rows


@pytest.mark.slow       # the rows: the tests above; 2D training: test_tp2d
def test_2d_without_example_input_trains_like_one_device(pool4):
    for r in pool4.run(grid_without_example, (1, 4, 1), "2d"):
        assert r["loss_diff"] <= TOL and r["param_diff"] <= TOL, r
        assert r["tp_axes"] == ["tp_row", "tp_col"], r


@pytest.mark.slow       # a further case of the provisional 2D plan above
def test_2d_wrong_microbatch_still_refused(pool4):
    for r in pool4.run(grid_wrong_rows, (1, 4, 1), "2d"):
        assert r["provisional"] == [(2, 3, 32, 32)], r
        assert r["wrong"] is not None and "the microbatch has 3 rows, which do not divide by q(2)" in r["wrong"], r
        assert r["ok_after"] > 0, r
