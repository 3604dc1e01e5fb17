"""Sharded checkpoints (issue 10): save on one mesh, load on others, interrupted saves, export.

Real gloo processes.  The model is a meta-built timm ViT with timm's init written as an init_fn
(tests/test_meta_init.py), trained with AdamW; the reference is the same model materialized and
trained on one device.
"""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import timm
import torch

from tests.dist_pool import Pool
from tests.dist_checks import batches
from tests.models import VARIANTS
from tests.test_meta_init import SEED, TOL, _max_diff, _meta, adamw, reference, timm_init

STEPS, BATCH, MICRO = 4, 8, 2
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pm(mesh, lazy: bool = False, **kw):
    """lazy: no example_input; planned for the model's input size, re-planned at the first step."""
    import autosplit
    dp = mesh[2]
    xs, _ = batches(STEPS, BATCH)
    example = None if lazy else xs[0, :BATCH // dp // MICRO]
    return autosplit.parallelize(_meta("tp_timm"), mesh=mesh, num_microbatches=MICRO, seed=SEED, init_fn=timm_init,
                                 device="h100", example_input=example, **kw)


def _train(pm, opt, steps: range) -> list[float]:
    xs, ys = batches(STEPS, BATCH)
    rows = slice(pm.dp_rank * BATCH // pm.dp_size, (pm.dp_rank + 1) * BATCH // pm.dp_size)
    losses = []
    for i in steps:
        losses.append(pm.step(xs[i][rows], ys[i][rows]))
        opt.step()
        opt.zero_grad()
    return losses


def train_and_save(directory: str, mesh, **kw):
    """2 AdamW steps, then a checkpoint; returns the losses and the replica's logits after them."""
    pm = _pm(mesh, **kw)
    opt = adamw(pm.parameters())
    losses = _train(pm, opt, range(2))
    path = pm.save_checkpoint(directory, optimizer=opt)
    xs, _ = batches(STEPS, BATCH)
    logits = pm.predict(xs[0][:BATCH // pm.dp_size])
    return {"losses": losses, "path": path, "logits": logits}


def load_and_train(directory: str, mesh, **kw):
    """A fresh meta model on ``mesh``; load the checkpoint (model and AdamW state); 2 more steps."""
    pm = _pm(mesh, **kw)
    opt = adamw(pm.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = pm.load_checkpoint(directory, optimizer=opt)
    losses = _train(pm, opt, range(2, 4))
    state = pm.full_state_dict()
    return {"losses": losses, "record": record, "state": state if torch.distributed.get_rank() == 0 else None,
            "step": pm.step_count, "warnings": [str(w.message) for w in caught]}


@pytest.fixture(scope="module")
def saved(pool4, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ckpt") / "run")
    return directory, pool4.run(train_and_save, directory, (2, 2, 1))


@pytest.fixture(scope="module")
def uninterrupted():
    return reference("tp_timm", STEPS)


@pytest.mark.parametrize("mesh,kw", [((4, 1, 1), {"schedule": "gpipe"}), ((1, 2, 2), {"sequence_parallel": True}),
                                     ((1, 1, 1), {"lazy": True})])
@pytest.mark.default_cases('mesh1-kw1')
def test_resume_on_another_mesh(request, saved, uninterrupted, mesh, kw):
    """Saved on (2, 2, 1) after 2 steps; loaded on another mesh (schedule, sequence parallelism), 2 more
    steps: the same losses and parameters as 4 uninterrupted single-device steps."""
    directory, first = saved
    ref_losses, ref_state = uninterrupted
    assert max(abs(a - b) for a, b in zip(first[0]["losses"], ref_losses[:2])) <= TOL
    pool = request.getfixturevalue("pool1" if mesh == (1, 1, 1) else "pool4")
    results = pool.run(load_and_train, directory, mesh, **kw)
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses[2:])) <= TOL, (r["losses"], ref_losses)
        assert r["step"] == 4 and r["record"]["step"] == 2 and r["record"]["mesh"] == [2, 2, 1], r["record"]
        assert r["warnings"] == []
    assert _max_diff(results[0]["state"], ref_state) <= TOL


@pytest.mark.slow       # a further save and resume: from FSDP shards, into 2D
def test_save_sharded_over_dp_resume_in_2d(pool4, uninterrupted, tmp_path):
    """Saved from FSDP2-sharded (dp_shard) tp shards on (1, 2, 2), resumed under 2D tensor parallelism
    on (1, 4, 1): the same as 4 uninterrupted single-device steps."""
    ref_losses, ref_state = uninterrupted
    directory = str(tmp_path / "run")
    first = pool4.run(train_and_save, directory, (1, 2, 2), dp_shard="stage")
    assert max(abs(a - b) for a, b in zip(first[0]["losses"], ref_losses[:2])) <= TOL
    results = pool4.run(load_and_train, directory, (1, 4, 1), tp_mode="2d")
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses[2:])) <= TOL, (r["losses"], ref_losses)
    assert _max_diff(results[0]["state"], ref_state) <= TOL


def test_export_loads_into_the_unchanged_model(saved, tmp_path):
    """python -m autosplit export: a plain state dict the unchanged timm model loads (strict), giving
    the logits the parallel model predicted."""
    directory, first = saved
    out = tmp_path / "model.pt"
    run = subprocess.run([sys.executable, "-m", "autosplit", "export", directory, str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    model = VARIANTS["tp_timm"]()
    model.load_state_dict(torch.load(out))
    xs, _ = batches(STEPS, BATCH)
    with torch.no_grad():
        assert (model(xs[0]) - first[0]["logits"]).abs().max().item() <= TOL


def save_then_crash(directory: str, crash_rank: int):
    """Save a complete checkpoint; one more step; save again, with ``crash_rank`` dying while it writes."""
    import torch.distributed.checkpoint.filesystem as fs
    pm = _pm((1, 2, 1), timeout_s=8)     # the survivor waits this long in DCP for the dead rank
    opt = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
    _train(pm, opt, range(1))
    pm.save_checkpoint(directory, optimizer=opt)
    saved = {n: p.detach().clone() for n, p in pm.named_parameters()}
    momentum = {n: opt.state[p]["momentum_buffer"].clone() for n, p in pm.named_parameters()}
    _train(pm, opt, range(1, 2))
    if torch.distributed.get_rank() == crash_rank:
        def die(*args, **kwargs):
            os._exit(1)
        fs.FileSystemWriter.write_data = die
    try:
        pm.save_checkpoint(directory, optimizer=opt)
        error = None
    except Exception as exc:   # the surviving rank: DCP's collectives fail when the peer dies
        error = f"{type(exc).__name__}: {exc}"
    return {"params": saved, "momentum": momentum, "error": error}


def load_previous(directory: str):
    pm = _pm((1, 2, 1))
    opt = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm.load_checkpoint(directory, optimizer=opt)
    return {"params": {n: p.detach().clone() for n, p in pm.named_parameters()},
            "momentum": {n: opt.state[p]["momentum_buffer"] for n, p in pm.named_parameters()},
            "warnings": [str(w.message) for w in caught]}


def load_error(directory: str):
    from tests.dist_checks import error_of
    pm = _pm((1, 2, 1))
    return error_of(pm.load_checkpoint, directory)


@pytest.mark.slow          # 20 s; the default tier checks checkpoint safety in test_checkpoint_safety.py
def test_interrupted_save_is_ignored(pool2, tmp_path):
    """A rank killed while writing: LATEST still names the previous version, which loads (with a
    warning naming the incomplete one); a directory with only an interrupted save refuses to load."""
    directory = str(tmp_path / "run")
    crashing = Pool(2)
    try:
        out = crashing.run_raw(save_then_crash, directory, 1, expect=1, timeout=120)
    finally:
        crashing.close(force=True)
    ok, before = out[0]
    assert ok and before["error"] is not None, out
    versions = sorted(d for d in os.listdir(directory) if d.startswith("step-"))
    latest = open(os.path.join(directory, "LATEST")).read().strip()
    assert len(versions) == 2 and latest == versions[0], (versions, latest)     # step 1 committed, step 2 not
    results = pool2.run(load_previous, directory)
    r = results[0]
    assert any("ignoring incomplete checkpoint" in w and versions[1] in w for w in r["warnings"]), r["warnings"]
    assert _max_diff(r["params"], before["params"]) == 0 and _max_diff(r["momentum"], before["momentum"]) == 0
    only_partial = tmp_path / "partial"
    only_partial.mkdir()
    os.rename(os.path.join(directory, versions[1]), only_partial / versions[1])
    errors = pool2.run(load_error, str(only_partial))
    assert all("holds no complete checkpoint" in e and "never committed" in e for e in errors), errors


def test_dcp_tools_read_model_and_optimizer_by_name(saved, uninterrupted, tmp_path):
    """DCP's own ``dcp_to_torch_save`` reads the (2, 2, 1) checkpoint as one dict: the model under its
    names and the optimizer in torch's layout (``get_optimizer_state_dict``'s, by parameter name), which
    ``set_optimizer_state_dict`` puts into a fresh AdamW of the unchanged model; 2 more single-device
    steps then equal 4 uninterrupted ones."""
    import autosplit
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    directory, first = saved
    ref_losses, ref_state = uninterrupted
    out = tmp_path / "all.pt"
    dcp_to_torch_save(first[0]["path"], out)
    sd = torch.load(out)                         # weights_only: tensors and plain Python values, nothing pickled
    model = autosplit.materialize(_meta("tp_timm"), seed=SEED, init_fn=timm_init)
    assert set(sd) == set(model.state_dict()) | {"optimizer", "rng"}, set(sd) - set(model.state_dict())
    model.load_state_dict({k: sd[k] for k in model.state_dict()})
    opt = adamw(model.parameters())
    layout = get_optimizer_state_dict(model, adamw(model.parameters()))     # torch's, for its structure
    assert set(sd["optimizer"]["state"]) == set(layout["state"]) == {n for n, _ in model.named_parameters()}
    assert [g["params"] for g in sd["optimizer"]["param_groups"]] == [g["params"] for g in layout["param_groups"]]
    qkv = sd["optimizer"]["state"]["blocks.0.attn.qkv.weight"]
    assert qkv["exp_avg"].shape == model.blocks[0].attn.qkv.weight.shape and qkv["step"].item() == 2
    set_optimizer_state_dict(model, opt, sd["optimizer"])
    xs, ys = batches(STEPS, BATCH)
    losses = []
    for i in range(2, STEPS):
        loss = torch.nn.functional.cross_entropy(model(xs[i]), ys[i])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert max(abs(a - b) for a, b in zip(losses, ref_losses[2:])) <= TOL, (losses, ref_losses[2:])
    assert _max_diff(model.state_dict(), ref_state) <= TOL
