import os
import tempfile

import pytest

from tests.dist_pool import Pool

# measured cost-model profiles (cost_model/profile_cache.py): the tests never read or write the user's
# cache; every process they start inherits this directory
os.environ["AUTOSPLIT_PROFILE_DIR"] = tempfile.mkdtemp(prefix="autosplit-profiles-")


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
