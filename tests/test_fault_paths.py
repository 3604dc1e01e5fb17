"""Failure paths the watchdog once missed (issue 50, item 7): a fault injected on one rank ends every
rank within timeout_s plus a margin, with a message naming the rank and what it was doing.  Each case
runs on a pool of its own, thrown away after: a fault may leave its ranks unusable."""
import pytest

from tests import checks_fault_paths as checks
from tests.dist_pool import Pool

MARGIN_S = 8.0        # spawn-free: the heartbeats' diagnosis (1.5 s at 2 ranks) and a loaded 2-core host


def _on_fresh_pool(fn, *args, expect=None) -> dict:
    pool = Pool(2)
    try:
        return pool.run_raw(fn, *args, timeout=60, expect=expect)
    finally:
        pool.close(force=True)


def _values(out: dict) -> list:
    assert all(ok for ok, _ in out.values()), out
    return [out[r][1] for r in sorted(out)]


def test_ranks_with_different_meshes_fail_before_building_groups():
    """(2, 1, 1) on rank 0, (1, 1, 2) on rank 1: group creation would hang with no message."""
    timeout_s = 20.0
    for r in _values(_on_fresh_pool(checks.meshes_differ, timeout_s)):
        assert r["error"] is not None and r["error"].startswith("AutosplitError: ranks passed different arguments"), r
        assert "rank 1 passed mesh=(pp=1, tp=1, dp=2), rank 0 passed (pp=2, tp=1, dp=1)" in r["error"], r
        assert r["seconds"] < MARGIN_S, r          # at once, not at the deadline


@pytest.mark.slow
def test_a_rank_that_never_calls_parallelize_is_named():
    timeout_s = 3.0
    r0, r1 = _values(_on_fresh_pool(checks.one_rank_skips_parallelize, timeout_s))
    assert r0["error"] is not None and "rank 1 did not reach autosplit.parallelize" in r0["error"], r0
    assert "within timeout_s=3 s, where rank 0 waited" in r0["error"], r0
    assert timeout_s <= r0["seconds"] < timeout_s + MARGIN_S, r0


def test_an_error_in_the_loss_all_reduce_reaches_every_rank():
    timeout_s = 20.0
    r0, r1 = _values(_on_fresh_pool(checks.loss_all_reduce_raises, timeout_s))
    cause = "rank 1 (pp=1, tp=0, dp=0) failed at loss all-reduce: RuntimeError: injected: connection reset by peer"
    assert r1["error"] == "RuntimeError: injected: connection reset by peer", r1      # its own type kept
    assert r0["error"].startswith("RankFailure:") and cause in r0["error"], r0
    for r in (r0, r1):
        assert r["seconds"] < MARGIN_S, r          # at once: not after rank 0's deadline


def test_a_stage_output_of_the_wrong_shape_is_not_sent():
    """Rank 0 raises its own AutosplitError (its type kept); rank 1 learns it, naming rank 0 and 0F0."""
    timeout_s = 20.0
    r0, r1 = _values(_on_fresh_pool(checks.stage_output_shape_changes, timeout_s))
    shapes = ("stage 0 produced outputs of shapes [(1, 16, 32), (1, 16, 32)] for microbatch 0, but the plan's "
              "boundary to stage 1 carries [(1, 17, 32), (1, 17, 32)]")
    assert r0["error"].startswith("AutosplitError: " + shapes), r0
    assert r1["error"].startswith("RankFailure:"), r1
    assert "rank 0 (pp=0, tp=0, dp=0) failed at 0F0: AutosplitError: " + shapes in r1["error"], r1
    for r in (r0, r1):
        assert r["seconds"] < MARGIN_S, r
