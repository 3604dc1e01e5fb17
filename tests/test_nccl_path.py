"""The NCCL path, modelled on CPU (no GPU runs these tests): failed works, the host's run-ahead, which
groups a failure aborts, NCCL's own timeout, the heartbeat's store client, what the diagnosis can tell,
and the strict transport's rendezvous.  See docs/design.md, "The NCCL path: failures and deadlines"."""
from __future__ import annotations

import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

from autosplit.mesh import MeshShape
from autosplit.runtime.faults import deferred, deadlines as faults, heartbeat as hb
from autosplit.runtime.faults.deadlines import RankFailure, Watchdog
from tests import checks_nccl
from tests.dist_pool import Pool


@pytest.fixture
def fast_beats(monkeypatch):
    monkeypatch.setattr(hb, "INTERVAL_S", 0.05)


def _watchdog(store, mesh=(1, 1, 1), timeout_s=1.0, backend="nccl"):
    return Watchdog(store, 0, MeshShape(*mesh), timeout_s, backend)


def _stop(store):
    beat = hb._BEATS.pop(id(store), None)
    if beat is not None:
        beat.stop()


class _Work:
    """A finished communication work: ``error`` is what it failed with; ``reports`` how it says so."""

    def __init__(self, error=None, reports="exception"):
        self.error, self.reports = error, reports

    def is_completed(self):
        return True                          # NCCL's isCompleted(): exception() || finished

    def exception(self):
        if self.reports != "exception":
            raise RuntimeError("exception() is not supported by this work")
        return self.error

    def wait(self, timeout=None):
        if self.reports == "wait" and self.error is not None and self.waited:
            raise self.error
        self.waited = True                   # the first wait only orders the stream (deferred)
        return True

    waited = False


@pytest.mark.parametrize("reports", ["exception", "wait"])
def test_settle_fails_on_a_failed_work(fast_beats, reports):
    """A work that failed is also "completed": settle must raise with the rank and the action."""
    store = dist.HashStore()
    try:
        wd = _watchdog(store)
        wd.wait(_Work(), "0RECV_F0")                                   # fine
        wd.wait(_Work(RuntimeError("NCCL communicator was aborted"), reports), "0RECV_F1")
        with pytest.raises(RankFailure) as info:
            wd.settle()
        assert "rank 0 (pp=0, tp=0, dp=0) failed at 0RECV_F1: RuntimeError: NCCL communicator was aborted" \
            in str(info.value)
        wd.wait(_Work(), "0RECV_F2", host=True)                          # a good work settles
    finally:
        _stop(store)


def _on_fresh_pool(fn, *args) -> list:
    pool = Pool(2)
    try:
        return pool.run(fn, *args, timeout=60)
    finally:
        pool.close(force=True)


@pytest.mark.slow
def test_host_run_ahead_is_bounded():
    """With waits deferred to host reads, a receive that never arrives stalls the stream; the host must
    stop at our deadline within RUN_AHEAD_ACTIONS actions, not queue launches until one blocks."""
    r = _on_fresh_pool(checks_nccl.hung_receive_run_ahead)[0]
    assert r["error"].startswith("RankFailure:") and "HostBlocked" not in r["error"], r
    assert "0RECV_B1" in r["error"] and "no progress for 2 s" in r["error"], r
    assert r["queued"] <= deferred.RUN_AHEAD_ACTIONS, r
    assert r["seconds"] < 2 + 6, r


def test_host_run_ahead_is_bounded_inside_one_action(fast_beats):
    """A tp stage defers a collective every few layers inside one action: a stuck one must end the step
    at our deadline within RUN_AHEAD_WORKS deferrals, before the modelled launch queue (64 launches, 4
    between collectives) fills, though no action boundary comes to check it."""
    store = dist.HashStore()
    try:
        r = checks_nccl.collectives_in_one_action(_watchdog(store, timeout_s=0.5), depth=64, launches_each=4,
                                                  stuck=10)
    finally:
        _stop(store)
    assert r["error"] is not None and r["error"].startswith("RankFailure:"), r
    assert "failed at all_reduce over tp #10: TimeoutError: no progress for 0.5 s" in r["error"], r
    assert r["queued"] <= deferred.RUN_AHEAD_WORKS * 4, r
    assert r["seconds"] < 0.5 + 3, r


@pytest.mark.slow
def test_a_failure_aborts_only_our_groups():
    """torch's abort API, with async error handling off as it asks: our groups go, the default one stays."""
    for r in _on_fresh_pool(checks_nccl.abort_after_failure):
        assert "failed at a test action: ValueError: injected" in r["message"], r
        assert r["default_kept"] and r["barrier"] is None, r
        assert r["ours"] >= 2 and r["ours_left"] == 0, r
        assert r["close"] is None, r


@pytest.mark.parametrize("setting,aborts", [(None, False), ("1", False), ("3", False), ("0", True)])
def test_abort_only_where_error_handling_is_off(monkeypatch, setting, aborts):
    if setting is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", setting)
    assert faults.aborts_on_failure("nccl") is aborts
    assert faults.aborts_on_failure("gloo") is False


