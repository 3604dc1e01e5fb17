import os
import shutil
import tempfile

import pytest

from tests.dist_pool import Pool, gpus_missing

# measured cost-model profiles (cost_model/profile_cache.py): the tests never read or write the user's
# cache.  Made here, at import, so that every process the tests start (the pools' spawned workers)
# inherits it through the environment; removed when the session ends (tests/test_cleanup.py checks).
PROFILE_DIR = tempfile.mkdtemp(prefix="autosplit-profiles-")
os.environ["AUTOSPLIT_PROFILE_DIR"] = PROFILE_DIR


# --- test tiers ----------------------------------------------------------------------------------------
HEAVY = ("slow", "world8", "inductor", "e2e", "browser")     # registered in pyproject.toml
TIERS = {"default": "everything not marked heavy (the README's command)",
         "heavy": f"only the tests marked {', '.join(HEAVY)}", "all": "both"}


def pytest_addoption(parser):
    parser.addoption("--tier", choices=tuple(TIERS), default="default",
                     help="; ".join(f"{name}: {what}" for name, what in TIERS.items()))


def pytest_collection_modifyitems(config, items):
    """Mark the big worlds, then keep the tier asked for.  Why the world size is read off the fixtures
    and not written on each test: a test joins the 8-rank tier by asking for that pool, so the mark
    cannot be forgotten."""
    listed: dict = {}                   # test function -> (the ids its default_cases names, the ids seen)
    for item in items:
        if {"pool8", "pool16"} & set(getattr(item, "fixturenames", ())):
            item.add_marker("world8")
        cases = item.get_closest_marker("default_cases")
        if cases is not None and hasattr(item, "callspec"):
            named, seen = listed.setdefault(item.nodeid.split("[")[0], (set(cases.args), set()))
            seen.add(item.callspec.id)
            if item.callspec.id not in named:
                item.add_marker("slow")
    for test, (named, seen) in listed.items():     # a renamed case must not drop out of the default tier
        if named - seen:
            raise pytest.UsageError(f"{test}: default_cases names {sorted(named - seen)}, which are not "
                                    f"among its cases {sorted(seen)}")
    tier = config.getoption("--tier")
    if tier == "all" or config.getoption("markexpr"):        # an explicit -m selects by itself
        return
    keep, drop = [], []
    for item in items:
        heavy = any(item.get_closest_marker(name) for name in HEAVY)
        (keep if heavy == (tier == "heavy") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_unconfigure(config):
    """Remove the profile directory.  Why here and not in a session fixture's teardown: this runs last,
    after every session fixture (the pools, whose workers write into it) was torn down, and also after
    a run that failed in collection, where no fixture ever ran."""
    shutil.rmtree(PROFILE_DIR, ignore_errors=True)


def _pool(size: int):
    """A pool of ``size`` ranks on the backend AUTOSPLIT_TEST_BACKEND names (tests/dist_pool.py); a test
    that needs more GPUs than present is skipped, saying how many it needs."""
    missing = gpus_missing(size)
    if missing:
        pytest.skip(missing)
    pool = Pool(size)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool1():
    yield from _pool(1)


@pytest.fixture(scope="session")
def pool2():
    yield from _pool(2)


@pytest.fixture(scope="session")
def pool4():
    yield from _pool(4)


@pytest.fixture(scope="session")
def pool8():
    yield from _pool(8)
