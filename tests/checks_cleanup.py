"""Run by tests/test_cleanup.py in a pytest process of its own (not collected by the suite: the name does not
start with ``test_``): a spawned worker, as the test pools start them, writes a cost-model profile into the
cache directory the session's conftest made.  The outer test then checks that the run left no
``autosplit-profiles-*`` directory behind."""
import multiprocessing
import os


def _save_profile() -> str:
    from autosplit.cost_model import get_profile, profile_cache
    return str(profile_cache.save(profile_cache.machine_key(), get_profile("h100")))


def test_worker_writes_into_the_session_cache():
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        path = pool.apply(_save_profile)
    directory = os.environ["AUTOSPLIT_PROFILE_DIR"]          # inherited by the worker
    assert os.path.dirname(path) == directory and os.path.exists(path), (path, directory)
