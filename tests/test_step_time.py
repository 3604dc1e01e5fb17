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
    fixed = predict_step("1f1b", 2, 4, 1, [StageTimes(f, b, dp=0.5)] * 2, fixed=0.3)
    # the step's own collectives (call check, loss all-reduce) end every rank 0.3 later, all of it exposed,
    # counted with the dp sync (both are collectives over the replicas, after the schedule)
    assert fixed.total == pytest.approx(dp.total + 0.3) and fixed.dp_comm == pytest.approx(dp.dp_comm + 0.3)
    assert (fixed.bubble, fixed.exposed_comm) == pytest.approx((dp.bubble, dp.exposed_comm))
    assert (tp.tp_comm, tp.pp_comm) == pytest.approx((4 * 0.3, 0.0)) and pred.tp_comm == 0
    assert pred.pp_comm == pytest.approx(pred.exposed_comm)
    assert fixed.rank_ends == pytest.approx([e + 0.3 for e in dp.rank_ends])
    for p in (pred, tp, dp, fixed):
        assert p.total == pytest.approx(p.compute + p.bubble + p.exposed_comm + p.dp_comm)
        assert p.total == pytest.approx(p.compute + p.bubble + p.tp_comm + p.pp_comm + p.dp_comm)
    # without the free run (the search's ranking): the same total and parts, the transfers' delay in the bubble
    lean = predict_step("1f1b", 2, 4, 1, [StageTimes(f, b, send=send, tp_fwd=0.1, dp=0.5)] * 2, fixed=0.3, parts=False)
    full = predict_step("1f1b", 2, 4, 1, [StageTimes(f, b, send=send, tp_fwd=0.1, dp=0.5)] * 2, fixed=0.3)
    assert full.pp_comm > 0 and lean.pp_comm == 0
    assert (lean.total, lean.compute, lean.tp_comm, lean.dp_comm, lean.rank, lean.rank_ends) == \
        (full.total, full.compute, full.tp_comm, full.dp_comm, full.rank, full.rank_ends)
    assert lean.bubble == pytest.approx(full.bubble + full.pp_comm)


@pytest.mark.parametrize("dp,buckets,exposed", [(1.0, 1, 1.0), (1.0, 4, 0.25), (4.0, 4, 2.5), (4.0, 1, 4.0)])
def test_dp_sync_overlaps_the_final_backward_in_buckets(dp, buckets, exposed):
    """One stage, one microbatch, B = 2: k buckets ready evenly through the final backward, sent one after
    another: the sync ends max(dp - B (k-1)/k, dp / k) after it (DDP's overlap); one bucket, all of dp."""
    pred = predict_step("1f1b", 1, 1, 1, [StageTimes(1.0, 2.0, dp=dp, dp_buckets=buckets)])
    assert pred.dp_comm == pytest.approx(exposed) and pred.total == pytest.approx(3.0 + exposed)


@pytest.mark.parametrize("shared", [False, True])
def test_resume_stretches_only_a_compute_whose_rank_sat_idle(shared):
    """One microbatch on pp 2: rank 0's F starts the step (not idle), rank 1's F waits for it (idle), its B
    follows its F at once (not idle), rank 0's B waits for rank 1's (idle).  With (F, B) factors (1.5,
    1.25): 1 + 1.5 + 2 + 2.5.  The same in the event-driven run with sharing (slowdowns of 1)."""
    from autosplit.cost_model.step_time import Sharing
    sharing = Sharing((1.0, 1.0)) if shared else None
    plain = predict_step("1f1b", 2, 1, 1, [StageTimes(1.0, 2.0)] * 2, sharing)
    pred = predict_step("1f1b", 2, 1, 1, [StageTimes(1.0, 2.0)] * 2, sharing, resume=(1.5, 1.25))
    assert plain.total == pytest.approx(6.0) and pred.total == pytest.approx(7.0)
    assert pred.compute == pytest.approx(1.0 + 2.5) and pred.rank == 0      # rank 0: F, then its idle B
    assert pred.total == pytest.approx(pred.compute + pred.bubble + pred.exposed_comm + pred.dp_comm)
    back_to_back = predict_step("1f1b", 1, 4, 1, [StageTimes(1.0, 2.0)], sharing, resume=(1.5, 1.25))
    assert back_to_back.total == pytest.approx(4 * 3.0)                    # one rank never waits


