"""MetaShapeProp's memo (passes/shape_prop.py): replaying repeated ops gives every node the metadata a
full propagation gives, on every test model and after the tensor-parallel rewrites; user functions are
never replayed."""
import pytest
import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from autosplit.passes.shape_prop import MetaShapeProp
from autosplit.passes.sharding.grid import shard_2d
from autosplit.cost_model import get_profile
from autosplit.passes.sharding.megatron import shard_1d
from autosplit.trace import trace
from tests import models


def _metadata(gm: fx.GraphModule) -> list:
    out = []
    for n in gm.graph.nodes:
        leaves, spec = tree_flatten(n.meta.get("val"))
        out.append((n.name, str(spec), [(tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.device.type)
                                        if isinstance(x, torch.Tensor) else x for x in leaves]))
    return out


def _both(gm: fx.GraphModule, x: torch.Tensor) -> tuple[list, list]:
    MetaShapeProp((x,), memo=False)(gm)
    full = _metadata(gm)
    MetaShapeProp((x,))(gm)
    return full, _metadata(gm)


@pytest.mark.parametrize("name", sorted(models.VARIANTS))
# every edge model (each an op form) and three model shapes; the other shapes are slow
@pytest.mark.default_cases(*(n for n in models.VARIANTS if n.startswith("edge_")), "hand", "timm_cls", "torchvision")
def test_memo_equals_full_propagation(name):
    gm = trace(models.VARIANTS[name]())
    full, memo = _both(gm, torch.empty(3, 3, 32, 32, device="meta"))
    assert memo == full


@pytest.mark.parametrize("factory", [models.tp_timm, models.tp_torchvision, models.tp_hand, models.tp_swiglu])
@pytest.mark.parametrize("layout", ["1d", "1d-sp", "2d"])
@pytest.mark.default_cases('1d-tp_timm', '1d-sp-tp_torchvision', '2d-tp_hand')
def test_memo_equals_full_propagation_after_tp_rewrites(factory, layout):
    x = torch.empty(4, 3, 32, 32, device="meta")
    gm = trace(factory())
    MetaShapeProp((x,))(gm)
    if layout == "2d":
        plan = shard_2d(gm, 2, get_profile("h100"), lambda node, a, w: "allgather")
    else:
        plan = shard_1d(gm, 4, get_profile("h100"), sequence_parallel=layout == "1d-sp")
    local = fx.GraphModule(plan.local_root(0, gm.graph), gm.graph)
    full, memo = _both(local, x)
    assert memo == full


calls = []


@torch.fx.wrap
def _counted(x):
    calls.append(1)
    return x * 2


class _Repeated(torch.nn.Module):
    def forward(self, x):
        for _ in range(3):
            x = _counted(x)
        return x


def test_user_functions_are_not_replayed():
    gm = trace(_Repeated())
    calls.clear()
    MetaShapeProp((torch.empty(2, 4, device="meta"),))(gm)
    assert len(calls) == 3
