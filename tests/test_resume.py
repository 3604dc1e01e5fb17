"""Exact resume (issue 33, item 4): stop, save, load into fresh objects, go on -- as if never stopped.

Real gloo processes.  The model has dropout 0.1 everywhere (position, attention, projection, MLP: the
MLP's hidden dropout runs on the per-tp-rank RNG fork under tensor parallelism), trains under fp16
autocast from a huge initial loss scale with a short growth interval (so steps are skipped on overflow,
the scale grows back and overflows again), with AdamW, a StepLR scheduler and a stateful loader that
reshuffles every epoch.  The resumed job is seeded differently and starts every object afresh: only the
checkpoint carries the state.  One variant has no dropout (and no qkv bias), so that a resume on another
mesh, where the random streams cannot continue, can be compared with the uninterrupted run too.

Terms:
  uninterrupted run -- STEPS steps in one go; it saves after SAVE_AT steps and goes on.
  resumed run       -- a fresh ParallelModule, optimizer, scheduler and loader (another seed) that loads
                       that checkpoint and runs the remaining steps.
"""
from __future__ import annotations

import os
import warnings

import pytest
import timm
import torch

STEPS, SAVE_AT, BATCH, MICRO, SAMPLES = 8, 5, 8, 2, 16
FRESH_SCALER = (2.0**18, 0)     # what _job sets; at SAVE_AT every mesh's scaler has moved off it (asserted)
# Another mesh adds up in another order: with fp16 matmuls the resumed (2, 1, 1) run is measured 2.4e-5 from
# the uninterrupted (1, 2, 1) run's losses and 2.7e-6 from its final parameters (the two meshes run
# uninterrupted from the start differ by up to 2.2e-4 in the loss); without autocast the same resume is
# 4.8e-7 and 7.5e-9 off.  Dropping the optimizer state or the loader in the resume moves them >= 9e-3 and >= 6e-4.
LOSS_TOL, PARAM_TOL = 2e-4, 5e-5


def _model(dropout: float = 0.1, qkv_bias: bool = True):
    torch.manual_seed(0)
    return timm.models.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2,
                                         num_classes=10, qkv_bias=qkv_bias, drop_rate=dropout, pos_drop_rate=dropout,
                                         proj_drop_rate=dropout, attn_drop_rate=dropout)


