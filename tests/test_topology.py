"""Node topology in plans: tensor-, data- and pipeline-parallel traffic priced by the nodes it crosses,
and the rank layout saying when a tensor-parallel group cannot stay inside a node.

Single process, planning only (no process group): the same tiny model compiled for nodes of 8 and of 2
GPUs, everything else equal."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import autosplit
from autosplit.cost_model import get_profile
from autosplit.mesh import MeshShape, node_layout_note

from tests.models import tp_timm, tp_torchvision

X = torch.empty(4, 3, 32, 32)


def _nodes(gpus_per_node, **kw):
    return dataclasses.replace(get_profile("h100"), name=f"h100_{gpus_per_node}pernode", gpus_per_node=gpus_per_node,
                               **kw)


def test_the_layout_note_names_groups_that_leave_a_node():
    assert node_layout_note(MeshShape(1, 4, 4), 8) is None                 # tp 4 in nodes of 8
    assert node_layout_note(MeshShape(1, 4, 1), None) is None              # one node
    assert "tp=2 > 1 GPUs per node" in node_layout_note(MeshShape(1, 2, 1), 1)
    note = node_layout_note(MeshShape(2, 16, 2), 8)
    assert "tp=16 > 8 GPUs per node" in note and "2 nodes" in note
    note = node_layout_note(MeshShape(1, 4, 3), 6)
    assert "6 GPUs per node is not a multiple of tp=4" in note


@pytest.mark.parametrize("factory", [tp_timm, tp_torchvision])
@pytest.mark.default_cases('tp_timm')
def test_tp_across_nodes_is_priced_over_the_network_and_said(factory):
    model = factory()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                  # inside a node: no warning
        inside = autosplit.compile(model, mesh=(1, 4, 1), example_input=X, device=_nodes(8))
    with pytest.warns(UserWarning, match=r"tp=4 > 2 GPUs per node: each tensor-parallel group spans 2 nodes"):
        across = autosplit.compile(model, mesh=(1, 4, 1), example_input=X, device=_nodes(2))
    a, b = inside.predicted_step(), across.predicted_step()
    assert b.tp_comm > 3 * a.tp_comm > 0
    assert b.compute == pytest.approx(a.compute)
    for p in (a, b):
        assert p.total == pytest.approx(p.compute + p.tp_comm + p.pp_comm + p.dp_comm + p.bubble + p.optimizer)


def test_dp_and_pipeline_transfers_across_nodes_cost_more():
    model = tp_timm()
    slow = dict(network_bandwidth=1e9, network_latency=50e-6)
    dp_in = autosplit.compile(model, mesh=(1, 1, 4), example_input=X, device=_nodes(8, **slow)).predicted_step()
    dp_out = autosplit.compile(model, mesh=(1, 1, 4), example_input=X, device=_nodes(1, **slow)).predicted_step()
    assert dp_out.dp_comm > dp_in.dp_comm
    pp_in = autosplit.compile(model, mesh=(2, 1, 1), example_input=X, device=_nodes(8, **slow))
    pp_out = autosplit.compile(model, mesh=(2, 1, 1), example_input=X, device=_nodes(1, **slow))
    assert pp_out.stages[0].comm_time > 5 * pp_in.stages[0].comm_time
    assert pp_out.predicted_step().pp_comm > pp_in.predicted_step().pp_comm


def test_predicted_step_is_the_plans_prediction_with_any_profile():
    plan = autosplit.compile(tp_timm(), mesh=(2, 1, 1), example_input=X, device="h100")
    p = plan.predicted_step()
    assert p.total > 0 and p.line().startswith("predicted step:")
    assert plan.predicted_step("a100").total > p.total                  # a slower part, the same plan


def test_parallelize_takes_the_node_size_from_torchrun(monkeypatch):
    """On GPUs the job's LOCAL_WORLD_SIZE is the node size the plan prices with; a CPU world keeps its
    measured profile as it is; without torchrun's variable the profile's own node size stands."""
    from types import SimpleNamespace
    from autosplit.runtime.profile import with_node_size
    gpu, cpu = SimpleNamespace(device=torch.device("cuda", 0)), SimpleNamespace(device=torch.device("cpu"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert with_node_size("h100", gpu).gpus_per_node == 4 and get_profile("h100").gpus_per_node == 8
    assert with_node_size("h100", cpu) == "h100"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert with_node_size("h100", gpu) is get_profile("h100")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert with_node_size("h100", gpu) == "h100"
