"""Pure parts of the agreement checks: the plan fingerprint, model checksums, the single-output pass."""
import pytest
import torch

import autosplit
from autosplit.passes.check_output import check_single_output
from autosplit.runtime.faults.agreement import model_checksums, plan_fields, plan_fingerprint
from autosplit.trace import trace
from tests.checks_bad_input import _DictOut, _TupleOut
from tests.models import timm_cls, tp_timm


def _plan(mesh=(2, 1, 1), m=2, rows=2, model=None, **kw):
    torch.manual_seed(0)
    return autosplit.compile(model or timm_cls(), mesh=mesh, example_input=torch.empty(rows, 3, 32, 32, device="meta"),
                             num_microbatches=m, device="h100", **kw)


def test_fingerprint_is_stable_and_names_what_changed():
    base = _plan()
    assert plan_fingerprint(base) == plan_fingerprint(_plan())        # a pure function of the plan
    changed = {"num_microbatches": _plan(m=4), "microbatch": _plan(rows=1), "mesh": _plan(mesh=(2, 1, 2)),
               "schedule": _plan(schedule="gpipe"), "tp plan": _plan(mesh=(1, 2, 1), model=tp_timm())}
    for field, other in changed.items():
        assert plan_fingerprint(other) != plan_fingerprint(base), field
        assert plan_fields(other)[field] != plan_fields(base)[field], field
    assert plan_fields(base)["num_microbatches"] == "2"
    assert plan_fields(base)["microbatch"] == "(2, 3, 32, 32) float32"
    assert "sharded" in plan_fields(changed["tp plan"])["tp plan"]


def test_checksums_are_exact_and_position_sensitive():
    torch.manual_seed(0)
    a = timm_cls()
    torch.manual_seed(0)
    b = timm_cls()
    torch.manual_seed(1)
    c = timm_cls()
    names, sums = model_checksums(a)
    assert names == list(a.state_dict()) and sums == model_checksums(b)[1]
    differ = [n for n, x, y in zip(names, sums, model_checksums(c)[1]) if x != y]
    assert "pos_embed" in differ and "norm.weight" not in differ      # ones stay ones whatever the seed
    x, y = torch.nn.Linear(2, 1, bias=False), torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():                                              # same values, other order
        x.weight.copy_(torch.tensor([[1.0, 2.0]]))
        y.weight.copy_(torch.tensor([[2.0, 1.0]]))
    assert model_checksums(x)[1] != model_checksums(y)[1]


@pytest.mark.parametrize("cls,words", [(_TupleOut, "a tuple of 2 values"), (_DictOut, "a dict with keys ['logits']")])
def test_model_with_several_outputs_is_refused(cls, words):
    gm = trace(cls(), 1)
    with pytest.raises(autosplit.AutosplitError, match="single output tensor") as info:
        check_single_output(gm)
    assert words in str(info.value)
    check_single_output(trace(timm_cls(), 1))                          # one tensor: fine
