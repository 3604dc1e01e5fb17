"""Numerics under parallelism (issue 8): accumulation under tp x dp, train/eval mode after tracing,
dropout masks under tensor parallelism, fp16 loss scaling, buffers under data parallelism.
Every check runs in real gloo processes and compares with single-device training where one exists."""
import pytest

from tests import checks_numerics as C

TOL = 1e-5


@pytest.mark.parametrize("name,kw", [("tp_timm", {"sequence_parallel": True}),
                                     ("tp_swiglu", {}),                       # qk-norm inside the region
                                     ("tp_hand", {"sequence_parallel": True})])
def test_no_sync_accumulation_tp_dp(pool4, name, kw):
    """Partial (tp-summed) gradients of no_sync steps are averaged over dp too."""
    for r in pool4.run(C.accumulate_tp_dp, name, **kw):
        assert r["param_diff"] <= TOL, r
