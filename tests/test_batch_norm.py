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
from tests.models_bn import BN_VARIANTS, LinearNorm

TOL = 1e-7          # float64 models (tests/checks_bn.py says why): parameters and running statistics; measured
                    # <= 3e-9, against 0.2-1.3 (running_var) and 6 (num_batches_tracked) for the bug fixed here
LOSS_TOL = 1e-6     # the step's loss comes back as a float32-accurate mean


@pytest.mark.parametrize("name", ["xcit", "levit"])
@pytest.mark.parametrize("mesh,kw", [((2, 1, 1), {}), ((1, 2, 1), {}), ((1, 1, 2), {}),
                                     # recomputation in backward must not update the statistics again
                                     ((2, 1, 1), {"recompute": "stage"}), ((1, 2, 1), {"recompute": "block"}),
                                     ((1, 1, 2), {"recompute": "block", "dp_shard": "layer"})],
                         ids=["pp", "tp", "dp", "pp-ckpt-stage", "tp-ckpt-block", "dp-fsdp-ckpt-block"])
@pytest.mark.default_cases("tp-xcit", "dp-xcit", "pp-ckpt-stage-levit")     # each axis, recomputation, each model
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
    assert found == [("<root> batch_norm", "F.batch_norm"), ("block.1", "BatchNorm2d")], found
    assert len(caught) == 1 and "2 BatchNorm layers" in caught[0], caught


@pytest.mark.parametrize("name,provisional", [("levit", 2), ("xcit", 1)])
@pytest.mark.default_cases("levit-2")
def test_parallelize_warns_once(pool2, name, provisional):
    """parallelize warns once (on rank 0: one warning per job, not per rank), also when it plans twice
    (a provisional plan, then the first step's), with the step's microbatch size, not the provisional
    plan's; the summary carries the note on every rank.  The provisional plan takes 2 rows only where a
    layer would see one value per channel in one row (levit's BatchNorm1d on (B, C) features; xcit has
    only BatchNorm2d, H*W values per channel in a row)."""
    results = pool2.run(C.parallelize_warnings, name)
    for r in results:
        assert r["rows"] == (provisional, 4), r["rows"]      # planned twice: provisional, then the step's
        assert len(r["warnings"]) == (1 if r["rank"] == 0 else 0), r["warnings"]
        for text in r["warnings"]:
            assert "2 microbatches of 4 samples" in text and "the step's 8 samples" in text, text
        assert "BatchNorm layers" in r["summary"] and "per microbatch" in r["summary"], r["summary"]


class _TokenNorm(nn.Module):
    """Tokens flattened into rows before a BatchNorm1d (LeViT's LinearNorm): (B*N, C), N values per row."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 8, 8)
        self.norm = LinearNorm(8, 8)

    def forward(self, x):                                          # (B, 3, 32, 32)
        return self.norm(self.conv(x).flatten(2).transpose(1, 2))  # (B, 16, 8)


class _PooledNorm(nn.Module):
    """A BatchNorm2d after global pooling: (B, C, 1, 1), one value per channel per row."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 8, 8)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        return self.bn(self.conv(x).mean(dim=(2, 3), keepdim=True)).flatten(1)


@pytest.mark.parametrize("name,rows,why", [
    ("xcit", 1, None), ("tokens", 1, None),
    ("levit", 2, "head_bn (BatchNorm1d, batch statistics in training mode) sees 1 value per channel per row "
                 "(2 at 2 rows)"),
    ("pooled", 2, "bn (BatchNorm2d, batch statistics in training mode) sees 1 value per channel per row"),
    ("leaf", 2, "block.1 (BatchNorm2d, batch statistics in training mode) is inside a leaf module")])
def test_fewest_microbatch_rows_from_the_graph(name, rows, why):
    """Values per channel per row at each batch-statistics layer's input, from the traced graph: a
    microbatch needs 2 rows only where some layer sees one (or cannot be seen: inside a leaf module)."""
    from autosplit.strategy.layout import fewest_microbatch_rows, trace_model
    models = {"xcit": BN_VARIANTS["xcit"], "levit": BN_VARIANTS["levit"], "tokens": _TokenNorm,
              "pooled": _PooledNorm, "leaf": FunctionalBN}
    leaves = (nn.Sequential,) if name == "leaf" else ()
    got, reason = fewest_microbatch_rows(trace_model(models[name](), (torch.empty(1, 3, 32, 32),), leaves))
    assert got == rows, (got, reason)
    assert (reason is None) if why is None else (why in reason), reason


def test_recomputation_copies_only_the_buffers_its_forward_writes(monkeypatch):
    """A checkpointed layer's recomputation restores the buffers its forward wrote (a BatchNorm's
    statistics: updated once per microbatch) and copies none of a layer that only reads its buffers."""
    from autosplit.runtime.stage.checkpointing import Checkpointed

    class ReadsBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("scale", torch.full((4,), 2.0))

        def forward(self, x):
            return self.lin(x) * self.scale

    cloned, clone = [], torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda t, *a, **k: cloned.append(t) or clone(t, *a, **k))
    stats = ("running_mean", "running_var", "num_batches_tracked")
    for model, x, written in ((ReadsBuffer(), torch.randn(3, 4), set()),
                              (nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), torch.randn(3, 4),
                               {f"1.{s}" for s in stats}),
                              (FunctionalBN(), torch.randn(3, 3, 8, 8),
                               {"mean", "var", *(f"block.1.{s}" for s in stats)})):
        layer = torch.fx.symbolic_trace(model)     # a stage's layers are graphs (runtime/stage/checkpointing.py)
        out = Checkpointed(layer)(x.requires_grad_())
        after = {n: b.clone() for n, b in layer.named_buffers()}
        cloned.clear()
        out.sum().backward()                         # the recomputation
        names = {id(b): n for n, b in layer.named_buffers()}
        assert {names[id(t)] for t in cloned if id(t) in names} == written, model
        for n, b in layer.named_buffers():          # as after the forward: updated once per microbatch
            assert torch.equal(b, after[n]), n
