"""BatchNorm under microbatches, tensor and data parallelism (issue 33, item 1).

Semantics (docs/design.md, "BatchNorm: per-microbatch, per-replica statistics"): each microbatch is
normalized with its own statistics (GPipe), each dp replica with its own rows (DDP without
SyncBatchNorm); the running statistics are updated once per microbatch in microbatch order and, under
dp, are dp rank 0's after every step (DDP's broadcast_buffers).  The single-device reference with those
semantics is gradient accumulation over the same microbatches (tests/checks_bn.py).
"""
import warnings

import pytest
import torch
from torch import nn

import autosplit
from autosplit.passes.batch_norm import BatchNormStatisticsWarning, paths_label
from tests import checks_bn as C
from tests.models import VARIANTS
from tests.models_bn import BN_VARIANTS

TOL = 1e-7          # float64 models (tests/checks_bn.py says why): parameters and running statistics; measured
                    # <= 3e-9, against 0.2-1.3 (running_var) and 6 (num_batches_tracked) for the bug fixed here
LOSS_TOL = 1e-6     # the step's loss comes back as a float32-accurate mean


@pytest.mark.parametrize("name", ["xcit", "levit"])
@pytest.mark.parametrize("mesh,kw", [((2, 1, 1), {}), ((1, 2, 1), {}), ((1, 1, 2), {}),
                                     # recomputation in backward must not update the statistics again
                                     ((2, 1, 1), {"checkpoint": "stage"}), ((1, 2, 1), {"checkpoint": "block"}),
                                     ((1, 1, 2), {"checkpoint": "block", "dp_shard": "layer"})],
                         ids=["pp", "tp", "dp", "pp-ckpt-stage", "tp-ckpt-block", "dp-fsdp-ckpt-block"])
def test_equals_gradient_accumulation(pool2, name, mesh, kw):
    """Losses, parameters and running statistics after 3 AdamW steps, then an eval-mode predict, equal
    single-device gradient accumulation over the same microbatches."""
    for r in pool2.run(C.train_matches_accumulation, name, mesh, **kw):
        assert r["n_stats"] >= 3 * 4, r         # 2+ BatchNorms inside the blocks besides the stem's 2
        assert r["loss_diff"] <= LOSS_TOL, r
        assert r["param_diff"] <= TOL and r["stats_diff"] <= TOL and r["eval_diff"] <= TOL, r


def _bn_paths(model: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _compile_recording(model, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autosplit.compile(model, example_input=torch.randn(2, 3, 32, 32), **kw)
    return plan, [str(w.message) for w in caught if issubclass(w.category, BatchNormStatisticsWarning)]


@pytest.mark.parametrize("name", ["xcit", "levit"])
def test_summary_and_warning_name_the_layers(name):
    """compile: the summary's note and exactly one warning name every BatchNorm layer and say what it
    computes (per microbatch; per replica under dp)."""
    torch.manual_seed(0)
    model = BN_VARIANTS[name]()
    plan, caught = _compile_recording(model, mesh=(2, 1, 2), num_microbatches=4)
    paths = _bn_paths(model)
    assert [layer.path for layer in plan.batch_norms] == paths
    assert len(caught) == 1, caught
    summary = plan.summary()
    for text in (summary, caught[0]):
        assert f"{len(paths)} BatchNorm layers" in text, text
        assert "per microbatch" in text and "GPipe" in text, text
        assert "per replica" in text and "dp=2" in text, text
        assert "4 microbatches of 2 samples" in text, text
    named = paths_label(paths)
    assert named in summary and named in caught[0], (named, summary)


def test_paths_label():
    """Every path named once; numbered siblings that differ in one index merged into a range."""
    paths = ["stem.0.1", "stem.2.1", "blocks.0.attn.qkv.bn", "blocks.0.mlp.bn", "blocks.1.attn.qkv.bn",
             "blocks.1.mlp.bn", "blocks.3.attn.qkv.bn", "head_bn"]
    assert paths_label(paths) == "stem.{0,2}.1, blocks.{0-1,3}.attn.qkv.bn, blocks.{0-1}.mlp.bn, head_bn"
    assert paths_label(["a.0.b.1.bn", "a.0.b.2.bn", "a.1.b.0.bn"]) == "a.0.b.{1-2}.bn, a.1.b.0.bn"


def test_no_note_where_statistics_are_the_batch():
    """One microbatch and dp=1 (the statistics are the step's batch), a model in eval mode (running
    statistics are read, not computed) and a model without BatchNorm: no note, no warning."""
    torch.manual_seed(0)
    for model, kw in ((BN_VARIANTS["levit"](), dict(mesh=(1, 1, 1), num_microbatches=1)),
                      (BN_VARIANTS["levit"]().eval(), dict(mesh=(2, 1, 1), num_microbatches=2)),
                      (VARIANTS["timm_cls"](), dict(mesh=(2, 1, 1), num_microbatches=2))):
        plan, caught = _compile_recording(model, **kw)
        assert caught == [] and "BatchNorm" not in plan.summary(), plan.summary()
    # the layers are still found (plan.batch_norms), only the note is not needed
    plan, _ = _compile_recording(BN_VARIANTS["levit"](), mesh=(1, 1, 1), num_microbatches=1)
    assert len(plan.batch_norms) == len(_bn_paths(BN_VARIANTS["levit"]()))


class FunctionalBN(nn.Module):
    """F.batch_norm with ``training=self.training`` (a mode constant: trace_modes' ModeSwitch), and a
    BatchNorm inside a module the user declares a leaf."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 4, 4)
        self.register_buffer("mean", torch.zeros(8))
        self.register_buffer("var", torch.ones(8))
        self.block = nn.Sequential(nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8))
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        x = nn.functional.batch_norm(self.conv(x), self.mean, self.var, training=self.training)
        x = nn.functional.batch_norm(self.block(x), self.mean, self.var, training=False)   # running stats only
        return self.head(x.mean(dim=(2, 3)))


def test_functional_and_leaf_batch_norm_found_from_the_graph():
    plan, caught = _compile_recording(FunctionalBN(), mesh=(1, 1, 2), num_microbatches=2,
                                      leaf_modules=[nn.Sequential])
    found = [(layer.path, layer.kind) for layer in plan.batch_norms]
    assert found == [("(model forward) batch_norm", "F.batch_norm"), ("block.1", "BatchNorm2d")], found
    assert len(caught) == 1 and "2 BatchNorm layers" in caught[0], caught


def test_parallelize_warns_once(pool2):
    """parallelize warns once (on rank 0: one warning per job, not per rank), also when it plans twice
    (a provisional plan, then the first step's); the summary carries the note on every rank."""
    results = pool2.run(C.parallelize_warnings)
    for r in results:
        assert r["rows"] == (2, 4), r["rows"]     # planned twice; the provisional plan takes 2 rows for BatchNorm
        assert len(r["warnings"]) == (1 if r["rank"] == 0 else 0), r["warnings"]
        assert "BatchNorm layers" in r["summary"] and "per microbatch" in r["summary"], r["summary"]
