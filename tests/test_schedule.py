"""Tests for autosplit.schedule: generators, the lowering pass and the simulator.

Terms: pp pipeline ranks, v chunks per rank, m microbatches, S = pp*v stages; a "sweep" runs every
accepted (pp, m, v) in the ranges below through build -> lower -> simulate, under NCCL's rules
(one queue of point-to-point groups per rank, rendezvous sends).
"""
from collections import Counter
from fractions import Fraction

import pytest

from autosplit.schedule import (
    Action, ActionKind, Group, ScheduleDeadlock, build_schedule, check_schedule, flatten, forward_schedule,
    lower, parse_item, peak_in_flight, simulate,
)
from autosplit.errors import AutosplitError
from tests.schedule_orders import early_post_order, slot_fused_order

PPS = range(1, 9)
MS = range(1, 33)


def _cases():
    for pp in PPS:
        for m in MS:
            yield "gpipe", pp, m, 1
            yield "1f1b", pp, m, 1
            for v in (2, 3, 4):
                if m >= pp:
                    yield "interleaved", pp, m, v
                if m >= pp and v <= 3 and m % 3 == 0:  # a sample of looped gpipe
                    yield "gpipe", pp, m, v


def _exact_idle(result):
    total = result.steps * result.pp
    return Fraction(total - sum(result.busy), total)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
@pytest.mark.default_cases('1f1b')
def test_sweep_finishes_with_ideal_bubble(name):
    checked = 0
    for case_name, pp, m, v in _cases():
        if case_name != name:
            continue
        result = check_schedule(name, pp, m, v)
        labels = Counter(cell for row in result.grid for cell in row if cell is not None)
        expected = {f"{s}{k}{i}" for s in range(pp * v) for k in "FB" for i in range(m)}
        assert set(labels) == expected and set(labels.values()) == {1}, (name, pp, m, v)
        assert _exact_idle(result) == Fraction(pp - 1, v * m + pp - 1), (name, pp, m, v)
        assert result.idle_fraction == pytest.approx((pp - 1) / (v * m + pp - 1))
        assert result.steps == 2 * (v * m + pp - 1)
        checked += 1
    assert checked > 200


def test_1f1b_bounds_activations_gpipe_does_not():
    for pp in PPS:
        for m in (1, pp, 2 * pp + 1, 32):
            peaks = check_schedule("1f1b", pp, m).peak_activations
            assert peaks == [min(pp - r, m) for r in range(pp)], (pp, m, peaks)
            assert check_schedule("gpipe", pp, m).peak_activations == [m] * pp


def test_peak_in_flight_scan_equals_the_simulator():
    """The search prices memory from a scan of the action lists; it must be the simulator's peak."""
    checked = 0
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"):
        for pp in (1, 2, 3, 4, 6, 8):
            for m in (1, 2, 3, pp, 2 * pp, 2 * pp + 1, 4 * pp):
                for v in ((1,) if name in ("gpipe", "1f1b", "zb-h1") else (2, 3) if name == "interleaved" else (2,)):
                    try:
                        sched = build_schedule(name, pp, m, v)
                    except AutosplitError:
                        continue
                    assert peak_in_flight(sched) == simulate(sched).peak_activations, (name, pp, m, v)
                    checked += 1
    assert checked > 150


def test_interleaved_matches_megatron_warmup():
    pp, v, m = 4, 2, 8
    sched = build_schedule("interleaved", pp, m, v)
    for r, acts in sched.actions.items():
        first_b = next(k for k, a in enumerate(acts) if a.kind is ActionKind.B)
        assert first_b == (pp - r - 1) * 2 + (v - 1) * pp + 1  # warmup forwards + the first steady F
    assert [str(a) for a in sched.actions[0][:6]] == ["0F0", "0F1", "0F2", "0F3", "4F0", "4F1"]


def test_format_grid_literal():
    expected = "\n".join([
        "step  rank 0  rank 1",
        "   0  0F0     .",
        "   1  0F1     1F0",
        "   2  .       1B0",
        "   3  0B0     1F1",
        "   4  .       1B1",
        "   5  0B1     .",
    ])
    assert check_schedule("1f1b", 2, 2).format_grid() == expected


