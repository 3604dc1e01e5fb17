"""``compile_stages``' settings refused before anything compiles (default tier: nothing here compiles).

CUDA graphs (issue 50 item 6): on a graph's replay none of the custom ops' Python runs, so zero-bubble's
deferred weight gradients would stay zero and the collectives would run outside the watchdog.  Every way
torch turns them on is refused by name, with the modes that keep them off suggested; the modes without
graphs pass.  The refusal comes before any rendezvous (no process group is created)."""
import argparse

import pytest
import torch
import torch.distributed as dist

import autosplit
from autosplit.errors import AutosplitError
from autosplit.runtime.pipeline.compiled_stages import compile_settings
from examples.common import add_parallel_flags
from tests.models import timm_cls

GRAPHS = [({"mode": "reduce-overhead"}, "mode='reduce-overhead'"),
          ({"mode": "max-autotune"}, "mode='max-autotune'"),
          ({"mode": "reduce-overhead", "dynamic": True}, "mode='reduce-overhead'"),
          ({"options": {"triton.cudagraphs": True}}, "options={'triton.cudagraphs': True}"),
          ({"backend": "cudagraphs"}, 'backend="cudagraphs"')]


@pytest.mark.parametrize("settings,named", GRAPHS, ids=["reduce-overhead", "max-autotune", "reduce-overhead-dynamic",
                                                        "options-cudagraphs", "backend-cudagraphs"])
def test_cuda_graph_settings_are_refused_by_name(settings, named):
    with pytest.raises(AutosplitError) as caught:
        compile_settings(settings)
    said = str(caught.value)
    assert named in said and "records CUDA graphs" in said, said
    assert "deferred weight gradients" in said and "watchdog" in said, said
    assert 'mode="max-autotune-no-cudagraphs"' in said and 'mode="default"' in said, said


def test_inductor_global_cuda_graphs_are_refused():
    from torch._inductor import config
    with config.patch({"triton.cudagraphs": True}):
        for settings in (True, {"mode": "default"}, {"mode": "max-autotune-no-cudagraphs"}):
            with pytest.raises(AutosplitError, match=r"torch._inductor.config.triton.cudagraphs = True"):
                compile_settings(settings)
        # turned off for this call explicitly: fine
        off = {"options": {"triton.cudagraphs": False}}
        assert compile_settings(off) == off
    assert compile_settings(True) == {}


@pytest.mark.parametrize("settings", [{"mode": "default"}, {"mode": "max-autotune-no-cudagraphs"},
                                      {"mode": "max-autotune-no-cudagraphs", "dynamic": False},
                                      {"options": {"triton.cudagraphs": False}}, {"backend": "aot_eager"}])
def test_modes_without_cuda_graphs_pass(settings):
    assert compile_settings(settings) == settings


def test_parallelize_refuses_before_any_rendezvous():
    assert not dist.is_initialized()
    with pytest.raises(AutosplitError, match=r"mode='reduce-overhead'.*records CUDA graphs"):
        autosplit.parallelize(timm_cls(depth=2), mesh=(1, 1, 1), example_input=torch.randn(2, 3, 32, 32),
                              compile_stages={"mode": "reduce-overhead"})
    assert not dist.is_initialized()


def test_example_compile_modes_are_the_accepted_ones():
    parser = argparse.ArgumentParser()
    add_parallel_flags(parser)
    choices = next(a.choices for a in parser._actions if a.dest == "compile_mode")
    assert set(choices) == {"default", "max-autotune-no-cudagraphs"}, choices
    for mode in choices:
        assert compile_settings({"mode": mode}) == {"mode": mode}
