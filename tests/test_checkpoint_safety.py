"""Untrusted checkpoints run no code (issue 50, item 9): every pickle in a checkpoint loads against an allow-list
(autosplit/runtime/state/safe_load.py).

A real checkpoint from 2 gloo ranks (tensor parallel (1, 2, 1): AdamW, a scheduler and a per-rank extra),
copied and then tampered with as an attacker would: ``.metadata`` or one byte entry made to call
``os.system("touch <marker>")`` when unpickled.  ``pm.load_checkpoint`` and ``autosplit export`` must refuse
it with an AutosplitError naming the file and the global, on every rank, and the marker must not appear.

Terms:
  byte entry -- a Python value in the checkpoint (``torch.save`` bytes inside a rank's ``.distcp`` file):
                ``optimizer.param_groups.0.lr`` (read by every rank) or ``mine.rank_0.rank`` (an extra that
                differs per rank, so only rank 0 reads it: the other rank learns of the refusal from DCP).
"""
from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil

import pytest
import timm
import torch

from autosplit.errors import AutosplitError

MESH, BATCH, MICRO = (1, 2, 1), 4, 2
REFUSED = "refuses global 'posix.system' (not on autosplit's allow-list of checkpoint types)"


class Evil:
    """Unpickles as ``os.system(cmd)``: what an attacker puts into a pickle."""

    def __init__(self, cmd: str):
        self.cmd = cmd

    def __reduce__(self):
        return os.system, (self.cmd,)


class Mine:
    """An extra whose state differs per rank (layout per_rank: only rank r reads ``mine.rank_<r>``)."""

    def __init__(self):
        self.loaded = None

    def state_dict(self):
        return {"rank": torch.distributed.get_rank()}

    def load_state_dict(self, state):
        self.loaded = state


def _model():
    torch.manual_seed(0)
    return timm.models.VisionTransformer(img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2, mlp_ratio=2,
                                         num_classes=4)


