"""Planning leaves no state of its own runs of the model's code (issue 50, item 3).

A module that caches a tensor on itself in forward (tests/checks_trace_state.py: a relative-position
index built on the first call and kept with its N) used to keep the meta tensor the planning's shape
propagation left there; the stage modules share that module and the first ``pm.step`` died with
"Tensor on device meta is not on the expected device cpu"."""
import pytest
import torch

import autosplit
from tests.checks_trace_state import (LEAVES, CachingViT, meta_attributes, module_state, same_state,
                                      trains_like_one_device)

TOL = 1e-5


@pytest.mark.parametrize("warm", [False, True], ids=["cache-empty", "cache-built"])
@pytest.mark.parametrize("mesh", [(2, 1, 1), (1, 2, 1)])
def test_compile_leaves_every_module_attribute(mesh, warm):
    """Every attribute of every module (plain values, cached tensors, parameters, buffers) is the same
    before and after ``compile``, whether or not the cache was built (on CPU) before; the stage
    modules of every tp rank hold no meta tensor."""
    torch.manual_seed(0)
    model = CachingViT()
    if warm:
        model(torch.randn(2, 3, 32, 32))
    before = module_state(model)
    plan = autosplit.compile(model, mesh=mesh, example_input=torch.randn(2, 3, 32, 32), leaf_modules=LEAVES)
    assert same_state(before, module_state(model)) == []
    stages = [m for tp in range(mesh[1]) for pp in range(mesh[0]) for m in plan.stage_modules(pp, tp)]
    assert meta_attributes(stages) == []
    with torch.no_grad():      # the model still runs on CPU, and builds its cache for the first time there
        model(torch.randn(2, 3, 32, 32))


def test_search_leaves_every_module_attribute():
    """The strategy search traces and propagates shapes many times over; the model keeps none of it."""
    model = CachingViT()
    before = module_state(model)
    autosplit.search(model, 2, torch.empty(1, 3, 32, 32), global_batch=8, leaf_modules=LEAVES, top=1)
    assert same_state(before, module_state(model)) == []


def test_trace_modes_do_not_see_each_others_state():
    """A forward that fills a cache on its first call (no branch on a proxy: the cache's size is a
    constant) is traced in train mode, then in eval mode: the eval trace must not read the train
    trace's cache as an attribute, which made the modes differ and the module a leaf."""
    from autosplit.trace import trace

    class Cached(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self._cache = None

        def forward(self, x):
            if self._cache is None:
                self._cache = torch.arange(4.0)
            return self.lin(x) + self._cache

    model = Cached()
    gm = trace(model)
    assert model._cache is None and "_cache" not in {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert "lin" in {n.target for n in gm.graph.nodes if n.op == "call_module"}   # not one leaf "<root>"
    x = torch.randn(2, 4)
    assert torch.equal(gm(x), Cached.forward(model, x))


@pytest.mark.parametrize("mesh", [(2, 1, 1), (1, 2, 1)])
@pytest.mark.default_cases('mesh0')
def test_parallelize_trains_like_one_device(pool2, mesh):
    """parallelize leaves the model's attributes as they were, its stage modules hold no meta tensor,
    and two steps train as on one device."""
    for r in pool2.run(trains_like_one_device, mesh):
        assert r["changed"] == [] and r["metas"] == [], r
        assert r["loss_diff"] <= TOL and r["param_diff"] <= TOL, r
