"""parallelize: pipeline + data-parallel training equals single-device training (real gloo processes)."""
import pytest

from tests.dist_checks import (bad_inputs, bucket_overlap, dying_rank, failing_rank, features, hanging_rank,
                               lazy_plan_then_train, mixed_precision, replay_early_post_order,
                               train_matches_single_device)
from tests import dist_checks
from tests.dist_pool import Pool

TOL = 1e-5


def _assert_equal(results):
    for r in results:
        assert r["loss_diff"] <= TOL and r["param_diff"] <= TOL, r
    assert all(r["losses"] == results[0]["losses"] for r in results), "ranks disagree on the loss"


@pytest.mark.parametrize("name", ["timm_cls", "torchvision", "hand"])
@pytest.mark.parametrize("mesh", [(2, 1, 1), (1, 1, 2)])
@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
@pytest.mark.default_cases('gpipe-1-mesh0-timm_cls', '1f1b-1-mesh1-hand', 'interleaved-2-mesh0-torchvision')
def test_two_ranks_equal_single_device(pool2, name, mesh, schedule, chunks):
    _assert_equal(pool2.run(train_matches_single_device, name, mesh, schedule, chunks))


@pytest.mark.parametrize("name", ["timm_cls", "torchvision", "hand"])
@pytest.mark.parametrize("mesh", [(4, 1, 1), (2, 1, 2)])
@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
@pytest.mark.default_cases('interleaved-2-mesh1-hand')
def test_four_ranks_equal_single_device(pool4, name, mesh, schedule, chunks):
    _assert_equal(pool4.run(train_matches_single_device, name, mesh, schedule, chunks))


@pytest.mark.parametrize("name,mesh", [("timm_cls", (2, 1, 1)), ("tp_timm", (1, 2, 1))])
@pytest.mark.default_cases('tp_timm-mesh1')
def test_lazy_plan_keeps_parameters(pool2, name, mesh):
    _assert_equal(pool2.run(lazy_plan_then_train, name, mesh))


def test_bad_inputs_fail_clearly_on_every_rank(pool2):
    for r in pool2.run(bad_inputs):
        assert "pp(2) * tp(1) * dp(2) != WORLD_SIZE(2)" in r["mesh"]
        assert "batch of 5 rows is not divisible by num_microbatches(2)" in r["indivisible"]
        assert "(4, 3, 32, 32)" in r["shape"] and "plan was built for [((2, 3, 32, 32), 'float32')]" in r["shape"]
        assert "float64" in r["dtype"]
        assert r["ok_after"] > 0


def _on_fresh_pool(fn) -> list:
    """Run fn on a world of 2 that is thrown away after: a failed step leaves its ranks unusable."""
    pool = Pool(2)
    try:
        return pool.run(fn, timeout=60)
    finally:
        pool.close(force=True)


def test_failure_on_one_rank_stops_every_rank():
    """The failing rank raises the user's own exception (type kept, the job's message attached); the
    others stop with a RankFailure carrying the same message."""
    cause = "rank 1 (pp=1, tp=0, dp=0) failed at 1F2: ValueError: injected failure"
    results = _on_fresh_pool(failing_rank)
    assert results[1]["error"] == "ValueError: injected failure" and cause in results[1]["notes"][0], results[1]
    assert results[0]["error"].startswith("RankFailure:") and cause in results[0]["error"], results[0]
    for r in results:
        assert r["seconds"] < 10


@pytest.mark.slow      # 13 s: predict, clipping, accumulation, recompute and load on one pool (the default tier trains
#                         its (2, 1, 2) mesh in test_four_ranks_equal_single_device)
def test_predict_clip_accumulate_checkpoint_load(pool4):
    for r in pool4.run(features):
        assert r["predict"] <= TOL and r["modes"] == [True, True], r
        assert r["clip_norm"] <= 1e-6 and r["clip_params"] <= TOL, r
        assert r["accumulate"] <= TOL, r
        assert r["load"] == 0.0 and "missing keys" in r["load_error"], r
        assert r["checkpoint"] <= TOL and r["checkpoint_blocks"] <= TOL, r


def test_mixed_precision(pool4):
    for r in pool4.run(mixed_precision):
        assert r["bf16"] < 5e-2, r        # bf16 matmuls: close to fp32 training, not equal
        assert r["skipped"] and r["grads_none"] and r["scale_halved"], r


def test_dp_buckets_overlap_the_last_backward(pool2):
    for r in pool2.run(bucket_overlap):
        assert r["buckets"] > 4 and r["early"] >= r["buckets"] - 1, r
        assert r["views"] and r["views_again"] and r["copies"] == 0, r      # gradients live in the buckets


