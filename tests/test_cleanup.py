"""The suite leaves nothing in the system temp folder (issue 33, item 7): tests/conftest.py points the
cost-model profile cache (cost_model/profile_cache.py) at a directory of its own, inherited by every
process the tests spawn, and removes it when the session ends."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow      # a nested pytest run (8 s): the temp-folder hygiene check, in the heavy tier
def test_run_leaves_no_profile_directory(tmp_path):
    """A pytest run whose spawned worker wrote a profile into the cache: afterwards its temp folder
    (TMPDIR, where tempfile makes directories) holds no autosplit-profiles-* (or other autosplit*) entry."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("AUTOSPLIT_PROFILE_DIR", None)           # the inner run's conftest makes its own
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/checks_cleanup.py"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr
    left = sorted(p.name for p in tmp_path.glob("autosplit*"))       # autosplit-profiles-* and any other of ours
    assert left == [], f"the run left {left} in {tmp_path}"
