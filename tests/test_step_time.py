"""The step-time predictor (cost_model/step_time.py): a timed run of the lowered schedule.

Unit durations reproduce the unit simulator; 1F1B's bubble is (pp - 1)(F + B); transfers and dp sync
add exactly what they expose; a compiled plan's prediction is the summary's line.
"""
import pytest
import torch

import autosplit
from autosplit.cost_model.step_time import StageTimes, plan_stage_times, predict_plan, predict_step
from autosplit.schedule import check_schedule

from tests.models import tp_timm


@pytest.mark.parametrize("name,pp,m,v", [("1f1b", 4, 8, 1), ("1f1b", 3, 2, 1), ("gpipe", 4, 6, 1),
                                         ("interleaved", 4, 8, 2), ("interleaved", 2, 5, 3),
                                         ("zb-h1", 4, 8, 1), ("zb-h1", 3, 7, 1), ("zb-v", 4, 8, 2), ("zb-v", 3, 4, 2)])
def test_unit_durations_reproduce_the_unit_simulator(name, pp, m, v):
    split = name.startswith("zb")
    unit = StageTimes(fwd=1.0, bwd=2.0, w=1.0) if split else StageTimes(fwd=1.0, bwd=1.0)
    pred = predict_step(name, pp, m, v, [unit] * (pp * v))
    sim = check_schedule(name, pp, m, v)
    assert pred.total == sim.steps
    assert pred.compute == sim.busy[pred.rank]
    assert pred.bubble == sim.idle[pred.rank]
    assert pred.exposed_comm == pred.dp_comm == 0


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 3), (8, 16)])
def test_1f1b_bubble_is_pp_minus_one_times_f_plus_b(pp, m):
    f, b = 0.3, 0.7
    pred = predict_step("1f1b", pp, m, 1, [StageTimes(fwd=f, bwd=b)] * pp)
    assert pred.bubble == pytest.approx((pp - 1) * (f + b))
    assert pred.compute == pytest.approx(m * (f + b))
    assert pred.total == pytest.approx((m + pp - 1) * (f + b))


def test_transfers_tp_and_dp_add_what_they_expose():
    f, b, send = 1.0, 2.0, 0.25
    one = predict_step("1f1b", 2, 1, 1, [StageTimes(f, b, send=send)] * 2)
    # one microbatch: F0 -> send -> F0' B0' -> send back -> B0, all on the critical path
    assert one.total == pytest.approx(2 * (f + b) + 2 * send) and one.exposed_comm == pytest.approx(2 * send)
    free = predict_step("1f1b", 2, 4, 1, [StageTimes(f, b)] * 2)
    pred = predict_step("1f1b", 2, 4, 1, [StageTimes(f, b, send=send)] * 2)
    # in 1F1B's steady state every second microbatch waits for a round trip (rank 1's F and B between
    # two sends): more than the fill's 2 sends, at most one round trip per microbatch
    assert 2 * send < pred.exposed_comm <= 2 * 4 * send
    assert pred.exposed_comm == pytest.approx(pred.total - free.total) and pred.bubble == pytest.approx(free.bubble)
    tp = predict_step("1f1b", 2, 4, 1, [StageTimes(f, b, tp_fwd=0.1, tp_bwd=0.2)] * 2)
    assert tp.compute == pytest.approx(free.compute) and tp.exposed_comm == pytest.approx(4 * 0.3)
    dp = predict_step("1f1b", 2, 4, 1, [StageTimes(f, b, dp=0.5)] * 2)
    assert dp.dp_comm == pytest.approx(0.5) and dp.total == pytest.approx(free.total + 0.5)
    for p in (pred, tp, dp):
        assert p.total == pytest.approx(p.compute + p.bubble + p.exposed_comm + p.dp_comm)


def test_zero_bubble_w_fills_the_bubble():
    """Same work per stage: zb-h1 idles (pp-1)(F+I-W), a third of 1F1B's with F = I = W."""
    pp, m = 4, 8
    one = predict_step("1f1b", pp, m, 1, [StageTimes(1.0, 2.0)] * pp)
    zb = predict_step("zb-h1", pp, m, 1, [StageTimes(1.0, 2.0, w=1.0)] * pp)
    assert one.bubble == pytest.approx(3 * (pp - 1)) and zb.bubble == pytest.approx(pp - 1)


def test_wrong_stage_count_is_refused():
    with pytest.raises(ValueError, match=r"pp\(2\) \* chunks_per_rank\(2\) = 4 stages"):
        predict_step("interleaved", 2, 4, 2, [StageTimes(1, 1)] * 2)


@pytest.mark.parametrize("kw", [dict(mesh=(2, 2, 2)), dict(mesh=(2, 1, 1), schedule="zb-v", chunks_per_rank=2),
                                dict(mesh=(2, 1, 2), checkpoint="block", dp_shard="stage")])
def test_plan_prediction_is_the_summary_line(kw):
    plan = autosplit.compile(tp_timm(), example_input=torch.randn(4, 3, 32, 32), **kw)
    stages = plan_stage_times(plan)
    for s, t in zip(plan.stages, stages):     # comm_time splits into tp collectives and 2 x the boundary
        assert t.tp_fwd + t.tp_bwd + 2 * t.send == pytest.approx(s.comm_time)
    pred = predict_plan(plan)
    assert pred.total > pred.compute > 0
    assert pred.line() in plan.summary()
