"""``python -m autosplit check`` (autosplit/check/): its parts on real ranks, its pieces alone, the GPU script.

Default tier: the numerics part on two configurations of a 2-rank pool (each must equal plain PyTorch),
the same part with one configuration's collectives broken by the hidden hook (``AUTOSPLIT_CHECK_MUTATE``)
failing by that configuration's name; which configurations a world allows; the parts of a traced step;
the flags refused before any rank joins; ``benchmarks/gpu_check.sh --dry-run``.  Slow: the whole
command under torchrun (2 gloo ranks, ``--quick``), passing, and failing by name when mutated.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autosplit.check import configs
from autosplit.check.cli import _argument_error, _parts
from autosplit.check.step_parts import differs_most, measured_parts
from autosplit.errors import AutosplitError

REPO = Path(__file__).resolve().parent.parent


# ---- run on every rank of a pool (module-level: the pool imports them) ---------------------------------
def numerics_on_rank(names: list[str], mutate_env: str | None = None) -> dict:
    """The numerics part on this pool's world, with ``AUTOSPLIT_CHECK_MUTATE`` set to ``mutate_env``."""
    from autosplit.check.job import join_world
    from autosplit.check.mutate import ENV
    from autosplit.check.numerics import run_numerics
    saved = os.environ.pop(ENV, None)
    if mutate_env:
        os.environ[ENV] = mutate_env
    cw = join_world(timeout_s=120)
    try:
        return run_numerics(cw, names=names)
    finally:
        cw.close()
        os.environ.pop(ENV, None)
        if saved is not None:
            os.environ[ENV] = saved


def test_numerics_part_passes_on_two_configurations(pool2):
    records = pool2.run(numerics_on_rank, ["pp2-1f1b", "tp2-sp"])
    for r in records:
        assert r["passed"] and r["line"].startswith("numerics: PASS 2 configurations"), r["line"]
        by_name = {c["name"]: c for c in r["configurations"]}
        assert set(by_name) == {"pp2-1f1b", "tp2-sp"}
        assert by_name["pp2-1f1b"]["mesh"] == [2, 1, 1] and by_name["tp2-sp"]["mesh"] == [1, 2, 1]
        for c in by_name.values():
            assert c["passed"] and c["loss_diff"] <= 1e-5 and c["param_diff"] <= 1e-5, c
            assert len(c["ranks"]) == 2 and c["seconds"] > 0


def test_a_mutated_collective_fails_the_numerics_part_by_name(pool2):
    """The last rank shifts what it feeds the dp gradient all-reduce (and the loss's): the part fails,
    naming the configuration, a rank and the comparison that failed.  Unmutated, the same configuration
    passes (test_check_fails_by_name_under_torchrun runs one beside it)."""
    records = pool2.run(numerics_on_rank, ["dp"], mutate_env="dp")
    for r in records:
        assert not r["passed"] and r["mutated"] == "dp"
        assert r["line"].startswith("numerics: FAIL dp (rank 0, loss of step 1: "), r["line"]
        assert "0 of 1 configurations passed" in r["line"]
        (dp,) = r["configurations"]
        assert not dp["passed"] and dp["failed_ranks"] == [0, 1] and dp["perturbed"] > 0, dp


# ---- the pieces alone ----------------------------------------------------------------------------------
def test_the_world_decides_the_configurations():
    run, skipped = configs.select(1, quick=True)
    assert [c.name for c in run] == ["dp"]
    assert dict((c.name, why) for c, why in skipped)["pp2-tp2"] == \
        "needs a world divisible by pp*tp=4; the world has 1 rank"
    run, _ = configs.select(8, quick=True)
    assert [(c.name, c.mesh(8)) for c in run] == [("dp", (1, 1, 8)), ("dp-shard-stage", (1, 1, 8)),
                                                  ("pp2-1f1b", (2, 1, 4)), ("tp2-sp", (1, 2, 4)),
                                                  ("pp2-tp2", (2, 2, 2))]
    run, skipped = configs.select(4, quick=False, inductor_problem="no C++ compiler")
    assert all(not c.compiled for c in run) and {"tp4-2d", "pp4-1f1b", "tp2-dp-shard"} <= {c.name for c in run}
    assert {c.name: why for c, why in skipped} == {
        "pp2-tp2-sp-dp-shard": "needs a world divisible by pp*tp=4 with dp >= 2 (world >= 8); the world has 4 ranks",
        **{n: "torch.compile does not work here: no C++ compiler" for n in ("compiled", "pp2-compiled", "tp2-compiled")}}
    for world in (1, 2, 4, 8):     # every configuration's batch splits into its dp x microbatches
        for c in configs.select(world, quick=False)[0]:
            dp, m = c.mesh(world)[2], c.options["num_microbatches"]
            assert configs.global_batch(world) % (dp * m) == 0, (world, c.name)
    with pytest.raises(AutosplitError, match="unknown configuration pp3: the check knows dp, zb-h1"):
        configs.select(2, quick=False, names=["pp3"])


def _event(name, cat, ts, dur, pid=0):
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": 0, "ts": ts, "dur": dur}


