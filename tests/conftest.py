import os
import shutil
import tempfile

import pytest

from tests.dist_pool import Pool

# measured cost-model profiles (cost_model/profile_cache.py): the tests never read or write the user's
# cache.  Made here, at import, so that every process the tests start (the pools' spawned workers)
# inherits it through the environment; removed when the session ends (tests/test_cleanup.py checks).
PROFILE_DIR = tempfile.mkdtemp(prefix="autosplit-profiles-")
os.environ["AUTOSPLIT_PROFILE_DIR"] = PROFILE_DIR


def pytest_unconfigure(config):
    """Remove the profile directory.  Why here and not in a session fixture's teardown: this runs last,
    after every session fixture (the pools, whose workers write into it) was torn down, and also after
    a run that failed in collection, where no fixture ever ran."""
    shutil.rmtree(PROFILE_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def pool1():
    pool = Pool(1)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool2():
    pool = Pool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool4():
    pool = Pool(4)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool8():
    pool = Pool(8)
    yield pool
    pool.close()
