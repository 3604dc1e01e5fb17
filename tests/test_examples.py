"""examples/: a 4-rank hybrid (pp=2, tp=2) synthetic training run under torchrun, the offline planner,
and the CIFAR example's deprecated flags (examples/train.py: tests/test_train_example.py)."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.e2e
def test_train_cifar10_hybrid_four_ranks_loss_falls(tmp_path):
    """pp=2 x tp=2 on 4 CPU processes, synthetic data: the loss falls over 12 steps, the accuracy counts
    whole images, the report and the full state dict are written."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(EXAMPLES / "train_cifar10.py"), "--mesh", "2,2,1", "--synthetic", "--steps", "12",
           "--global-batch", "32", "--num-microbatches", "4", "--epochs", "1", "--depth", "2", "--width", "32",
           "--heads", "2", "--lr", "3e-3", "--eval-batches", "1", "--workers", "0", "--log-every", "1",
           "--report", str(tmp_path / "report"), "--save", str(tmp_path / "vit.pt")]
    stdout, log = _run(cmd, tmp_path)
    assert "SYNTHETIC" in stdout
    assert stdout.count("autosplit plan: mesh (pp=2, tp=2, dp=1), 2 stages") == 1   # printed by rank 0 only
    losses = [float(x) for x in re.findall(r"^step \d+: loss (\S+)  lr ", stdout, re.M)]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses), log[-3000:]
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < first - 0.1, f"loss did not fall: {losses}"
    acc = re.search(r"test accuracy (\d+\.\d+)% on (\d+) images", stdout)
    assert acc and int(acc.group(2)) == 32, log[-3000:]
    correct = float(acc.group(1)) * 32 / 100          # a whole number of the 32 images, to print precision
    assert abs(correct - round(correct)) < 0.01, acc.group(0)
    assert "done: 12 steps" in stdout
    report = tmp_path / "report" / "report.html"
    assert f"report: {report}" in stdout and 'id="plan-data"' in report.read_text()
    assert (tmp_path / "report" / "pp1_tp1" / "stage1.py").is_file()
    import torch
    state = torch.load(tmp_path / "vit.pt")
    assert state["head.weight"].shape == (10, 32) and state["blocks.0.attn.qkv.weight"].shape == (96, 32)


@pytest.mark.e2e         # a subprocess; the default tier's is test_checkpoint's export
def test_plan_vit_dump(tmp_path):
    out = tmp_path / "plan"
    stdout, log = _run([sys.executable, str(EXAMPLES / "plan_vit.py"), "vit_tiny_patch16_224", "--mesh", "2,1,1",
                        "--batch", "4", "--out", str(out)], tmp_path)
    assert "autosplit plan: mesh (pp=2, tp=1, dp=1), 2 stages" in stdout
    for name in ["summary.txt", "plan.json", "schedule.txt", "pp0_tp0/stage0.py", "pp1_tp0/stage1.py",
                 "stage0.dot", "stage1.dot", "report.html"]:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    plan = json.loads((out / "plan.json").read_text())
    assert len(plan["stages"]) == 2 and plan["schedule"] == "1f1b"
    assert "def forward" in (out / "pp0_tp0" / "stage0.py").read_text()


@pytest.mark.e2e
def test_train_cifar10_resume_continues_the_same_run(tmp_path):
    """mesh (2,2,1) on 4 processes: a run stopped after epoch 1 and resumed from its sharded checkpoint
    prints the same losses as an uninterrupted one; --export writes a state dict the plain timm model loads."""
    def run(tag, *extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               str(EXAMPLES / "train_cifar10.py"), "--mesh", "2,2,1", "--synthetic", "--train-size", "128",
               "--global-batch", "32", "--num-microbatches", "4", "--epochs", "2", "--depth", "2", "--width", "32",
               "--heads", "2", "--lr", "3e-3", "--eval-batches", "1", "--workers", "0", "--log-every", "1", *extra]
        stdout, log = _run(cmd, tmp_path)
        return dict(re.findall(r"^step (\d+): loss (\S+)  lr ", stdout, re.M)), stdout

    whole, _ = run("whole")
    first, _ = run("first", "--stop-after-epochs", "1", "--checkpoint-dir", str(tmp_path / "ckpt"))
    rest, stdout = run("rest", "--resume", str(tmp_path / "ckpt"), "--checkpoint-dir", str(tmp_path / "ckpt"),
                       "--export", str(tmp_path / "model.pt"))
    assert sorted(first, key=int) == ["1", "2", "3", "4"] and sorted(rest, key=int) == ["5", "6", "7", "8"]
    assert {**first, **rest} == whole, (first, rest, whole)
    assert "resumed from" in stdout and "at step 4" in stdout
    import timm
    import torch
    model = timm.models.VisionTransformer(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2,
                                          num_classes=10)
    model.load_state_dict(torch.load(tmp_path / "model.pt"))        # strict: every key and shape


@pytest.mark.parametrize("old, new, dest, value", [
    (["--bf16"], "--autocast bf16", "autocast", "bf16"),
    (["--microbatches", "4"], "--num-microbatches", "num_microbatches", 4),
    (["--batch", "64"], "--global-batch", "global_batch", 64),
    (["--checkpoint"], "--recompute stage", "recompute", "stage"),
])
def test_train_cifar10_deprecated_flag_still_works(old, new, dest, value, capsys):
    """Each old flag of train_cifar10.py sets its new flag's value and warns, naming the new flag."""
    from examples import train_cifar10
    args = train_cifar10.parse_args(old + ["--checkpoint-dir", "ckpt"])
    assert getattr(args, dest) == value and args.checkpoint_dir == "ckpt"
    err = capsys.readouterr().err
    assert f"warning: {old[0]} is deprecated" in err and f"use {new}" in err, err
