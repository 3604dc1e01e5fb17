"""1D tensor parallelism (Megatron layout found from the graph), with and without sequence
parallelism, equals single-device training; communication per block is Megatron's minimum."""
import pytest

from tests.dist_checks import count_tp_collectives, train_matches_single_device

TOL = 1e-5
MODELS = ["tp_timm", "tp_torchvision", "tp_hand"]
SP = [False, True]


def _assert_equal(results):
    for r in results:
        assert r["loss_diff"] <= TOL and r["param_diff"] <= TOL, r
    assert all(r["losses"] == results[0]["losses"] for r in results), "ranks disagree on the loss"


@pytest.mark.parametrize("sp", SP)
@pytest.mark.parametrize("name", MODELS + ["tp_swiglu"])
@pytest.mark.default_cases('tp_hand-True')
def test_tp2(pool2, name, sp):
    _assert_equal(pool2.run(train_matches_single_device, name, (1, 2, 1), "1f1b", 1, sequence_parallel=sp))


@pytest.mark.parametrize("sp", SP)
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("mesh", [(1, 4, 1), (2, 2, 1)])
@pytest.mark.default_cases('mesh1-tp_torchvision-False')
def test_tp_four_ranks(pool4, name, mesh, sp):
    _assert_equal(pool4.run(train_matches_single_device, name, mesh, "1f1b", 1, sequence_parallel=sp))


@pytest.mark.parametrize("sp", SP)
@pytest.mark.parametrize("name", MODELS)
def test_tp_pp_dp_eight_ranks(pool8, name, sp):
    _assert_equal(pool8.run(train_matches_single_device, name, (2, 2, 2), "1f1b", 1, sequence_parallel=sp))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.default_cases('tp_hand')
def test_megatron_minimum_communication(pool2, name):
    """Per block 2 all-reduces forward (after attention and MLP) and 2 backward (gradients of their
    inputs); the classifier head is column-parallel: one copy before it and one gather after it per
    microbatch, counted here over the depth."""
    for r in pool2.run(count_tp_collectives, name):
        head = 1 / r["depth"]
        assert r["regions"] == 2 * r["depth"], r            # row-parallel linears / attention by heads
        assert r["per_block"] == {"all_reduce:fwd": 2, "copy:fwd": 2 + head, "copy:bwd": 2 + head,
                                  "all_reduce:bwd": 2, "gather:fwd": head}, r
        assert r["all_reduces"] >= 4 * r["depth"] and r["clones"] == 0, r    # reduced in place, no copies


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.default_cases('tp_hand')
def test_sequence_parallel_communication(pool2, name):
    """2 all-gathers + 2 reduce-scatters per block each way; before the first block the tokens are
    sliced (the activation, and a position embedding added there), after the last they are gathered
    for the pooling, and the head is column-parallel (a copy before, a gather after): nothing else."""
    for r in pool2.run(count_tp_collectives, name, sequence_parallel=True):
        depth, per_block = r["depth"], r["per_block"]
        # layer-norm and bias gradients (each rank saw only its tokens): one all-reduce per step
        assert per_block.pop("grad_all_reduce:bwd") * depth * r["microbatches"] == 1, r
        slices = per_block.pop("local_slice:fwd") * depth
        assert slices in (1, 2) and per_block.pop("local_slice:bwd") * depth == slices, r
        edge = 1 / depth
        assert per_block == {"all_gather:fwd": 2, "all_gather:bwd": 2, "gather:fwd": 2 * edge,
                             "reduce_scatter:fwd": 2, "reduce_scatter:bwd": 2,
                             "copy:fwd": edge, "copy:bwd": edge}, r
