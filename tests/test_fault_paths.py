"""Failure paths the watchdog once missed (issue 50, item 7): a fault injected on one rank ends every
rank within timeout_s plus a margin, with a message naming the rank and what it was doing.  A case whose
fault may leave its ranks unusable (a published failure, a thread stuck for good) runs on a pool of its
own, thrown away after; one that leaves them clean uses pool2; joining before any process group exists
runs in this process (ranks as threads, or the missing rank simply never started)."""
import socket
import threading
import time

import pytest
import torch.distributed as dist

from autosplit.mesh import MeshShape
from autosplit.runtime.faults import heartbeat
from autosplit.runtime.faults.deadlines import RankFailure, Watchdog
from autosplit.runtime.faults.job_store import join_job
from autosplit.runtime.parallel.world import init_world
from tests import checks_fault_paths as checks
from tests.dist_checks import error_of
from tests.dist_pool import Pool

MARGIN_S = 8.0        # spawn-free: the heartbeats' diagnosis (1.5 s at 2 ranks) and a loaded 2-core host


def _on_fresh_pool(fn, *args, expect=None) -> dict:
    pool = Pool(2)
    try:
        return pool.run_raw(fn, *args, timeout=150, expect=expect)   # spawn and import included: a loaded host
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
    assert r0["error"] is not None and "rank 1 did not reach autosplit.parallelize within timeout_s=3 s, " \
        "where rank 0 waited" in r0["error"], r0
    assert timeout_s <= r0["seconds"] < timeout_s + MARGIN_S, r0


@pytest.mark.slow       # a fresh pool; an error on one rank reaching every rank: test_runtime's failure test
def test_an_error_in_the_loss_all_reduce_reaches_every_rank():
    timeout_s = 20.0
    r0, r1 = _values(_on_fresh_pool(checks.loss_all_reduce_raises, timeout_s))
    cause = "rank 1 (pp=1, tp=0, dp=0) failed at loss all-reduce: RuntimeError: injected: connection reset by peer"
    assert r1["error"] == "RuntimeError: injected: connection reset by peer", r1      # its own type kept
    assert r0["error"].startswith("RankFailure:") and cause in r0["error"], r0
    for r in (r0, r1):
        assert r["seconds"] < MARGIN_S, r          # at once: not after rank 0's deadline


@pytest.mark.slow       # a fresh pool; an error on one rank reaching every rank: test_runtime's failure test
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


def test_an_abandoned_parallelize_leaves_the_next_one_working(pool2):
    """Rank 1's call raises before the layout agreement, rank 0's gives up at its deadline; the next call
    of both must meet (the keys of a per-process call counter drifted apart: rank 0 then waited for a key
    rank 1 never wrote while rank 1 went on to build groups alone)."""
    timeout_s = 1.0
    r0, r1 = pool2.run(checks.abandoned_call_then_good_one, timeout_s, timeout=120)
    assert r1["first"]["error"].startswith("AutosplitError: pp(2) * tp(1) * dp(2) != WORLD_SIZE(2)"), r1
    assert r0["first"]["error"].startswith("AutosplitError: rank 1 did not reach autosplit.parallelize within "
                                           "timeout_s=1 s, where rank 0 waited"), r0
    assert timeout_s <= r0["first"]["seconds"] < timeout_s + MARGIN_S, r0
    for r in (r0, r1):
        assert r["second"]["error"] is None, r


def test_a_blocking_call_runs_under_the_deadline_as_busy():
    """Watchdog.blocking: the result comes back; while the call runs the heartbeat says busy at its action
    (a peer's diagnosis then names this rank as stalled there); a call that never returns ends at the
    deadline blaming this rank, not at the next wait (there may be none) or never."""
    store = dist.HashStore()
    watchdog = Watchdog(store, 1, MeshShape(2, 1, 1), 0.5)
    never, seen = threading.Event(), []
    try:
        assert watchdog.blocking(lambda: 7, "parameter checksums") == 7

        def stuck():
            seen.append((watchdog.beat.doing, watchdog.beat.waiting))
            never.wait()
        start = time.monotonic()
        with pytest.raises(RankFailure) as info:
            watchdog.blocking(stuck, "parameter checksums")
        assert seen == [("parameter checksums", False)], seen
        assert str(info.value) == ("rank 1 (pp=1, tp=0, dp=0) failed at parameter checksums: TimeoutError: not "
                                   "finished after 0.5 s (set AUTOSPLIT_TIMEOUT or timeout_s to change)")
        assert 0.5 <= time.monotonic() - start < 0.5 + MARGIN_S
    finally:
        never.set()
        heartbeat._BEATS.pop(id(store)).stop()


