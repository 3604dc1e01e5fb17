"""The test tiers (tests/conftest.py): `python -m pytest` runs the default tier, `--tier heavy` the tests
marked slow / world8 / inductor / e2e / browser, `--tier all` both; `-m EXPR` selects by itself."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _collect(file: str, *args: str) -> tuple[int, set[str], str]:
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          f"tests/{file}", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    names = {line.split("::", 1)[1] for line in run.stdout.splitlines() if "::" in line}
    return run.returncode, names, run.stdout + run.stderr


def test_tiers_partition_the_tests():
    default, heavy, everything = (_collect("checks_tiers.py", *tier)[1]
                                  for tier in ((), ("--tier", "heavy"), ("--tier", "all")))
    assert default == {"test_plain", "test_cases[2]"}
    # marked slow; cases default_cases leaves out; a test asking for the 8-rank pool (world8)
    assert heavy == {"test_marked", "test_cases[1]", "test_cases[3]", "test_big_world"}
    assert everything == default | heavy


@pytest.mark.slow
def test_a_marker_expression_selects_by_itself():
    assert _collect("checks_tiers.py", "-m", "slow")[1] == {"test_marked", "test_cases[1]", "test_cases[3]"}
    assert _collect("checks_tiers.py", "-m", "world8")[1] == {"test_big_world"}


def test_default_cases_naming_a_missing_case_is_an_error():
    code, _, output = _collect("checks_tiers_typo.py")
    assert code != 0 and "default_cases names ['3'], which are not among its cases ['1', '2']" in output, output
