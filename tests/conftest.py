import pytest

from tests.dist_pool import Pool


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