class Loader:
    """A stateful data loader (``torch.distributed.checkpoint.stateful.Stateful``): a pass over a fixed data
    set in a shuffled order, reshuffled by its own generator at every epoch; ``replica`` picks the rows
    one data-parallel replica reads (so replicas' states differ)."""

    def __init__(self, batch: int, replica: int = 0, replicas: int = 1):
        g = torch.Generator().manual_seed(11)
        self.xs, self.ys = torch.randn(SAMPLES, 3, 32, 32, generator=g), torch.randint(0, 10, (SAMPLES,), generator=g)
        self.batch, self.rows = batch, slice(replica * batch // replicas, (replica + 1) * batch // replicas)
        self.gen = torch.Generator().manual_seed(5 + replica)
        self.order, self.pos = torch.randperm(SAMPLES, generator=self.gen), 0

    def next(self):
        if self.pos + self.batch > SAMPLES:
            self.order, self.pos = torch.randperm(SAMPLES, generator=self.gen), 0
        idx = self.order[self.pos:self.pos + self.batch][self.rows]
        self.pos += self.batch
        return self.xs[idx], self.ys[idx]

    def state_dict(self):
        return {"order": self.order.clone(), "pos": self.pos, "generator": self.gen.get_state()}

    def load_state_dict(self, state):
        self.order, self.pos = state["order"].clone(), int(state["pos"])
        self.gen.set_state(state["generator"])


def _job(mesh, seed: int, per_replica_loader: bool = False, **model):
    import autosplit
    pm = autosplit.parallelize(_model(**model), mesh=mesh, num_microbatches=MICRO, autocast=torch.float16,
                               device="h100", example_input=torch.randn(BATCH // mesh[2] // MICRO, 3, 32, 32))
    torch.manual_seed(seed)           # the job's own seed, after building: a resumed job is seeded differently
    pm.scaler.scale, pm.scaler.growth_interval = FRESH_SCALER[0], 2     # overflows at first, grows, overflows again
    opt = torch.optim.AdamW(pm.parameters(), lr=2e-3, eps=1e-6)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loader = Loader(BATCH, pm.dp_rank, pm.dp_size) if per_replica_loader else Loader(BATCH)
    if not per_replica_loader:
        loader.rows = slice(pm.dp_rank * BATCH // pm.dp_size, (pm.dp_rank + 1) * BATCH // pm.dp_size)
    return pm, opt, sched, loader


def _status(pm, sched, loader) -> dict:
    return {"scale": pm.scaler.scale, "clean": pm.scaler.clean_steps, "lr": sched.get_last_lr(),
            "loader": (loader.order.tolist(), loader.pos), "rng": torch.get_rng_state(), "step": pm.step_count}


def _train(pm, opt, sched, loader, steps: range) -> tuple[list, list]:
    losses, skipped = [], []
    for _ in steps:
        x, y = loader.next()
        losses.append(pm.step(x, y))
        skipped.append(pm.scaler.skipped)
        opt.step()
        opt.zero_grad()
        sched.step()
    return losses, skipped


def uninterrupted(directory: str, mesh, per_replica_loader: bool = False, **model):
    """STEPS steps; after SAVE_AT of them a checkpoint (model, AdamW, loss scale, RNG, scheduler, loader)."""
    pm, opt, sched, loader = _job(mesh, 1, per_replica_loader, **model)
    losses, skipped = _train(pm, opt, sched, loader, range(SAVE_AT))
    pm.save_checkpoint(directory, optimizer=opt, extra={"loader": loader, "lr": sched})
    at_save = {**_status(pm, sched, loader), "state": pm.full_state_dict()}
    more, more_skipped = _train(pm, opt, sched, loader, range(SAVE_AT, STEPS))
    return {"losses": losses + more, "skipped": skipped + more_skipped, "at_save": at_save,
            "final": pm.full_state_dict()}


def resumed(directory: str, mesh, per_replica_loader: bool = False, **model):
    """A fresh job (another seed) that finds no checkpoint in an empty directory, then loads ``directory``
    and runs the remaining steps."""
    import autosplit
    pm, opt, sched, loader = _job(mesh, 2, per_replica_loader, **model)
    empty = os.path.join(os.path.dirname(directory), "nothing-yet")
    missing = (autosplit.latest_checkpoint(empty), pm.load_checkpoint(empty, optimizer=opt, missing_ok=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = pm.load_checkpoint(directory, optimizer=opt, extra={"loader": loader, "lr": sched})
    after_load = {**_status(pm, sched, loader), "state": pm.full_state_dict()}
    losses, skipped = _train(pm, opt, sched, loader, range(record["step"], STEPS))
    return {"losses": losses, "skipped": skipped, "after_load": after_load, "missing": missing,
            "final": pm.full_state_dict(), "latest": autosplit.latest_checkpoint(directory),
            "warnings": [str(w.message) for w in caught]}


def _same(a: dict, b: dict, keys=("scale", "clean", "lr", "loader", "step")) -> None:
    for k in keys:
        assert a[k] == b[k], (k, a[k], b[k])
    assert set(a["state"]) == set(b["state"])
    for k in a["state"]:
        assert torch.equal(a["state"][k], b["state"][k]), k


@pytest.mark.parametrize("mesh,per_replica", [((1, 2, 1), False), ((2, 1, 1), False), ((1, 1, 2), True)],
                         ids=["tp", "pp", "dp"])
@pytest.mark.default_cases('dp')
def test_resume_on_the_same_mesh_is_bit_exact(pool2, tmp_path, mesh, per_replica):
    """Every loss after the resume equals the uninterrupted run's bit for bit: dropout masks (the default
    stream and the tp forks), loss scale and growth counter (the same steps skipped), AdamW state, the
    scheduler's learning rate and the loader's position and shuffle all continue where they were; with
    dp=2 each replica's loader resumes its own rows.  A directory with no checkpoint: latest_checkpoint
    is None and load_checkpoint(..., missing_ok=True) returns None."""
    directory = str(tmp_path / "run")
    first = pool2.run(uninterrupted, directory, mesh, per_replica)
    second = pool2.run(resumed, directory, mesh, per_replica)
    assert any(first[0]["skipped"][:SAVE_AT]) and any(first[0]["skipped"][SAVE_AT:]), first[0]["skipped"]
    assert not all(first[0]["skipped"][SAVE_AT:]), first[0]["skipped"]
    assert (first[0]["at_save"]["scale"], first[0]["at_save"]["clean"]) != FRESH_SCALER     # a lost scaler shows
    for a, b in zip(first, second):
        assert b["losses"] == a["losses"][SAVE_AT:], (b["losses"], a["losses"][SAVE_AT:])
        assert b["skipped"] == a["skipped"][SAVE_AT:]
        _same(a["at_save"], b["after_load"])
        assert torch.equal(a["at_save"]["rng"], b["after_load"]["rng"])
        assert all(torch.equal(a["final"][k], b["final"][k]) for k in a["final"]), "final parameters differ"
        assert b["missing"] == (None, None)
        assert b["latest"] is not None and b["latest"].startswith(directory), b["latest"]
        assert b["warnings"] == [], b["warnings"]


@pytest.mark.slow
def test_resume_on_another_mesh(pool2, tmp_path):
    """Saved under tensor parallelism (1, 2, 1), loaded on a pipeline (2, 1, 1): the model, the loss scale
    and its growth counter, the scheduler, the loader and the step are restored exactly; every rank's
    random state is the one rank 0 saved (the per-rank streams of another mesh have no counterpart here,
    and tp ranks must share one), so dropout masks, and the losses, differ from the uninterrupted run."""
    directory = str(tmp_path / "run")
    first = pool2.run(uninterrupted, directory, (1, 2, 1))
    second = pool2.run(resumed, directory, (2, 1, 1))
    for b in second:
        _same(first[0]["at_save"], b["after_load"])
        assert torch.equal(b["after_load"]["rng"], first[0]["at_save"]["rng"])
        assert b["warnings"] == [], b["warnings"]
        assert len(b["losses"]) == STEPS - SAVE_AT and all(l == l for l in b["losses"])


def test_resume_on_another_mesh_continues_the_run(pool2, tmp_path):
    """Without dropout (the random streams are all another mesh cannot continue: see above) a run saved
    under tensor parallelism (1, 2, 1) and resumed on a pipeline (2, 1, 1) goes on as the uninterrupted
    (1, 2, 1) run: fp16 overflow skips at the same steps (the loss scale and its growth counter came back),
    the scheduler's learning rate as saved, and the losses and final parameters equal up to the two meshes'
    fp16 arithmetic (LOSS_TOL, PARAM_TOL: AdamW's moments resharded by name, the loader's position and
    shuffle).  Not bit for bit: another mesh sums in another order.  No qkv bias: the key bias's gradient is
    zero in exact arithmetic (softmax ignores a constant added to a row of scores), so AdamW's normalized
    update turns the meshes' rounding noise in it into steps of up to lr (measured 1e-3 without autocast)."""
    directory = str(tmp_path / "run")
    first = pool2.run(uninterrupted, directory, (1, 2, 1), dropout=0.0, qkv_bias=False)
    second = pool2.run(resumed, directory, (2, 1, 1), dropout=0.0, qkv_bias=False)
    a = first[0]
    assert any(a["skipped"][SAVE_AT:]) and not all(a["skipped"][SAVE_AT:]), a["skipped"]
    assert (a["at_save"]["scale"], a["at_save"]["clean"]) != FRESH_SCALER
    for b in second:
        _same(a["at_save"], b["after_load"])
        assert b["warnings"] == [], b["warnings"]
        assert b["skipped"] == a["skipped"][SAVE_AT:], (b["skipped"], a["skipped"])
        loss_diff = max(abs(x - y) for x, y in zip(b["losses"], a["losses"][SAVE_AT:]))
        param_diff = max((b["final"][k] - a["final"][k]).abs().max().item() for k in a["final"])
        assert loss_diff <= LOSS_TOL, (b["losses"], a["losses"][SAVE_AT:])
        assert param_diff <= PARAM_TOL, param_diff


@pytest.mark.slow
def test_per_replica_extra_needs_the_same_dp(pool2, tmp_path):
    """A loader whose state differs between dp replicas cannot follow a change of dp: a clear error on
    every rank that names the extra and both meshes."""
    directory = str(tmp_path / "run")
    pool2.run(uninterrupted, directory, (1, 1, 2), True)
    errors = pool2.run(_load_error, directory, (1, 2, 1))
    assert all("'loader'" in e and "dp=2" in e and "dp=1" in e for e in errors), errors


def test_bad_extra_is_refused_on_every_rank(pool2, tmp_path):
    """extra= that is not a Stateful, or takes a name the checkpoint uses itself: the same clear error on
    every rank, nothing written."""
    directory = str(tmp_path / "run")
    errors = pool2.run(_save_errors, directory)
    for not_stateful, reserved in errors:
        assert "extra['lr'] is a float" in not_stateful and "Stateful" in not_stateful, not_stateful
        assert "extra name 'rng'" in reserved, reserved
    assert not os.path.exists(directory)


def _save_errors(directory: str):
    from tests.dist_checks import error_of
    pm, opt, sched, loader = _job((1, 2, 1), seed=2)
    return (error_of(lambda: pm.save_checkpoint(directory, optimizer=opt, extra={"lr": 1e-3})),
            error_of(lambda: pm.save_checkpoint(directory, extra={"rng": loader})))


def _load_error(directory: str, mesh):
    from tests.dist_checks import error_of
    pm, opt, sched, loader = _job(mesh, seed=2)
    return error_of(lambda: pm.load_checkpoint(directory, optimizer=opt, extra={"loader": loader, "lr": sched}))


def _version(directory, name: str, complete: bool = True) -> str:
    path = directory / name
    path.mkdir(parents=True)
    if complete:
        (path / ".metadata").write_bytes(b"")
        (path / "autosplit.json").write_text("{}")
    return name


def test_latest_checkpoint_and_leftover_versions(tmp_path):
    """latest_checkpoint: None before the first commit (no directory, or only an interrupted save);
    the committed version after.  A complete older version left by a commit whose clean-up did not finish
    is superseded, not 'incomplete ... interrupted': loading ignores it silently; a save that never
    finished is warned about by name."""
    import autosplit
    from autosplit.runtime.state.checkpoint_files import LATEST, resolve
    d = tmp_path / "run"
    assert autosplit.latest_checkpoint(d) is None
    partial = _version(d, "step-00000006-00000000000000aa", complete=False)
    assert autosplit.latest_checkpoint(d) is None
    old = _version(d, "step-00000002-00000000000000bb")
    new = _version(d, "step-00000004-00000000000000cc")
    (d / LATEST).write_text(new + "\n")
    assert autosplit.latest_checkpoint(d) == str(d / new)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve(d) == str(d / new)
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and partial in said[0] and "incomplete" in said[0] and old not in said[0], said
    (d / LATEST).write_text("step-00000009-00000000000000dd\n")
    with pytest.raises(autosplit.AutosplitError, match="missing or incomplete"):
        autosplit.latest_checkpoint(d)