@pytest.mark.parametrize("shared", [False, True])
def test_pass_overhead_adds_seconds_only_to_a_compute_whose_rank_sat_idle(shared):
    """As the resume test: rank 1's F and rank 0's B waited; each takes ``overhead`` longer after its
    resume factor: 1 + (1.5 + 0.5) + 2 + (2.5 + 0.5).  One rank never waits: nothing added."""
    from autosplit.cost_model.step_time import Sharing
    sharing = Sharing((1.0, 1.0)) if shared else None
    pred = predict_step("1f1b", 2, 1, 1, [StageTimes(1.0, 2.0)] * 2, sharing, resume=(1.5, 1.25), overhead=0.5)
    assert pred.total == pytest.approx(8.0) and pred.compute == pytest.approx(1.0 + 3.0)
    back_to_back = predict_step("1f1b", 1, 4, 1, [StageTimes(1.0, 2.0)], sharing, overhead=0.5)
    assert back_to_back.total == pytest.approx(4 * 3.0)


def test_step_collectives_price_the_call_check_and_the_loss_all_reduce():
    from autosplit.cost_model import H100, all_gather_time, all_reduce_time
    from autosplit.cost_model.step_time import step_collectives
    assert step_collectives(H100, 1) == 0.0                       # one rank: nothing to agree on
    assert step_collectives(H100, 8) == pytest.approx(all_gather_time(8 * 40, 8, H100) + all_reduce_time(16, 8, H100))
    assert step_collectives(H100, 8) > step_collectives(H100, 2) > 0


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
                                dict(mesh=(2, 1, 2), recompute="block", dp_shard="stage")])
