"""Numerics under parallelism (issue 8): accumulation under tp x dp, train/eval mode after tracing,
dropout masks under tensor parallelism, fp16 loss scaling, buffers under data parallelism.
Every check runs in real gloo processes and compares with single-device training where one exists."""
import pytest

from tests import checks_numerics as C

TOL = 1e-5


@pytest.mark.parametrize("name,kw", [("tp_timm", {"sequence_parallel": True}),
                                     ("tp_swiglu", {}),                       # qk-norm inside the region
                                     ("tp_hand", {"sequence_parallel": True})])
@pytest.mark.default_cases('tp_swiglu-kw1')
def test_no_sync_accumulation_tp_dp(pool4, name, kw):
    """Partial (tp-summed) gradients of no_sync steps are averaged over dp too."""
    for r in pool4.run(C.accumulate_tp_dp, name, **kw):
        assert r["param_diff"] <= TOL, r


FP16_TOL = 5e-4     # fp16 matmuls (10-bit mantissa), 5 SGD updates of a 4-block ViT; measured 6e-5


def test_fp16_scaler_against_fp32(pool4):
    """Unscale, growth after growth_interval clean steps, a skip when one rank overflows, one host
    sync in the whole step (the loss and the overflow verdict are read together); parameters within
    FP16_TOL of fp32 single-device training."""
    for r in pool4.run(C.fp16_training):
        assert r["skipped"] == [False, False, True, False, False, False], r
        s = r["scales"][0]
        assert r["scales"] == [s, s, 2 * s, s, s, 2 * s], r     # x2 after 2 clean steps, /2 on the skip
        # the first step also runs the once-per-plan agreement (plan fingerprint, parameter checksums)
        # every local parameter got a gradient (a count, not "> 10": the cut, and so the count, follows
        # the machine's measured profile)
        assert r["syncs"][1:] == [1] * 5 and r["grads"] == r["params"] > 0, r
        assert r["param_diff"] <= FP16_TOL and r["loss_diff"] <= FP16_TOL, r


@pytest.mark.parametrize("mesh", [(1, 1, 2), (2, 1, 2)])
@pytest.mark.default_cases('mesh0')
def test_buffers_identical_across_dp(request, mesh):
    """BatchNorm statistics: dp rank 0's are broadcast after each step (DDP's behaviour), so
    full_state_dict is the same on every rank and equals the replica-0 reference."""
    pool = request.getfixturevalue(f"pool{mesh[0] * mesh[1] * mesh[2]}")
    results = pool.run(C.buffers_under_dp, mesh)
    for r in results:
        spread = (r["state"] - results[0]["state"]).abs().max().item()
        assert spread == 0, f"full_state_dict differs across ranks by {spread}"
        assert r["buffer_diff"] <= TOL and r["param_diff"] <= TOL, {k: r[k] for k in ("buffer_diff", "param_diff")}


@pytest.mark.parametrize("mesh,kw", [((2, 1, 1), {}), ((1, 2, 1), {}), ((1, 2, 1), {"sequence_parallel": True}),
                                     ((2, 1, 1), {"drop_path": 0.2}), ((1, 2, 1), {"drop_path": 0.2})])
@pytest.mark.default_cases('mesh0-kw0')
def test_eval_mode_follows_pm_eval(pool2, mesh, kw):
    """Attention dropout (dropout_p frozen by tracing), nn.Dropout and DropPath (a `self.training`
    branch): after pm.eval() two predicts agree and equal the single-device model in eval mode;
    after pm.train() they drop."""
    for r in pool2.run(C.eval_mode, mesh, **kw):
        assert r["eval_repeat"] == 0 and r["eval_vs_ref"] <= TOL, r
        assert r["train_repeat"] > 1e-3 and r["train_vs_ref"] > 1e-3, r


def test_root_mode_branch_is_refused():
    """A `self.training` branch in the root's own forward cannot become a leaf: a clear TraceError."""
    import torch

    import autosplit

    class RootBranch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            x = self.fc(x)
            return x * 2 if self.training else x.relu()

    model = RootBranch()
    with pytest.raises(autosplit.AutosplitError, match=r"different operations in train and eval mode.*'mul'"):
        autosplit.compile(model, example_input=torch.randn(2, 4), device="cpu")
    assert model.training                               # the model's mode is restored


# dropout modules of the test ViT whose input is split across tp ranks, without / with sequence
# parallelism (fc1's hidden features; under sp also the token-sharded residual stream from pos_drop on)
SHARDED = {False: {"blocks.0.mlp.drop1", "blocks.1.mlp.drop1"},
           True: {"pos_drop"} | {f"blocks.{i}.{m}" for i in (0, 1) for m in ("mlp.drop1", "mlp.drop2", "attn.proj_drop")}}
REPLICATED = {False: {"pos_drop", "head_drop"} | {f"blocks.{i}.{m}" for i in (0, 1) for m in ("mlp.drop2", "attn.proj_drop")},
              True: {"head_drop"}}


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.default_cases('True')
def test_tp_dropout_masks(pool2, sp):
    """Masks differ across tp ranks where the activation is sharded, agree where it is replicated;
    the default RNG stream stays identical on every tp rank.  The forks seed only the generator the
    op draws from: torch.manual_seed also seeds every other device type's generators, formatting the
    Python stack for each one not initialized (1-1.5 ms a call, tens of ms a step)."""
    r0, r1 = pool2.run(C.tp_dropout_masks, sequence_parallel=sp)
    assert set(r0["masks"]) == SHARDED[sp] | REPLICATED[sp]
    for name in SHARDED[sp]:
        a, b = r0["masks"][name], r1["masks"][name]
        assert a.shape == b.shape and (a != b).float().mean() > 0.1, f"{name}: the same mask on both tp ranks"
    for name in REPLICATED[sp]:
        assert (r0["masks"][name] == r1["masks"][name]).all(), f"{name}: replicated masks differ across tp ranks"
    assert (r0["rng"] == r1["rng"]).all()
    assert r0["global_seeds"] == r1["global_seeds"] == 0, (r0["global_seeds"], r1["global_seeds"])


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.default_cases('False')
def test_block_checkpoint_replays_tp_dropout(pool2, sp):
    plain = pool2.run(C.checkpoint_replays_tp_dropout, None, sequence_parallel=sp)
    blocks = pool2.run(C.checkpoint_replays_tp_dropout, "block", sequence_parallel=sp)
    for a, b in zip(plain, blocks):
        assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