def _job():
    import autosplit
    pm = autosplit.parallelize(_model(), mesh=MESH, num_microbatches=MICRO, device="h100",
                               example_input=torch.randn(BATCH // MICRO, 3, 16, 16))
    opt = torch.optim.AdamW(pm.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return pm, opt, sched, Mine()


def save(directory: str):
    """One AdamW step and a scheduler step, then a checkpoint; returns what a load must restore."""
    pm, opt, sched, mine = _job()
    g = torch.Generator().manual_seed(1)
    pm.step(torch.randn(BATCH, 3, 16, 16, generator=g), torch.randint(0, 4, (BATCH,), generator=g))
    opt.step()
    sched.step()
    pm.save_checkpoint(directory, optimizer=opt, extra={"lr": sched, "mine": mine})
    return {"lr": opt.param_groups[0]["lr"], "state": pm.full_state_dict()}


def load(directory: str):
    """A fresh job loads ``directory``: the error as 'Type: message', or what it restored."""
    pm, opt, sched, mine = _job()
    try:
        record = pm.load_checkpoint(directory, optimizer=opt, extra={"lr": sched, "mine": mine})
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None, "step": record["step"], "lr": opt.param_groups[0]["lr"], "mine": mine.loaded,
            "moments": sum(len(s) for s in opt.state.values()), "state": pm.full_state_dict()}


@pytest.fixture(scope="module")
def saved(pool2, tmp_path_factory):
    directory = tmp_path_factory.mktemp("safety") / "run"
    return str(directory), pool2.run(save, str(directory))


def _copy(saved, tmp_path) -> tuple[str, str]:
    """A copy of the checkpoint to tamper with, and its version directory."""
    directory = str(tmp_path / "run")
    shutil.copytree(saved[0], directory)
    with open(os.path.join(directory, "LATEST")) as f:
        return directory, os.path.join(directory, f.read().strip())


def _read_metadata(version: str):
    with open(os.path.join(version, ".metadata"), "rb") as f:
        return pickle.load(f)       # the test's own, untampered file


def _write_metadata(version: str, metadata) -> None:
    with open(os.path.join(version, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)


def _tamper_metadata(version: str, marker: str) -> None:
    """The real metadata with an Evil among its planner data: allowed globals first, then posix.system."""
    metadata = _read_metadata(version)
    metadata.planner_data["innocent"] = Evil(f"touch {marker}")
    _write_metadata(version, metadata)


def _tamper_entry(version: str, key: str, marker: str) -> str:
    """Replace byte entry ``key`` by a torch.save'd Evil (appended to its data file, the metadata pointed at
    it); returns the data file's path."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    metadata = _read_metadata(version)
    index = MetadataIndex(key)
    info = metadata.storage_data[index]
    path = os.path.join(version, info.relative_path)
    payload = io.BytesIO()
    torch.save(Evil(f"touch {marker}"), payload)
    with open(path, "ab") as f:
        offset = f.seek(0, os.SEEK_END)
        f.write(payload.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload.getvalue()))
    _write_metadata(version, metadata)
    return path


def _export(directory: str, out: str, capsys) -> tuple[int, str]:
    from autosplit.__main__ import main
    rc = main(["export", directory, out])
    return rc, capsys.readouterr().err


def test_tampered_metadata_is_refused(pool2, saved, tmp_path, capsys):
    """A ``.metadata`` that calls os.system: load_checkpoint refuses it on every rank, export too, naming
    the file and the global; nothing ran."""
    directory, version = _copy(saved, tmp_path)
    marker = str(tmp_path / "pwned")
    _tamper_metadata(version, marker)
    expected = f"{os.path.join(version, '.metadata')}: {REFUSED}"
    for r in pool2.run(load, directory):
        assert r["error"] is not None and r["error"].startswith("AutosplitError") and expected in r["error"], r
    rc, err = _export(directory, str(tmp_path / "model.pt"), capsys)
    assert rc == 2 and expected in err, err
    with pytest.raises(AutosplitError, match="posix.system"):
        from autosplit.runtime.state.checkpoint_files import export_state_dict
        export_state_dict(directory, str(tmp_path / "model.pt"))
    assert not os.path.exists(marker)
    assert not os.path.exists(tmp_path / "model.pt")


@pytest.mark.parametrize("key", ["optimizer.param_groups.0.lr", "mine.rank_0.rank"])
@pytest.mark.default_cases('optimizer.param_groups.0.lr')
def test_tampered_byte_entry_is_refused(pool2, saved, tmp_path, capsys, key):
    """A byte entry that calls os.system: load_checkpoint refuses it on every rank (also on rank 1 for the
    entry only rank 0 reads), naming the data file, the entry and the global; nothing ran.  Export reads
    the model's tensors only, so it never unpickles the entry and still works."""
    directory, version = _copy(saved, tmp_path)
    marker = str(tmp_path / "pwned")
    data_file = _tamper_entry(version, key, marker)
    expected = f"{data_file} (entry '{key}'): {REFUSED}"
    for r in pool2.run(load, directory):
        assert r["error"] is not None and r["error"].startswith("AutosplitError") and expected in r["error"], r
    assert not os.path.exists(marker)
    rc, err = _export(directory, str(tmp_path / "model.pt"), capsys)
    assert rc == 0, err
    assert not os.path.exists(marker)


@pytest.mark.parametrize("target", [os.system, eval, getattr, shutil.rmtree])
def test_metadata_allow_list(tmp_path, target):
    """Any global off the list is refused by name, even one nested inside DCP's own classes."""
    from autosplit.runtime.state.safe_load import read_metadata_file
    from torch.distributed.checkpoint.metadata import Metadata

    class Call:
        def __reduce__(self):
            return target, ("x",)
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(Metadata(state_dict_metadata={}, planner_data={"k": Call()})))
    name = f"{target.__module__}.{target.__qualname__}"
    with pytest.raises(AutosplitError, match=f"{path}: refuses global '{name}'"):
        read_metadata_file(str(path))


def test_genuine_checkpoint_loads_and_exports(pool2, saved, tmp_path, capsys):
    """The untampered checkpoint: every rank restores the model, AdamW's moments, the scheduler's lr and
    its own extra; export writes the state dict the unchanged model loads."""
    directory, first = saved
    for rank, r in enumerate(pool2.run(load, directory)):
        assert r["error"] is None, r["error"]
        assert r["step"] == 1 and r["lr"] == first[rank]["lr"] and r["mine"] == {"rank": rank}, r
        assert r["moments"] > 0
        if rank == 0:
            assert all(torch.equal(r["state"][k], first[0]["state"][k]) for k in first[0]["state"])
    out = str(tmp_path / "model.pt")
    rc, err = _export(directory, out, capsys)
    assert rc == 0, err
    model = _model()
    model.load_state_dict(torch.load(out, weights_only=True))
    assert all(torch.equal(v, first[0]["state"][k]) for k, v in model.state_dict().items())
