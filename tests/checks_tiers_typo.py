"""For tests/test_tiers.py: a default_cases naming a case the test does not have."""
import pytest


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.default_cases("3")
def test_cases(n):
    pass