@pytest.mark.default_cases('kw1')
def test_plan_prediction_is_the_summary_line(kw):
    plan = autosplit.compile(tp_timm(), example_input=torch.randn(4, 3, 32, 32), **kw)
    stages = plan_stage_times(plan)
    for s, t in zip(plan.stages, stages):     # comm_time splits into tp collectives and 2 x the boundary
        assert t.tp_fwd + t.tp_bwd + 2 * t.send == pytest.approx(s.comm_time)
    pred = predict_plan(plan)
    assert pred.total > pred.compute > 0
    assert pred.line() in plan.summary()


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2), ("gpipe", 1)])
def test_lower_bound_never_exceeds_the_prediction(name, v):
    """The search prunes with lower_bound: it must hold for any stage times (random here: transfers, dp
    sync in buckets, FSDP gathers, hidden tp, optimizer steps, the step's own collectives)."""
    import random
    from autosplit.cost_model.step_time import Sharing, lower_bound
    rng = random.Random(0)
    for pp, m in ((2, 2), (3, 5), (4, 8), (2, 7)):
        for _ in range(12):
            stages = []
            for _ in range(pp * v):
                bwd, tp_bwd = 2 * rng.random(), 0.1 * rng.random()
                w = bwd * rng.random() if name.startswith("zb") else 0.0
                stages.append(StageTimes(
                    fwd=rng.random(), bwd=bwd, w=w, tp_fwd=0.1 * rng.random(), tp_bwd=tp_bwd,
                    send=0.2 * rng.random(), dp=3 * rng.random() ** 2, dp_buckets=rng.choice((1, 2, 5)),
                    tp_hidden=min(tp_bwd, bwd) * rng.random(), gather_fwd=0.05 * rng.random(),
                    gather_bwd=0.05 * rng.random(), gather_first=0.3 * rng.random() * (rng.random() < 0.3),
                    opt=rng.choice((0.0, 0.1, 5.0)) * rng.random()))
            fixed = 0.2 * rng.random()
            bound = lower_bound(name, pp, m, v, stages, fixed)
            assert bound <= predict_step(name, pp, m, v, stages, fixed=fixed).total * (1 + 1e-12)
            shared = Sharing(tuple(1.0 + 0.5 * k for k in range(pp)))
            assert bound <= predict_step(name, pp, m, v, stages, shared, fixed=fixed).total * (1 + 1e-12)
    equal = [StageTimes(1.0, 2.0)] * 4
    assert lower_bound("1f1b", 4, 8, 1, equal) == predict_step("1f1b", 4, 8, 1, equal).total


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2), ("gpipe", 1)])
def test_a_limit_stops_only_runs_whose_total_passes_it(name, v):
    """The search runs the schedule with its incumbent as ``limit``: None only where the full run's total
    exceeds it, else the full run's prediction unchanged (random stage times, resume stretching computes
    after idle, the limit on either side of the total)."""
    import random
    rng = random.Random(1)
    stopped = kept = 0
    for pp, m in ((2, 2), (3, 5), (4, 8), (4, 16)):
        for _ in range(10):
            stages = [StageTimes(fwd=rng.random(), bwd=2 * rng.random(), w=0.0, tp_fwd=0.1 * rng.random(),
                                 tp_bwd=0.1 * rng.random(), send=0.2 * rng.random(), dp=rng.random(),
                                 dp_buckets=rng.choice((1, 4)), opt=0.1 * rng.random())
                      for _ in range(pp * v)]
            fixed, resume = 0.1 * rng.random(), (1.0 + rng.random(), 1.0 + rng.random())
            full = predict_step(name, pp, m, v, stages, fixed=fixed, resume=resume, parts=False)
            for limit in (full.total * rng.uniform(0.5, 0.999), full.total * rng.uniform(1.0, 1.5)):
                got = predict_step(name, pp, m, v, stages, fixed=fixed, resume=resume, parts=False, limit=limit)
                if got is None:
                    assert full.total > limit
                    stopped += 1
                else:
                    assert got == full
                    kept += 1
    assert stopped and kept          # both happen: the limit stops runs, and leaves the others exact
    # resume factors below 1 (a hand-written profile) could end a compute sooner than its part: no limit then
    shrunk = predict_step(name, pp, m, v, stages, resume=(0.5, 0.5), parts=False)
    assert predict_step(name, pp, m, v, stages, resume=(0.5, 0.5), parts=False, limit=0.0) == shrunk


def test_lower_bound_counts_the_optimizer_on_its_own_rank():
    """pp = 2, one microbatch, stage 1's optimizer step long: rank 1 ends F0 + F1 + B1 + its step (1 + 1 + 2
    + 10 = 14) while the drain's B0 runs on rank 0, whose own step is short (6).  The bound once added the
    drain and rank 1's step together (16 > 14: a configuration the search could wrongly prune)."""
    from autosplit.cost_model.step_time import lower_bound
    stages = [StageTimes(1.0, 2.0), StageTimes(1.0, 2.0, opt=10.0)]
    assert predict_step("1f1b", 2, 1, 1, stages).total == pytest.approx(14.0)
    assert lower_bound("1f1b", 2, 1, 1, stages) == pytest.approx(14.0)


def test_lower_bound_counts_transfers_syncs_and_the_steps_collectives():
    """What the bound adds beyond compute: one microbatch through 2 stages pays both sends (F0 -> F1,
    B1 -> B0); a dp sync in one piece after the final backward; the step's own collectives."""
    from autosplit.cost_model.step_time import lower_bound
    sends = [StageTimes(1.0, 2.0, send=0.25)] * 2
    assert lower_bound("1f1b", 2, 1, 1, sends) == pytest.approx(predict_step("1f1b", 2, 1, 1, sends).total)
    assert lower_bound("1f1b", 2, 1, 1, sends) == pytest.approx(6.5)
    synced = [StageTimes(1.0, 2.0, dp=0.5)]
    assert lower_bound("1f1b", 1, 3, 1, synced, fixed=0.1) == pytest.approx(9.0 + 0.5 + 0.1)
    assert predict_step("1f1b", 1, 3, 1, synced, fixed=0.1).total == pytest.approx(9.6)


