"""Tests for tests/test_tiers.py to collect (a checks_ file is collected only when named): one of each
way a test lands in a tier."""
import pytest


def test_plain():
    pass


@pytest.mark.slow
def test_marked():
    pass


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.default_cases("2")
def test_cases(n):
    pass


def test_big_world(pool8):      # only collected (--collect-only): the pool never starts
    pass
