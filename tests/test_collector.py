"""The search's collector pacing (autosplit/strategy/collector.py): survivors of a full collection frozen
inside, everything thawed on leaving, the caller's own freeze or a disabled collector left alone."""
import gc
import sys
import weakref

import pytest
import torch

import autosplit
import autosplit.strategy.search  # noqa: F401  (the module, patched below)
from autosplit.strategy.collector import _freeze_after_full, frozen_survivors

from tests.models import tp_timm


class _Cycle:
    def __init__(self):
        self.me = self


@pytest.fixture(autouse=True)
def _clean_collector():
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    yield
    gc.unfreeze()
    gc.enable()


def test_a_full_collection_inside_freezes_its_survivors_and_leaving_thaws_them():
    kept = [_Cycle() for _ in range(100)]
    with frozen_survivors():
        assert _freeze_after_full in gc.callbacks
        gc.collect()                                # a full collection: what survived it is frozen
        frozen = gc.get_freeze_count()
        assert frozen >= len(kept)
        dropped = _Cycle()
        gone = weakref.ref(dropped)
        del dropped
        gc.collect()                                # made after the freeze: still collected inside
        assert gone() is None
    assert _freeze_after_full not in gc.callbacks
    assert gc.get_freeze_count() == 0


def test_cycles_frozen_inside_are_freed_after_leaving():
    with frozen_survivors():
        cycle = _Cycle()
        gone = weakref.ref(cycle)
        gc.collect()                                # the cycle is alive now: frozen
        del cycle
        gc.collect()
        assert gone() is not None                   # frozen garbage waits for the thaw
    gc.collect()
    assert gone() is None


def test_an_error_inside_still_thaws():
    with pytest.raises(ValueError), frozen_survivors():
        gc.collect()
        assert gc.get_freeze_count() > 0
        raise ValueError("inside")
    assert gc.get_freeze_count() == 0 and _freeze_after_full not in gc.callbacks


def test_the_callers_freeze_and_a_disabled_collector_are_left_alone():
    gc.freeze()
    theirs = gc.get_freeze_count()
    with frozen_survivors():
        assert _freeze_after_full not in gc.callbacks
    assert gc.get_freeze_count() == theirs          # not thawed by us
    gc.unfreeze()
    gc.disable()
    with frozen_survivors():
        assert _freeze_after_full not in gc.callbacks
    assert not gc.isenabled()


def test_search_runs_paced_and_leaves_the_collector_as_it_found_it(monkeypatch):
    module = sys.modules["autosplit.strategy.search"]
    paced = []
    traced = module.trace_model

    def trace_model(*args, **kwargs):
        paced.append(_freeze_after_full in gc.callbacks)
        return traced(*args, **kwargs)

    monkeypatch.setattr(module, "trace_model", trace_model)
    with torch.device("meta"):
        model = tp_timm()
    result = autosplit.search(model, 2, torch.empty(1, 3, 32, 32), global_batch=8, top=2)
    assert len(result) == 2 and paced == [True]
    assert gc.get_freeze_count() == 0 and _freeze_after_full not in gc.callbacks