def test_the_parts_of_a_traced_step():
    events = [_event("step", "step", 0, 1000),
              _event("0F0", "compute", 0, 300), _event("all_reduce over tp", "communication", 100, 50),
              _event("wait 0RECV_B0", "communication", 400, 100), _event("0B0", "compute", 500, 400),
              _event("dp all_reduce", "communication", 600, 80), _event("loss all_reduce", "communication", 950, 20),
              _event("[0SEND_F0]", "communication", 310, 30), _event("0F0", "compute", 0, 999, pid=1)]
    parts = measured_parts(events, 0)
    want = {"compute": (250 + 320) * 1e-6, "tp": 50e-6, "pp": 130e-6, "dp": 100e-6, "bubble": 0, "step": 1e-3}
    want["bubble"] = 1e-3 - want["compute"] - want["tp"] - want["pp"] - want["dp"]
    assert parts == pytest.approx(want)
    predicted = {"compute": 500e-6, "tp": 0.0, "pp": 130e-6, "dp": 400e-6, "bubble": 0.0}
    assert differs_most(parts, predicted) == ("dp", pytest.approx(100e-6), 400e-6)


def _args(*argv):
    from autosplit.__main__ import _parser
    return _parser().parse_args(["check", *argv])


def test_bad_flags_are_refused_before_joining_a_world(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert _argument_error(_args("--mesh", "2,1,1")) == "--mesh 2,1,1: pp(2) * tp(1) * dp(1) != WORLD_SIZE(1)"
    assert _argument_error(_args("--configs", "dp,pp9")).startswith("--configs: unknown pp9; the check knows dp,")
    assert _argument_error(_args("--max-ratio", "0.5")) == "--max-ratio 0.5: expected a ratio >= 1"
    assert _argument_error(_args("--parts", "numerics", "--mesh", "2,1,1")) is None   # no prediction: no mesh
    assert _parts("prediction,numerics") == ("numerics", "prediction")
    with pytest.raises(SystemExit):
        _args("--parts", "numerics,speed")
    args = _args("--batch", "8,16", "--autocast", "bf16")
    assert args.batch == [8, 16] and args.device is None and args.parts == ("numerics", "profile", "prediction")


def test_the_prediction_part_gets_the_flags_band(monkeypatch, tmp_path):
    """--max-ratio reaches the prediction part (it was parsed and checked, then dropped: every check ran
    with the default band of 2, and the torchrun test asking for 100 failed on a loaded machine)."""
    import autosplit.check.job as job
    import autosplit.check.prediction as prediction
    from autosplit.check.cli import run_check
    from autosplit.check.record import make_record
    seen = {}

    class World:
        rank, size, backend, device_name = 0, 1, "gloo", "cpu"

        def say(self, text):
            pass

        def describe(self):
            return {"torch": torch.__version__}

        def close(self):
            pass

    def fake_prediction(cw, *args, **kwargs):
        seen.update(kwargs)
        return make_record("prediction", True, "ran")

    monkeypatch.setattr(job, "join_world", lambda: World())
    monkeypatch.setattr(prediction, "run_prediction", fake_prediction)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert run_check(_args("--parts", "prediction", "--max-ratio", "7.5", "--device", "h100",
                           "--out", str(tmp_path))) == 0
    assert seen["max_ratio"] == 7.5


def test_gpu_script_dry_run_prints_every_step(tmp_path):
    out = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    steps = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) >= 10, out.stdout
    text = out.stdout
    for needle in ("-m autosplit check --out", "reduce-overhead", "-m autosplit profile --out",
                   "vit_base_patch16_224", "vit_large_patch16_224", "vit_huge_patch14_224", "--autocast bf16",
                   "--device h100", "bench_gpu"):
        assert needle in text, (needle, text)
    assert not (tmp_path / "r").exists()          # a dry run writes nothing


# ---- slow: the command itself under torchrun ---------------------------------------------------------
def _torchrun(tmp_path, *argv, env=None, ranks=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "-m", "autosplit", "check", "--out", str(tmp_path), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.slow
def test_check_quick_under_torchrun(tmp_path):
    # a wide band: this test shows the parts run and report, not how well the CPU's timing is predicted
    out = _torchrun(tmp_path, "--quick", "--max-ratio", "100")
    assert out.returncode == 0, out.stdout + out.stderr
    for part in ("numerics", "profile", "prediction"):
        assert f"\n{part}: PASS" in out.stdout, out.stdout
    record = json.loads((tmp_path / "check.json").read_text())
    assert record["world"]["ranks"] == 2 and set(record["parts"]) == {"numerics", "profile", "prediction"}
    assert (tmp_path / "profile.json").exists() and (tmp_path / "prediction-trace-0.json").exists()
    case = record["parts"]["prediction"]["cases"][0]
    assert case["measured"] > 0 and case["predicted"] > 0 and case["differs_most"]["part"] in \
        ("compute", "tp", "pp", "dp", "bubble")


@pytest.mark.slow
def test_check_fails_by_name_under_torchrun(tmp_path):
    out = _torchrun(tmp_path, "--parts", "numerics", "--configs", "tp2,dp", env={"AUTOSPLIT_CHECK_MUTATE": "tp2"})
    assert out.returncode == 1, out.stdout + out.stderr
    assert "numerics: FAIL tp2 (rank 0, " in out.stdout and "PASS dp " in out.stdout, out.stdout