def test_lower_inserts_comm_groups():
    lists = lower(build_schedule("1f1b", 2, 2))
    # rank 0's send of F1 and receive of B0 form one group, as in torch's fused 1F1B step
    assert [str(a) for a in lists[0]] == [
        "0F0", "[0SEND_F0]", "0F1", "[0SEND_F1 0RECV_B0]", "0B0", "[0RECV_B1]", "0B1"]
    # rank 1 receives F1 at the step rank 0 sends it (after 1F0), so it overlaps 1B0
    assert [str(a) for a in lists[1]] == [
        "[1RECV_F0]", "1F0", "[1RECV_F1]", "1B0", "[1SEND_B0]", "1F1", "1B1", "[1SEND_B1]"]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_lower_places_each_transfer_once_around_its_computes(name):
    for pp, m, v in [(2, 4, 1 if name != "interleaved" else 2), (4, 8, 1 if name != "interleaved" else 3)]:
        sched = build_schedule(name, pp, m, v)
        lists = lower(sched)
        for r, items in lists.items():
            assert [a for a in items if isinstance(a, Action)] == sched.actions[r]
            assert all(isinstance(x, Action) or isinstance(y, Action) for x, y in zip(items, items[1:]))
            flat = flatten(items)
            for k, a in enumerate(flat):
                if a.kind.is_send:         # after the compute producing it
                    producer = Action(a.stage, ActionKind.F if a.kind is ActionKind.SEND_F else ActionKind.B,
                                      a.microbatch)
                    assert flat.index(producer) < k
                if a.kind.is_recv:         # before the compute consuming it
                    consumer = Action(a.stage, ActionKind.F if a.kind is ActionKind.RECV_F else ActionKind.B,
                                      a.microbatch)
                    assert flat.index(consumer) > k
        sends = Counter(a.matching() for items in lists.values() for a in flatten(items) if a.kind.is_send)
        recvs = Counter(a for items in lists.values() for a in flatten(items) if a.kind.is_recv)
        assert sends == recvs and set(sends.values()) == {1}


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_early_post_order_deadlocks_under_nccl_rules(name):
    """The executor's posting order before groups hangs NCCL in the first step; the simulator says where."""
    v = 2 if name == "interleaved" else 1
    for pp in (2, 4):
        with pytest.raises(ScheduleDeadlock, match="rendezvous"):
            simulate(early_post_order(build_schedule(name, pp, 2 * pp, v)))
    with pytest.raises(ScheduleDeadlock) as info:
        simulate(early_post_order(build_schedule("1f1b", 2, 2)))
    assert "rank 0 waits at 0RECV_B0, which needs 1SEND_B0 that rank 1 has queued behind [1RECV_F1]" in str(info.value)
    assert "rank 1 waits at 1RECV_F1, which needs 0SEND_F1 that rank 0 has queued behind [0RECV_B0]" in str(info.value)


def test_pair_order_is_checked():
    """NCCL pairs transfers between two ranks by position: swapped receives are caught before running."""
    lists = lower(build_schedule("gpipe", 2, 2))
    lists[1] = [Group((Action.parse("1RECV_F1"), Action.parse("1RECV_F0"))) if str(x) == "[1RECV_F0]" else x
                for x in lists[1] if str(x) != "[1RECV_F1]"]
    with pytest.raises(ScheduleDeadlock, match=r"at position 0 rank 0 sends for 1RECV_F0, rank 1 receives 1RECV_F1"):
        simulate(lists)


def test_slot_fusion_alone_is_not_enough_for_looped_schedules():
    """torch's 1F1B fusion (each slot's sends with the next compute's receives) is fine for 1F1B but
    deadlocks looped schedules, where ranks 0 and pp-1 send to each other in both directions."""
    for pp in range(2, 9):
        for m in (pp, 2 * pp, 3 * pp + 1):
            simulate(slot_fused_order(build_schedule("1f1b", pp, m)))
    with pytest.raises(ScheduleDeadlock, match="queued behind"):
        simulate(slot_fused_order(build_schedule("interleaved", 2, 4, 2)))


def test_forward_only_schedules_finish():
    for pp in range(1, 9):
        for m in (1, pp, 2 * pp + 1):
            for name, v in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("gpipe", 3)]:
                if v > 1 and m < pp:
                    continue
                result = simulate(forward_schedule(name, pp, m, v))
                assert sum(result.busy) == pp * v * m


@pytest.mark.parametrize("text", ["[0SEND_F1 0RECV_B0]", "[3RECV_F2]", "1F0"])
def test_item_round_trip(text):
    item = parse_item(text)
    assert str(item) == text and parse_item(str(item)) == item
    with pytest.raises(ValueError, match="groups hold SEND_"):
        Group.parse("[0F1 0RECV_B0]")