@pytest.mark.slow
def test_a_stalled_rank_times_out_everywhere():
    """Rank 1 sleeps in its loss: rank 0 times out, and names rank 1 and where it is, not itself."""
    results = _on_fresh_pool(hanging_rank)
    for r in results:      # rank 1 learns the same cause when it wakes
        assert "rank 1 (pp=1, tp=0, dp=0) is stalled at 1F0 (busy for " in r["error"], r
        assert "rank 0 (pp=0, tp=0, dp=0) gave up at 0RECV_B0" in r["error"], r
        assert "TimeoutError: no progress for 2 s" in r["error"], r
    assert results[0]["seconds"] < 2 + 5


@pytest.mark.parametrize("victim", [1, 0])
@pytest.mark.slow
def test_a_dead_rank_is_named_by_the_survivors(victim, tmp_path):
    """A rank's process exits mid-step: the survivor names it, or says the store's host died."""
    import time
    stamp = str(tmp_path / "died")
    pool = Pool(2)
    try:
        out = pool.run_raw(dying_rank, victim, stamp, timeout=60, expect=1)
    finally:
        pool.close(force=True)
    (ok, r), = out.values()
    assert ok and r["error"] is not None, r
    if victim == 1:
        assert "rank 1 (pp=1, tp=0, dp=0) died or froze (no heartbeat for 1.5 s" in r["error"], r
        assert "rank 0 (pp=0, tp=0, dp=0) gave up at 0RECV_B0" in r["error"], r
    else:
        assert "the job's store at 127.0.0.1:" in r["error"] and "has probably died" in r["error"], r
    seconds = r["ended"] - float(open(stamp).read())
    assert seconds < 10, seconds
    print(f"victim {victim}: last survivor ended {seconds:.2f} s after the fault")


@pytest.mark.slow       # a fresh pool and a 3 s deadline: over 10 s
def test_strict_transport_hangs_where_nccl_would():
    """Gloo forgives the old early-post order; the strict transport (NCCL's ordering) must not."""
    for rank, r in enumerate(_on_fresh_pool(replay_early_post_order)):
        assert r["gloo"] is None, r
        assert "RankFailure" in r["strict"] and "RECV_" in r["strict"], r
        assert "TimeoutError: no progress for 3 s" in r["strict"], r
        assert r["seconds"] < 3 + 5, r


@pytest.mark.slow
def test_close_releases_groups_and_threads(pool4, tmp_path):
    """A process that builds many ParallelModules keeps nothing of the closed ones: every mesh axis's
    group (1D, 2D grid, strict transport thread, checkpoint group) goes; calls after close say so."""
    configs = [((2, 1, 2), {}), ((1, 2, 2), {"sequence_parallel": True}), ((1, 4, 1), {"tp_mode": "2d"}),
               ((2, 2, 1), {"schedule": "zb-h1"})]
    for rank, r in enumerate(pool4.run(dist_checks.close_releases, configs, str(tmp_path / "ck"))):
        assert all(groups > r["before"][0] for groups, _ in r["opened"]), r
        assert r["after"] == [r["before"]] * len(configs), (r["before"], r["after"])
        assert set(r["errors"]) == {"step", "parameters", "full_state_dict"}, r
        assert all("closed ParallelModule" in e and f"rank {rank} " in e for e in r["errors"].values()), r


@pytest.mark.slow
def test_dropped_module_releases_groups_and_hooks(pool4, tmp_path):
    """A ParallelModule dropped without close() (or whose construction raised) kept its process groups,
    their gloo threads and its bucket hooks on the user's parameters for the life of the process:
    dozens of them in a test worker ate a fifth of a core while idle.  They are released at the next
    parallelize (each build here releases the module dropped before it; the failed one goes with an
    explicit release_orphans, which parallelize calls)."""
    configs = [((2, 1, 2), {}), ((1, 2, 2), {"sequence_parallel": True}), ((1, 4, 1), {"tp_mode": "2d"})]
    for r in pool4.run(dist_checks.dropped_releases, configs, str(tmp_path / "ck")):
        assert "loss_fn" in r["raised"], r["raised"]
        assert r["held"][0] > r["before"][0], r            # the failed one's groups were still there
        assert r["released"] == 1, r        # each parallelize released the module dropped before it
        assert r["after"] == r["before"], (r["before"], r["after"])
        assert r["hooks"] == 0, r


def test_plan_summary_is_logged_on_rank_zero(pool2):
    """The summary goes to logging.getLogger("autosplit") at INFO, on rank 0 only; schedule actions at DEBUG."""
    from tests import dist_checks
    logs = pool2.run(dist_checks.logged_summary)
    assert logs[0][0].startswith("planned:\nautosplit plan: mesh (pp=2, tp=1, dp=1)"), logs
    assert not any(m.startswith("planned:") for m in logs[1])
    # then, at DEBUG, the schedule as each rank runs it (step 1 re-plans for its microbatch: rank 0 logs it)
    for rank, records in enumerate(logs):
        actions = [m.split(": ", 1)[1] for m in records if m.startswith(f"rank {rank}: ")]
        assert f"{rank}F0" in actions and f"{rank}B1" in actions, records