def test_sharing_stretches_only_what_runs_at_once():
    """Processor sharing (a CPU host's cores shared by its ranks): computes that never overlap keep their
    time, ranks computing together are slowed by the measured factor, tp collectives are not stretched."""
    from autosplit.cost_model.step_time import Sharing, sharing_of
    f, b = 1.0, 2.0
    alone = [StageTimes(f, b)] * 2
    one = predict_step("1f1b", 2, 1, 1, alone, Sharing((1.0, 2.0)))
    assert one.total == pytest.approx(2 * (f + b))            # F0 F1 B1 B0: one rank computes at a time
    lockstep = predict_step("1f1b", 1, 3, 1, [StageTimes(f, b, tp_fwd=0.5)], Sharing((1.0, 2.0), group=2))
    assert lockstep.total == pytest.approx(3 * (2 * (f + b) + 0.5))   # tp * dp = 2 processes, always together
    assert lockstep.compute == pytest.approx(3 * 2 * (f + b)) and lockstep.exposed_comm == pytest.approx(1.5)
    free, shared = (predict_step("1f1b", 2, 8, 1, alone, s) for s in (None, Sharing((1.0, 2.0))))
    # steady state: both ranks compute at once at half speed; fill and drain run alone
    assert free.total < shared.total < 2 * free.total
    assert shared.total == pytest.approx(shared.compute + shared.bubble + shared.exposed_comm + shared.dp_comm)
    two_hosts = predict_step("1f1b", 2, 8, 1, alone, Sharing((1.0,)))   # one rank per host: nothing shared
    assert two_hosts.total == pytest.approx(free.total)
    assert sharing_of(type("P", (), {"sharing": (1.0, 0.97)})(), 1) is None    # no slowdown: the plain run
    assert sharing_of(type("P", (), {"sharing": (1.0, 0.9, 1.5)})(), 1).slowdown == (1.0, 1.0, 1.5)


def test_posting_a_group_takes_host_time_before_the_next_compute():
    """With a posting cost p (a CPU host posts what it computes next to), every group waits p after its
    rank's previous compute or post, and so does the rank's next compute: gpipe pp2 m1 with F = B = 1
    and free transfers runs 0F0 | post [0SEND_F0 0RECV_B0] || post [1RECV_F0] 1F0 1B0 | post [1SEND_B0]
    ... 0B0, two posts on its critical path: 4 + 2p.  The free run posts for nothing, so they count as
    exposed communication; the event-driven run (sharing) gives the same with nothing shared."""
    from autosplit.cost_model.step_time import Sharing, lower_bound
    unit = [StageTimes(1.0, 1.0)] * 2
    p = 0.1
    for sharing in (None, Sharing((1.0, 1.0))):
        got = predict_step("gpipe", 2, 1, 1, unit, sharing, post=p)
        assert got.total == pytest.approx(4 + 2 * p) and got.exposed_comm == pytest.approx(2 * p), got
        assert predict_step("gpipe", 2, 1, 1, unit, sharing).total == pytest.approx(4.0)
    for name, v in (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2)):
        stages = [StageTimes(1.0, 2.0, 0.8 if name.startswith("zb") else 0.0, send=0.05)] * (2 * v)
        base, posted = (predict_step(name, 2, 4, v, stages, post=q).total for q in (0.0, p))
        assert base < posted <= base + p * 4 * 2 * v * 2 + 1e-9          # at most every group of a rank
        assert lower_bound(name, 2, 4, v, stages) <= posted


