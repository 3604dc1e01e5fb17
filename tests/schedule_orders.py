"""Posting orders that are not autosplit's, to show what the NCCL rules catch (tests only).

``early_post_order`` replays how the executor posted communication before groups existed: receives
right before their consumer, sends right after their producer, and, before each compute, the receives
listed after it posted as a group of their own ("early post").  On NCCL this hangs in the first step.
``slot_fused_order`` is the simpler fusion torch's 1F1B uses (each slot's sends with the next compute's
receives), which is enough for 1F1B but not for looped schedules.
"""
from __future__ import annotations

from autosplit.schedule import Action, ActionKind, Group, Schedule

F = ActionKind.F


def _comm(a: Action, pp: int, num_stages: int) -> tuple[list[Action], list[Action]]:
    """(receives before, sends after) compute ``a`` in the per-action lowering."""
    s, i = a.stage, a.microbatch
    remote_prev, remote_next = s > 0 and (s - 1) % pp != s % pp, s < num_stages - 1 and (s + 1) % pp != s % pp
    if a.kind is F:
        return ([Action(s, ActionKind.RECV_F, i)] if remote_prev else [],
                [Action(s, ActionKind.SEND_F, i)] if remote_next else [])
    return ([Action(s, ActionKind.RECV_B, i)] if remote_next else [],
            [Action(s, ActionKind.SEND_B, i)] if remote_prev else [])


def early_post_order(schedule: Schedule) -> dict[int, list]:
    out = {}
    for r, acts in schedule.actions.items():
        items, posted = [], set()
        for k, a in enumerate(acts):
            before, after = _comm(a, schedule.pp, schedule.num_stages)
            if [x for x in before if x not in posted]:
                items.append(Group(tuple(x for x in before if x not in posted)))
            nxt = _comm(acts[k + 1], schedule.pp, schedule.num_stages)[0] if k + 1 < len(acts) else []
            if nxt:                                   # the next compute's receives, posted early
                items.append(Group(tuple(nxt)))
                posted.update(nxt)
            items.append(a)
            if after:
                items.append(Group(tuple(after)))
        out[r] = items
    return out


def slot_fused_order(schedule: Schedule) -> dict[int, list]:
    out = {}
    for r, acts in schedule.actions.items():
        items, previous = [], []
        for a in acts + [None]:
            before, after = _comm(a, schedule.pp, schedule.num_stages) if a is not None else ([], [])
            if previous + before:
                items.append(Group(tuple(previous + before)))
            if a is not None:
                items.append(a)
            previous = after
        out[r] = items
    return out
