"""Sequence parallelism over a token dim tp does not divide (a class token's 17 tokens): the padding
rows never make a real value non-finite.  Terms: tests/checks_sp_padding.py (ghost row, zero-unsafe)."""
import pytest
import torch

from autosplit.tp import ops
from tests.checks_sp_padding import padded_collectives, sp_training

TOL = 1e-5
NORMS = ["rsqrt", "normdiv"]


def test_pad_copies_the_last_row_of_an_activation_and_zeros_a_gradient():
    x = torch.arange(10.).reshape(5, 2).requires_grad_()                  # (5, 2): 5 rows, padded to 8
    copied, zeroed = ops.pad(x, 0, 4, "copy"), ops.pad(x, 0, 4, "zero")
    assert copied.shape == zeroed.shape == (8, 2)
    assert torch.equal(copied[5:], x[4:].detach().expand(3, 2)) and not zeroed[5:].any()
    copied.sum().backward()
    assert torch.equal(x.grad, torch.ones(5, 2)), "no gradient may flow back through the copies"
    assert torch.equal(ops.shard(x.detach(), 0, 4, 3, "copy"), torch.tensor([[8., 9.], [8., 9.]]))
    assert ops.pad(x, 0, 5, "copy") is x                                  # divides: nothing appended
    with pytest.raises(ValueError, match="fill"):
        ops.pad(x, 0, 4, "zeros")


@pytest.mark.parametrize("traceable", [False, True], ids=["eager", "traceable"])
@pytest.mark.parametrize("nccl_branch", [False, True], ids=["gloo", "nccl"])
@pytest.mark.default_cases("gloo-eager", "nccl-traceable")       # each backend and each branch once
def test_padded_collectives_forward_and_backward(pool2, traceable, nccl_branch):
    """Slice -> x * rsqrt(mean(x**2)) * g -> gather, and reduce-scatter -> the same -> all-gather, over
    17 tokens on 2 ranks: ghost rows finite (copies of the last real row), loss and gradients equal
    one process's."""
    for r in pool2.run(padded_collectives, "rsqrt", traceable, nccl_branch):
        for path, got in r.items():
            assert got["ghost_finite"] and got["ghost_copies"], (path, got)
            assert got["loss"] <= TOL and got["dx"] <= TOL and got["dg"] <= TOL, (path, got)
    assert r["slice"]["ghost_rows"] == 1                                  # rank 1: tokens 9..16 and a ghost


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [17, 5])
def test_padded_collectives_on_four_ranks(pool4, tokens):
    """tp=4: 17 tokens (one rank holds 2 real rows and 3 ghosts) and 5 (two ranks hold only ghosts)."""
    for r in pool4.run(padded_collectives, "normdiv", False, False, tokens):
        for path, got in r.items():
            assert got["ghost_finite"] and got["ghost_copies"], (path, got)
            assert got["loss"] <= TOL and got["dx"] <= TOL and got["dg"] <= TOL, (path, got)


def _assert_equal(results):
    for r in results:
        assert r["finite"] and r["loss_diff"] <= TOL and r["param_diff"] <= TOL, r
    assert all(r["losses"] == results[0]["losses"] for r in results), "ranks disagree on the loss"


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.default_cases("rsqrt")
def test_class_token_vit_trains_like_one_device_tp2(pool2, norm):
    """Zero-unsafe hand-written norms, 17 tokens on tp=2 with sequence parallelism: 3 SGD steps equal
    one device (they were NaN from step 2 when the padding rows were zeros)."""
    _assert_equal(pool2.run(sp_training, norm, (1, 2, 1)))


@pytest.mark.slow
@pytest.mark.parametrize("norm", NORMS)
def test_class_token_vit_trains_like_one_device_tp4(pool4, norm):
    """17 tokens on tp=4: the last rank holds 2 real rows and 3 padding rows."""
    _assert_equal(pool4.run(sp_training, norm, (1, 4, 1)))


@pytest.mark.inductor
@pytest.mark.parametrize("norm", NORMS)
def test_compiled_class_token_vit_trains_like_one_device(pool2, norm):
    """The same through torch.compile'd stages (the traceable collectives' padding)."""
    _assert_equal(pool2.run(sp_training, norm, (1, 2, 1), backend="aot_eager"))