def test_wake_delays_only_a_rank_that_waited_on_a_busy_host():
    """``wake`` (a waiting rank winning a core back) delays a compute whose last wait was its transfer, and
    only while at least host processes - 2 others compute (as measured); it counts as exposed transfer."""
    from autosplit.cost_model.step_time import Sharing, lower_bound
    unit = [StageTimes(1.0, 1.0)] * 3
    # gpipe, one microbatch: one rank computes at a time, so nobody else is busy when data arrives
    assert predict_step("gpipe", 3, 1, 1, unit, Sharing((1.0,) * 3), wake=0.5).total == pytest.approx(6.0)
    # two ranks on a 4-process host: never 2 others computing, so never a wake
    two = [StageTimes(1.0, 2.0, send=0.01)] * 2
    assert predict_step("1f1b", 2, 8, 1, two, Sharing((1.0,) * 4), wake=0.5).total == \
        pytest.approx(predict_step("1f1b", 2, 8, 1, two, Sharing((1.0,) * 4)).total)
    for name, v in (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2)):
        stages = [StageTimes(1.0, 2.0, 0.8 if name.startswith("zb") else 0.0, send=0.01)] * (4 * v)
        # a flat host (no slowdown): delays only add, at most once per compute fed by a transfer
        base, woken = (predict_step(name, 4, 8, v, stages, Sharing((1.0,) * 4), wake=w) for w in (0.0, 0.05))
        assert base.total < woken.total <= base.total + 0.05 * 2 * 8 * 4 * v, name
        assert woken.exposed_comm > base.exposed_comm
        # with a slowdown a delayed rank also frees the others' cores, so the total need not grow
        shared = predict_step(name, 4, 8, v, stages, Sharing((1.0, 1.2, 1.6, 2.2)), wake=0.05)
        assert lower_bound(name, 4, 8, v, stages) <= shared.total
        assert shared.total == pytest.approx(shared.compute + shared.bubble + shared.exposed_comm + shared.dp_comm)


def test_a_backward_hides_tp_collectives_under_its_weight_gradients():
    """B exposes tp_bwd - tp_hidden (the entries' all-reduces in flight while queued weight-gradient GEMMs
    run); an I, its W deferred, hides nothing."""
    t = StageTimes(1.0, 2.0, w=0.0, tp_fwd=0.1, tp_bwd=0.4, tp_hidden=0.3)
    pred = predict_step("1f1b", 1, 1, 1, [t])
    assert pred.total == pytest.approx(1.0 + 0.1 + 2.0 + 0.1) and pred.tp_comm == pytest.approx(0.2)
    split = predict_step("zb-h1", 2, 2, 1, [StageTimes(1.0, 2.0, w=1.0, tp_bwd=0.4, tp_hidden=0.3)] * 2)
    whole = predict_step("zb-h1", 2, 2, 1, [StageTimes(1.0, 2.0, w=1.0, tp_bwd=0.4)] * 2)
    assert split.total == pytest.approx(whole.total)


def test_plans_hide_tp_backward_only_where_the_device_overlaps():
    """On a GPU profile a tp plan's stages hide min(tp backward, W) (NCCL beside the GEMMs); a CPU-type
    profile hides nothing (gloo and the GEMMs share the rank's core); dp_shard turns the overlap off."""
    import dataclasses
    import torch
    import autosplit
    from autosplit.cost_model import get_profile
    from autosplit.cost_model.step_time import plan_stage_times
    from tests.models import tp_timm
    x = torch.randn(4, 3, 32, 32)
    gpu = autosplit.compile(tp_timm(), mesh=(1, 2, 1), example_input=x, device="h100")
    (t,) = plan_stage_times(gpu)
    assert 0 < t.tp_hidden == pytest.approx(min(t.tp_bwd, gpu.stages[0].w_time))
    cpu_like = dataclasses.replace(get_profile("h100"), name="h100-as-cpu", device_type="cpu")
    (t,) = plan_stage_times(autosplit.compile(tp_timm(), mesh=(1, 2, 1), example_input=x, device=cpu_like))
    assert t.tp_hidden == 0
    sharded = autosplit.compile(tp_timm(), mesh=(1, 2, 2), example_input=torch.randn(2, 3, 32, 32), device="h100",
                                dp_shard=True)
    assert all(t.tp_hidden == 0 for t in plan_stage_times(sharded))