@pytest.mark.slow       # a fresh pool; a deadline that ends every rank: test_an_abandoned_parallelize's
def test_a_stuck_checksum_ends_every_rank():
    """The parameter checksums before the first step block the host on a GPU; a rank stuck there must stop
    at its deadline and its peer name it, with the action (it blocked for good, its peer blamed no one)."""
    timeout_s = 3.0
    r0, r1 = _values(_on_fresh_pool(checks.checksums_never_finish, timeout_s))
    for r in (r0, r1):
        assert r["error"].startswith("RankFailure:"), r
        assert "rank 1 (pp=1, tp=0, dp=0)" in r["error"] and "parameter checksums" in r["error"], r
        assert r["seconds"] < timeout_s + MARGIN_S, r


@pytest.mark.slow
def test_a_pp_group_start_that_fails_ends_every_rank():
    """NCCL's first collective on the pp group blocks inside the call until every rank joins (modelled):
    rank 1's fails there, and rank 0, inside its own, must stop at once naming rank 1 and the action."""
    r0, r1 = _values(_on_fresh_pool(checks.pp_group_start_fails, 20.0))
    cause = "rank 1 (pp=1, tp=0, dp=0) failed at pp group start: RuntimeError: injected: NCCL error"
    assert r1["error"].startswith("RankFailure: " + cause), r1
    assert r0["error"].startswith("RankFailure: rank 0 (pp=0, tp=0, dp=0) stopped: " + cause), r0
    for r in (r0, r1):
        assert r["seconds"] < MARGIN_S, r              # at once, not at the deadline


def _launch(monkeypatch, rank: int, size: int) -> int:
    """torchrun's environment for ``rank`` of ``size`` on a free local port; no process group yet."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(RANK=rank, WORLD_SIZE=size, MASTER_ADDR="127.0.0.1", MASTER_PORT=port).items():
        monkeypatch.setenv(key, str(value))
    assert not dist.is_initialized()
    return port


@pytest.mark.parametrize("rank,missing", [(0, "rank 1 did not join the job's store at 127.0.0.1:{port} "
                                                "(autosplit.parallelize starts the process group) within "
                                                "timeout_s=1 s, where rank 0 waited"),
                                          (1, "rank 1 could not reach the job's store at 127.0.0.1:{port} "
                                              "within timeout_s=1 s (ConnectionRefusedError")])
def test_a_rank_that_never_joins_is_named_within_timeout_s(monkeypatch, rank, missing):
    """autosplit starts the process group (no default group yet) and the other rank of 2 never starts:
    this one must give up at timeout_s naming it, not wait torch's store timeout (timeout_s + 31.5 s here)
    and count the clients that joined ("1/2 clients joined"), or retry its connection for as long."""
    port = _launch(monkeypatch, rank, 2)
    start = time.monotonic()
    err = error_of(init_world, (2, 1, 1), 1.0)
    seconds = time.monotonic() - start
    assert err is not None and err.startswith("AutosplitError: " + missing.format(port=port)), err
    if rank == 1:
        assert "rank 0's process hosts it, so rank 0 has not joined" in err, err
    assert 1.0 <= seconds < 1.0 + MARGIN_S, seconds
    assert not dist.is_initialized()


def test_ranks_that_joined_name_the_rank_that_did_not(monkeypatch):
    """Ranks 0 and 1 of 3 join, rank 2 never does: both stop at timeout_s, each naming rank 2 and those that
    joined; then a second attempt of all three (after rank 2's late start) joins, in the same process."""
    _launch(monkeypatch, 0, 3)
    out = {}

    def join(rank, arguments):
        start = time.monotonic()
        out[rank] = (error_of(join_job, rank, 3, arguments, 1.0, 60.0), time.monotonic() - start)

    def all_join(ranks, arguments):
        threads = [threading.Thread(target=join, args=(r, arguments)) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    all_join((0, 1), {"mesh": "(pp=3, tp=1, dp=1)"})
    for rank in (0, 1):
        err, seconds = out[rank]
        assert err is not None and err.startswith("AutosplitError: rank 2 did not join the job's store at "), err
        assert "within timeout_s=1 s, where ranks 0, 1 waited" in err, err
        assert 1.0 <= seconds < 1.0 + MARGIN_S, seconds
    out.clear()
    all_join((0, 1, 2), {"mesh": "(pp=3, tp=1, dp=1)"})
    assert out == {r: (None, out[r][1]) for r in range(3)}, out