def test_lower_skips_local_handoffs():
    lists = lower(build_schedule("interleaved", 1, 3, 3))
    assert all(a.is_compute for a in lists[0])
    assert check_schedule("interleaved", 1, 3, 3).idle_fraction == 0


def test_lower_checks_requires():
    sched = build_schedule("1f1b", 2, 2)
    sched.actions[0] = sched.actions[0][1:]  # drop 0F0
    with pytest.raises(ValueError, match=r"rank 0 position 1 \(0B0\): B before the F"):
        lower(sched)
    sched = build_schedule("gpipe", 2, 2)
    sched.actions[1].append(Action(1, ActionKind.F, 0))
    with pytest.raises(ValueError, match=r"B before the F|2 copies of 1F0"):
        lower(sched)
    sched = build_schedule("gpipe", 2, 1)
    sched.actions[0], sched.actions[1] = sched.actions[1], sched.actions[0]
    with pytest.raises(ValueError, match=r"stage 1 lives on rank 1 % 2 = 1, not 0"):
        lower(sched)


def test_deadlock_names_ranks_and_actions():
    p = Action.parse
    lists = {
        0: [p("0RECV_B0"), p("0F0"), p("0SEND_F0"), p("0B0")],
        1: [p("1RECV_F0"), p("1F0"), p("1B0"), p("1SEND_B0")],
    }
    with pytest.raises(ScheduleDeadlock) as info:
        simulate(lists)
    msg = str(info.value)
    assert "rank 0 waits at 0RECV_B0, which needs 1SEND_B0 that rank 1 has not reached (it is at 1F0)" in msg
    assert "rank 1 waits at 1RECV_F0, which needs 0SEND_F0 that rank 0 has queued behind [0RECV_B0]" in msg


def test_deadlock_from_bad_order():
    sched = build_schedule("1f1b", 2, 2)
    sched.actions[1] = [Action.parse(x) for x in ("1F0", "1F1", "1B1", "1B0")]
    sched.actions[0] = [Action.parse(x) for x in ("0F0", "0B0", "0F1", "0B1")]
    with pytest.raises(ScheduleDeadlock, match=r"rank 0 waits at 0B0, which needs 1B0 that rank 1 has not "
                                               r"reached \(it is at 1F1\)\n.*rank 1 waits at 1F1"):
        simulate(sched)


def test_simulate_timing_rule():
    # an F at step t on stage s lets stage s+1 run at step t+1
    grid = check_schedule("gpipe", 3, 1).grid
    assert [row for row in grid] == [
        ["0F0", None, None], [None, "1F0", None], [None, None, "2F0"],
        [None, None, "2B0"], [None, "1B0", None], ["0B0", None, None]]


@pytest.mark.parametrize("text", ["2F0", "1B3", "3SEND_F1", "0RECV_F12", "10SEND_B2", "4RECV_B0"])
def test_action_round_trip(text):
    action = Action.parse(text)
    assert str(action) == text and Action.parse(str(action)) == action


def test_action_peer_stage():
    assert Action.parse("3SEND_F1").peer_stage == 4
    assert Action.parse("3RECV_B1").peer_stage == 4
    assert Action.parse("3RECV_F1").peer_stage == 2
    assert Action.parse("3SEND_B1").peer_stage == 2
    assert Action.parse("3RECV_F1").matching() == Action.parse("2SEND_F1")
    with pytest.raises(ValueError, match="compute action"):
        Action.parse("3F1").peer_stage
    with pytest.raises(ValueError, match="cannot parse action 'F3'"):
        Action.parse("F3")


@pytest.mark.parametrize("args, match", [
    (("interleaved", 4, 3, 2), r"num_microbatches\(3\) >= pp\(4\)"),
    (("interleaved", 4, 8, 1), r"chunks_per_rank >= 2 \(got 1\)"),
    (("1f1b", 4, 8, 2), r"schedule='1f1b' runs one chunk per rank \(got chunks_per_rank=2\)"),
    (("gpipe", 4, 3, 2), r"num_microbatches\(3\) >= pp\(4\)"),
    (("zb", 4, 8, 1), r"schedule='zb': expected one of 'gpipe', '1f1b', 'interleaved'"),
    (("gpipe", 0, 8, 1), r"pp=0 \(int\) must be a positive integer"),
    (("1f1b", 2, 0, 1), r"num_microbatches=0 \(int\) must be a positive integer"),
])
def test_invalid_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        build_schedule(*args)
