"""examples/train.py: a timm model on an image folder under torchrun.

A tiny vit_tiny_patch16_224 (32x32 input, patch 8, depth 2) on a generated folder of 3 classes: two
pipeline stages for 2 steps with a checkpoint, then a resume of it, built on the meta device, for one more
step; also one process at mesh (1,1,1) for 3 steps, whose losses both runs must match.  Every run is a
torchrun: the e2e tier.  The learning rate stays in its warmup (--warmup-steps 10), so it does not depend
on --steps.
"""
import re
import sys

import pytest

from tests.test_examples import EXAMPLES, _run

MODEL = ["--model", "vit_tiny_patch16_224", "--model-kwargs", '{"img_size": 32, "patch_size": 8, "depth": 2}']
COMMON = ["--global-batch", "8", "--num-microbatches", "2", "--epochs", "1", "--warmup-steps", "10", "--lr", "1e-3",
          "--workers", "0", "--log-every", "1"]
METRICS = re.compile(r"^step (\d+): loss (\d+\.\d{4})  lr (\S+)  (\d+\.\d) img/s  (\d+\.\d{3}) s/step$", re.M)


def _train(cwd, nproc: int, *args: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(EXAMPLES / "train.py"), *MODEL, *COMMON, *args]
    stdout, log = _run(cmd, cwd)
    return stdout, {int(m[0]): float(m[1]) for m in METRICS.findall(stdout)}


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """3 classes x 8 images of 40x40 in train/ and val/: a class colour plus noise."""
    from PIL import Image
    import numpy as np
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c, colour in enumerate([(200, 40, 40), (40, 200, 40), (40, 40, 200)]):
            (root / split / f"class{c}").mkdir(parents=True)
            for i in range(8):
                pixels = np.clip(rng.normal(colour, 40, (40, 40, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(root / split / f"class{c}" / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def two_stages(image_folder, tmp_path_factory):
    """mesh (2,1,1) on 2 processes, 2 steps, a checkpoint at the end."""
    ckpt = tmp_path_factory.mktemp("two_stages") / "ckpt"
    stdout, losses = _train(ckpt.parent, 2, "--data", str(image_folder), "--mesh", "2,1,1", "--steps", "2",
                            "--checkpoint-dir", str(ckpt))
    return stdout, losses, ckpt


@pytest.fixture(scope="module")
def one_process(image_folder, tmp_path_factory):
    """The same run on one process, mesh (1,1,1), for 3 steps."""
    return _train(tmp_path_factory.mktemp("one_process"), 1, "--data", str(image_folder), "--mesh", "1,1,1", "--steps", "3")[1]


@pytest.mark.e2e         # torchrun; the default tier's CLI subprocess test is test_checkpoint's export
def test_train_image_folder_two_stages(two_stages):
    """Exit 0 (checked by _run), one plan, a metrics line per step, val accuracy, a committed checkpoint."""
    stdout, losses, ckpt = two_stages
    assert stdout.count("autosplit plan: mesh (pp=2, tp=1, dp=1), 2 stages") == 1    # rank 0 only
    assert "24 train / 24 val images, 3 classes" in stdout
    lines = METRICS.findall(stdout)
    assert [int(m[0]) for m in lines] == [1, 2], stdout
    assert [float(m[2]) for m in lines] == [1e-4, 2e-4]       # warmup: lr * (step + 1) / 10
    assert re.search(r"^epoch 1/1: step 2, .*; val accuracy \d+\.\d+% on 24 images$", stdout, re.M), stdout
    assert "done: 2 steps" in stdout
    versions = [p.name for p in ckpt.iterdir() if p.name.startswith("step-")]
    assert (ckpt / "LATEST").read_text().strip() in versions and versions[0].startswith("step-00000002-")


@pytest.fixture(scope="module")
def resumed(image_folder, two_stages, tmp_path_factory):
    """--resume of the 2-stage run to --steps 3, with --meta: shapes only, then the checkpoint's values."""
    ckpt = tmp_path_factory.mktemp("resumed") / "ckpt"
    stdout, losses = _train(ckpt.parent, 2, "--data", str(image_folder), "--mesh", "2,1,1", "--steps", "3",
                            "--meta", "--resume", str(two_stages[2]), "--checkpoint-dir", str(ckpt))
    return stdout, losses, ckpt


@pytest.mark.e2e
def test_train_resume_one_more_step(resumed):
    """The resumed run continues at step 2 (mid-epoch) for exactly one step and checkpoints step 3."""
    stdout, losses, ckpt = resumed
    assert "built on meta" in stdout
    assert re.search(r"^resumed from \S+ at step 2 \(saved on mesh \(2, 1, 1\)\)$", stdout, re.M), stdout
    assert sorted(losses) == [3], stdout
    assert "done: 3 steps" in stdout
    assert (ckpt / "LATEST").read_text().startswith("step-00000003-")


@pytest.mark.e2e
def test_train_matches_one_process(two_stages, resumed, one_process):
    """Two pipeline stages compute what one process computes, and the resumed step is the uninterrupted
    run's: the same loss at steps 1 and 2 (2 stages) and 3 (resumed)."""
    losses = {**two_stages[1], **resumed[1]}
    assert sorted(losses) == [1, 2, 3] and sorted(one_process) == [1, 2, 3], (losses, one_process)
    assert all(abs(losses[s] - one_process[s]) <= 2e-4 for s in losses), (losses, one_process)


def test_train_and_cifar_share_one_flag_vocabulary():
    """Both scripts take the same flags with the same meaning (parse level)."""
    from examples import train, train_cifar10
    shared = ["--mesh", "1,2,1", "--schedule", "gpipe", "--tp-mode", "2d", "--global-batch", "64",
              "--num-microbatches", "4", "--autocast", "fp16", "--recompute", "block", "--dp-shard", "layer",
              "--sequence-parallel", "--compile-stages", "--epochs", "3", "--steps", "5", "--lr", "0.01",
              "--weight-decay", "0", "--warmup-steps", "2", "--workers", "0", "--checkpoint-dir", "c",
              "--save-every", "7", "--resume", "c", "--report", "r", "--log-every", "3", "--seed", "5"]
    ours = vars(train.parse_args(["--model", "vit_tiny_patch16_224", "--data", "cifar10", *shared]))
    cifar = vars(train_cifar10.parse_args(shared))
    names = [flag[2:].replace("-", "_") for flag in shared if flag.startswith("--")]
    assert {n: ours[n] for n in names} == {n: cifar[n] for n in names}
    assert (ours["global_batch"], ours["autocast"], ours["recompute"], ours["dp_shard"]) == (64, "fp16", "block", "layer")
