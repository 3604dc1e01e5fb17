"""Smoke tests of examples/: a 2-rank synthetic training run under torchrun, and the offline planner."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", AUTOSPLIT_TIMEOUT="60")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run(cmd, cwd):
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{log[-6000:]}"
    return proc.stdout, log


def test_train_cifar10_synthetic_two_ranks(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLES / "train_cifar10.py"), "--mesh", "2,1,1", "--synthetic", "--steps", "3",
           "--batch", "16", "--microbatches", "4", "--epochs", "1", "--depth", "2", "--width", "32",
           "--eval-batches", "2", "--workers", "0", "--save", str(tmp_path / "vit.pt")]
    stdout, log = _run(cmd, tmp_path)
    assert "SYNTHETIC" in stdout
    assert "autosplit plan: mesh (pp=2, tp=1, dp=1), 2 stages" in stdout   # the plan summary, printed once
    assert stdout.count("autosplit plan:") == 1
    losses = [float(x) for x in re.findall(r"train loss (\S+) \(last (\S+)\)", stdout)[-1]]
    assert all(math.isfinite(x) and 0 < x < 10 for x in losses), log[-3000:]
    acc = re.search(r"test accuracy (\d+\.\d+)% on (\d+) images", stdout)
    assert acc and 0 <= float(acc.group(1)) <= 100 and int(acc.group(2)) == 32, log[-3000:]
    assert "done: 3 steps" in stdout
    import torch
    state = torch.load(tmp_path / "vit.pt")
    assert state["head.weight"].shape == (10, 32) and all(torch.isfinite(v).all() for v in state.values())


def test_plan_vit_dump(tmp_path):
    out = tmp_path / "plan"
    stdout, log = _run([sys.executable, str(EXAMPLES / "plan_vit.py"), "vit_tiny_patch16_224", "--mesh", "2,1,1",
                        "--batch", "4", "--out", str(out)], tmp_path)
    assert "autosplit plan: mesh (pp=2, tp=1, dp=1), 2 stages" in stdout
    for name in ["summary.txt", "plan.json", "schedule.txt", "pp0_tp0/stage0.py", "pp1_tp0/stage1.py",
                 "stage0.dot", "stage1.dot"]:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    plan = json.loads((out / "plan.json").read_text())
    assert len(plan["stages"]) == 2 and plan["schedule"] == "1f1b"
    assert "def forward" in (out / "pp0_tp0" / "stage0.py").read_text()
