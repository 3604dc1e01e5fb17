"""Identical layers rewritten once (passes/repeats.py): the search's expanded graphs are the whole rewrite.

Each layout of a 6-layer model is built twice, from the whole traced graph and from the graph reduced to
four layers with the rest copied back, and every number the search reads off them is compared exactly:
node values and costs at two sizes, cut positions, per-node times, each checkpoint mode's segment times,
parameters, stage cuts and activations.
"""
import importlib

import numpy as np
import pytest
import timm
import torch
import torchvision

import autosplit
from autosplit.cost_model import get_profile
from autosplit.model_layers import layer_paths
from autosplit.passes.repeats import reduce
from autosplit.strategy.costing import Group, _node_parts
from autosplit.strategy.floors import node_table
from autosplit.strategy.layout import LayoutGraph, trace_model

from tests.models import HandViT

X = torch.empty(1, 3, 32, 32)

FAMILIES = {
    "timm": lambda: timm.models.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=6, num_heads=4,
                                                  mlp_ratio=2, num_classes=10),
    "torchvision": lambda: torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=6,
                                                                num_heads=4, hidden_dim=32, mlp_dim=64,
                                                                num_classes=10),
    # rotary embeddings computed once before the blocks and read by each
    "eva02": lambda: timm.create_model("eva02_tiny_patch14_224", pretrained=False, img_size=32, patch_size=4,
                                       embed_dim=32, depth=6, num_heads=4, num_classes=10),
    # a relative position index per block, a tensor fx lifts out of each block's forward
    "beit": lambda: timm.create_model("beit_base_patch16_224", pretrained=False, img_size=32, patch_size=8,
                                      embed_dim=32, depth=6, num_heads=4, num_classes=10),
    "hand": lambda: HandViT(depth=6, heads=4),
}
LAYOUTS = [(2, "1d", False, None), (4, "1d", True, None), (4, "2d", False, None), (8, "2.5d", False, 2),
           (8, "3d", False, None)]


def _same(whole: LayoutGraph, copied: LayoutGraph, layers) -> None:
    profile = get_profile("h100")
    assert [(n.op, n.meta.get("module_path")) for n in whole.nodes] == \
           [(n.op, n.meta.get("module_path")) for n in copied.nodes]
    assert whole.param_bytes.keys() == copied.param_bytes.keys()
    assert sorted(whole.param_bytes.values()) == sorted(copied.param_bytes.values())
    for b in (2 * whole.unit, 3 * whole.unit, 5 * whole.unit):
        whole.at(b), copied.at(b)
        one, two = node_table(whole.nodes, profile), node_table(copied.nodes, profile)
        assert all(np.array_equal(one[k], two[k]) for k in one), b
        assert [(c.position, c.nbytes) for c in whole.cuts] == [(c.position, c.nbytes) for c in copied.cuts], b
        assert np.array_equal(_node_parts(whole, b, profile), _node_parts(copied, b, profile)), b
        for checkpoint in (None, "stage", "block"):
            g1, g2 = (Group(g, b, checkpoint, profile, layers, 1000) for g in (whole, copied))
            assert np.array_equal(g1.node_parts, g2.node_parts)
            assert (g1.seg.time, g1.seg.out_time, g1.seg.params) == (g2.seg.time, g2.seg.out_time, g2.seg.params)
            last = len(g1.segments) - 1
            for stages in (2, 3, 5):
                cut = g1.bounds(stages)
                assert cut == g2.bounds(stages)
                starts = [0, *[c + 1 for c in cut[:-1]]]
                assert [g1.activations(a, e) for a, e in zip(starts, cut)] == \
                       [g2.activations(a, e) for a, e in zip(starts, cut)]
            assert g1.stages([last // 3, 2 * last // 3, last])[1] == g2.stages([last // 3, 2 * last // 3, last])[1]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.default_cases('torchvision')
def test_copied_layers_equal_the_whole_rewrite(family):
    model = FAMILIES[family]()
    traced, layers = trace_model(model, (X,)), layer_paths(model)
    repeats = reduce(traced, layers)
    assert repeats is not None and len(list(repeats.graph.graph.nodes)) < len(list(traced.graph.nodes))
    expanded = 0
    for tp, mode, sp, depth in LAYOUTS if family in ("timm", "eva02") else LAYOUTS[::2]:
        whole = LayoutGraph(traced, (X,), tp, mode, sp, tp_depth=depth)
        copied = LayoutGraph(traced, (X,), tp, mode, sp, tp_depth=depth, repeats=repeats)
        assert not whole.expanded
        expanded += copied.expanded
        _same(whole, copied, layers)
    assert expanded >= 2          # the copies are built, not only the fallback (eva02's 3D falls back)


def test_layers_that_differ_are_not_reduced():
    """Blocks of one type with different widths, or too few to save a rewrite: the whole graph."""
    model = timm.models.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=6, num_heads=4,
                                          num_classes=10)
    model.blocks[3].mlp.fc1 = torch.nn.Linear(32, 48)
    model.blocks[3].mlp.fc2 = torch.nn.Linear(48, 32)
    assert reduce(trace_model(model, (X,)), layer_paths(model)) is None
    small = FAMILIES["timm"]().blocks[:4]
    model = FAMILIES["timm"]()
    model.blocks = small
    assert reduce(trace_model(model, (X,)), layer_paths(model)) is None


def test_rewrite_that_treats_layers_differently_falls_back(monkeypatch):
    """Where the rewrite treats identical layers differently (passes/repeats.py ``expand`` finds a copied
    layer's placements differ from its source's and returns None), the layout is the whole graph's.
    cait's 1D rewrite used to split its second block unlike its fifth; since the engine prices Partial
    values whole it treats them alike, so the difference is made here by ``expand`` itself."""
    import autosplit.strategy.layout as layout_module
    model = timm.create_model("cait_xxs24_224", pretrained=False, img_size=32, patch_size=4, embed_dim=32,
                              depth=6, num_heads=4, num_classes=10)
    traced, layers = trace_model(model, (X,)), layer_paths(model)
    repeats = reduce(traced, layers)
    assert repeats is not None
    assert LayoutGraph(traced, (X,), 2, "1d", False, repeats=repeats).expanded       # alike: copied
    monkeypatch.setattr(layout_module, "expand", lambda gm, repeats, earlier: None)
    copied = LayoutGraph(traced, (X,), 2, "1d", False, repeats=repeats)
    assert not copied.expanded
    _same(LayoutGraph(traced, (X,), 2, "1d", False), copied, layers)


@pytest.mark.slow
def test_search_with_copied_layers_is_the_search_without(monkeypatch):
    model = FAMILIES["timm"]()
    run = lambda: autosplit.search(model, 8, X, global_batch=16, top=8)   # noqa: E731
    fast = run()
    module = importlib.import_module("autosplit.strategy.search")    # the package exports the function
    monkeypatch.setattr(module, "reduce", lambda traced, layers: None)
    slow = run()
    assert [(c.label, c.step_time, c.memory, c.bounds) for c in fast] == \
           [(c.label, c.step_time, c.memory, c.bounds) for c in slow]
    assert (fast.pruned, fast.evaluated, len(fast.rejected)) == (slow.pruned, slow.evaluated, len(slow.rejected))