def test_nccl_init_leaves_error_handling_and_outlasts_our_deadline(monkeypatch):
    """init_world on the NCCL path (modelled: the default group is a one-rank gloo group) must not set
    TORCH_NCCL_ASYNC_ERROR_HANDLING, and every group our traffic uses must time out later than our
    deadline plus the diagnosis."""
    from autosplit.runtime.parallel import world as world_mod
    seen = {}
    real_init = dist.init_process_group

    def init(backend, timeout=None, **options):
        seen.update(backend=backend, timeout=timeout, handling=world_mod.os.environ.get(
            "TORCH_NCCL_ASYNC_ERROR_HANDLING"))
        real_init("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)

    for key, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.setattr(world_mod, "_choose_backend", lambda: ("nccl", torch.device("cpu")))
    monkeypatch.setattr(world_mod.dist, "init_process_group", init)
    assert not dist.is_initialized()
    try:
        world = world_mod.init_world((1, 1, 1), timeout_s=100)
        needed = 100 + 3 * hb.interval_for(1)
        assert seen["backend"] == "nccl" and seen["handling"] is None, seen
        assert seen["timeout"].total_seconds() > needed, seen
        groups = [world.group(a) for a in ("pp", "tp", "dp")]
        assert all(g is not dist.group.WORLD for g in groups)         # our traffic, our groups
        for g in groups:
            assert g._get_backend(torch.device("cpu")).options._timeout.total_seconds() > needed
        world.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _OneClientStore:
    """A store client as TCPStore's is: one request at a time (a lock held for the round trip).  A
    ``set`` of a heartbeat key hangs (a stuck connection) until ``release`` is set.  ``clone`` gives a
    new client of the same data."""

    def __init__(self, data=None, release=None):
        self.data, self.lock = data if data is not None else dist.HashStore(), threading.Lock()
        self.release = release or threading.Event()

    def clone(self):
        return _OneClientStore(self.data, self.release)

    def set(self, key, value):
        with self.lock:
            if key.startswith("autosplit/beat/"):
                self.release.wait()
            self.data.set(key, value)

    def check(self, keys):
        with self.lock:
            return self.data.check(keys)

    def get(self, key):
        with self.lock:
            return self.data.get(key)


def test_a_stuck_heartbeat_cannot_stall_the_deadline(fast_beats):
    store = _OneClientStore()
    outcome = []
    try:
        wd = _watchdog(store, timeout_s=0.3, backend="gloo")
        time.sleep(0.1)                               # the heartbeat's first set is stuck by now

        def wait():
            try:
                wd.until(lambda: False, "a wait")
            except RankFailure as exc:
                outcome.append(str(exc))
        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        waiter.join(timeout=5)
        assert not waiter.is_alive(), "the deadline loop is stuck behind the heartbeat's store call"
        assert "TimeoutError: no progress for 0.3 s" in outcome[0], outcome
    finally:
        store.release.set()
        _stop(store)


def test_gpu_diagnosis_says_what_it_cannot_tell(fast_beats):
    """On NCCL a rank whose device is stuck waits on the host like one in an ordering deadlock."""
    store = dist.HashStore()
    beats = [hb.Heartbeat(store, r, 3) for r in (1, 2)]
    try:
        for r, beat in zip((1, 2), beats):
            beat.at(f"{r}RECV_F0", waiting=True)
        time.sleep(0.1)
        describe = lambda r: f"rank {r}"
        gloo = hb.diagnose(store, 3, 0, describe)
        nccl = hb.diagnose(store, 3, 0, describe, device_queues=True)
        assert gloo.startswith("every rank is waiting on another (rank 1 at 1RECV_F0, rank 2 at 2RECV_F0): "
                               "an ordering deadlock"), gloo
        assert "cannot tell" not in gloo, gloo
        assert "an ordering deadlock" in nccl and "stuck" in nccl and "cannot tell" in nccl, nccl
    finally:
        for beat in beats:
            beat.stop()


@pytest.mark.slow
def test_strict_transport_send_cycle_times_out_naming_the_sends():
    """Sends right after their producer, receives right before their consumer: NCCL's rendezvous sends
    make the two ranks wait on each other; the strict transport must too, and say which send blocks."""
    for r in _on_fresh_pool(checks_nccl.replay_send_cycle):
        assert r["gloo"] is None, r
        assert r["strict"].startswith("RankFailure:") and "TimeoutError: no progress for 3 s" in r["strict"], r
        assert re.search(r"\[\dSEND_[FB]\d\], posted before \S+ on this rank, has not finished", r["strict"]), r
        assert r["seconds"] < 3 + 6, r


def test_nccl_watchdog_timeout_without_dist_set_timeout(monkeypatch):
    """torch 2.11 has no ``dist.set_timeout``: every NCCL world failed to start (found on a GPU).  The
    NCCL backend's own setter is used instead; where that is missing too, a clear error."""
    import torch.distributed as dist
    from autosplit.errors import AutosplitError
    from autosplit.runtime.parallel.world import nccl_timeout_s, set_nccl_timeout

    class Backend:
        def _set_default_timeout(self, timeout):
            self.timeout = timeout

    class Group:
        backend = Backend()

        def _get_backend(self, device):
            assert device.type == "cuda"
            return self.backend

    monkeypatch.delattr(dist, "set_timeout", raising=False)
    group = Group()
    set_nccl_timeout(group, 60.0, 4)
    assert group.backend.timeout.total_seconds() == nccl_timeout_s(60.0, 4)
    group.backend = object()
    with pytest.raises(AutosplitError, match="cannot set NCCL's watchdog timeout"):
        set_nccl_timeout(group, 60.0, 4)
