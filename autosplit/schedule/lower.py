"""The lowering pass: add point-to-point communication, fused into groups, to compute-only schedules.

Terms:
  compute-only list -- a rank's ordered F/B (or F/I/W) actions, as ``generate.build_schedule`` makes them.
  lowered list      -- the same computes with communication groups (``actions.Group``) between them.
  edge              -- activation flow stage ``s`` -> ``s+1`` (forward) or gradient flow
                       ``s+1`` -> ``s`` (backward), for one microbatch.
  local hand-off    -- an edge whose two stages live on the same rank (pp == 1, or stages pp-1 and pp
                       under the V placement); the value stays in memory, so no communication
                       action is emitted for it.
  slot              -- the gap between two consecutive computes of one rank.

Why groups, and where.  NCCL runs one rank's point-to-point groups in the order they were posted, one
after the other, and a send completes only when its receive is running on the peer (and vice
versa).  A rank that posts a receive ahead of a send its peer is waiting for hangs both ranks (the
executor's old early posting did this in the first 1F1B step on 2 ranks: rank 0 queued RECV_B0 ahead
of SEND_F1 while rank 1 waited for F1 before it could send B0).  Fusing each slot's sends with the
next compute's receives, as torch.distributed.pipelining's 1F1B does (``fwd_sends + bwd_recvs``), is
enough for 1F1B but not for looped schedules, where rank 0 and rank pp-1 send to each other in both
directions.  So the pass places transfers by *time*: with every compute taking one step
(timing.py), a transfer produced at step t goes into the producer's slot after that compute *and*
into the consumer's slot at step t (after its last compute that runs at or before t), and each slot's
transfers form one Group.  Every rank's groups are then in increasing step order, and both halves of
every transfer sit at the same step, so on every rank all groups of steps before t are done before
any of step t is needed: no ordering cycle can form, whatever the real compute times are.  For 1F1B
this gives exactly torch's fused pairs.  ``simulate`` re-checks every schedule under NCCL's rules.

Pass contract.
  requires: every list is compute-only (F and B, or F, I and W); each action's stage is in ``[0, S)``
            and lives on the rank whose list holds it (the schedule's placement); each microbatch is in
            ``[0, m)``; every (stage, microbatch) has exactly one F and, unless the schedule is
            forward-only (no backward at all), exactly one B or exactly one I and one W (one kind of
            backward for the whole schedule); F comes before B / I, and I before its W.
  ensures:  the compute actions keep their order; for every cross-rank edge there is exactly one
            send on the producer's rank, in the slot right after the producing compute, and exactly
            one receive on the consumer's rank, in its slot at the producing compute's step, which
            comes before the consuming compute; each slot holds at most one Group (ordered by step,
            sends first); local hand-offs get no communication actions.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import Counter, defaultdict

from autosplit.errors import AutosplitError

from .actions import RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, Group, I, Item, W
from .generate import Schedule
from .timing import compute_steps


def lower(schedule: Schedule) -> dict[int, list[Item]]:
    """Per rank, ``schedule.actions`` with communication groups inserted (see the module contract)."""
    check_requires(schedule)
    S, place = schedule.num_stages, schedule.placement
    steps = compute_steps(schedule.actions, S, place)
    # slots[r][k]: (step, order, action) in the slot before compute k of rank r (k == len: after the last)
    slots = {r: defaultdict(list) for r in schedule.actions}
    position = {a: k for acts in schedule.actions.values() for k, a in enumerate(acts)}
    rank_steps = {r: [steps[a] for a in acts] for r, acts in schedule.actions.items()}
    for producer in position:
        for send_kind, recv_kind, consumer_stage in _edges(producer, S):
            src, dst = place.rank(producer.stage), place.rank(consumer_stage)
            if src == dst:
                continue                                          # local hand-off
            t, i = steps[producer], producer.microbatch
            slots[src][position[producer] + 1].append((t, 0, Action(producer.stage, send_kind, i)))
            # the consumer's slot after its last compute at or before step t
            slots[dst][bisect_right(rank_steps[dst], t)].append((t, 1, Action(consumer_stage, recv_kind, i)))
    out = {}
    for r, acts in sorted(schedule.actions.items()):
        items: list[Item] = []
        for k in range(len(acts) + 1):
            if slots[r][k]:
                items.append(Group(tuple(a for _, _, a in sorted(slots[r][k], key=_order))))
            if k < len(acts):
                items.append(acts[k])
        out[r] = items
    return out


def _order(entry) -> tuple:
    t, send_last, a = entry
    return t, send_last, a.stage, a.microbatch


def _edges(producer: Action, num_stages: int) -> list[tuple]:
    """(send kind, receive kind, consumer stage) of what ``producer`` hands on."""
    s = producer.stage
    if producer.kind is F:
        return [(SEND_F, RECV_F, s + 1)] if s < num_stages - 1 else []
    if producer.kind is W:
        return []                                   # weight gradients stay on the rank
    return [(SEND_B, RECV_B, s - 1)] if s > 0 else []


def flatten(items: list[Item]) -> list[Action]:
    """A lowered list with its groups opened up, in order (for dumps and tests)."""
    return [a for item in items for a in (item.actions if isinstance(item, Group) else (item,))]


def check_requires(schedule: Schedule) -> None:
    """Raise AutosplitError naming the first action that breaks the pass's ``requires``."""
    pp, S, m, place = schedule.pp, schedule.num_stages, schedule.num_microbatches, schedule.placement
    if sorted(schedule.actions) != list(range(pp)):
        raise AutosplitError(f"schedule has lists for ranks {sorted(schedule.actions)}; expected 0..{pp - 1}")
    seen: Counter[tuple[int, object, int]] = Counter()
    for rank, actions in schedule.actions.items():
        for pos, a in enumerate(actions):
            where = f"rank {rank} position {pos} ({a})"
            if not a.is_compute:
                raise AutosplitError(f"{where}: lower() needs compute-only lists, found {a.kind.name}")
            if not (0 <= a.stage < S and 0 <= a.microbatch < m):
                raise AutosplitError(
                    f"{where}: stage must be in [0, {S}) = pp({pp}) * chunks_per_rank"
                    f"({schedule.chunks_per_rank}) and microbatch in [0, {m})")
            if place.rank(a.stage) != rank:
                raise AutosplitError(f"{where}: {place.describe(a.stage)}, not {rank}")
            before = {B: F, I: F, W: I}.get(a.kind)
            if before is not None and seen[(a.stage, before, a.microbatch)] == 0:
                raise AutosplitError(f"{where}: {a.kind.name} before the {before.name} of stage {a.stage} "
                                     f"microbatch {a.microbatch}")
            seen[(a.stage, a.kind, a.microbatch)] += 1
    kinds = {k for _, k, _ in seen}
    if B in kinds and kinds & {I, W}:
        raise AutosplitError("schedule mixes B with I / W; a schedule splits every backward or none")
    kinds = (F,) + ((B,) if B in kinds else (I, W) if kinds & {I, W} else ())   # no backward: forward-only
    for s in range(S):
        for i in range(m):
            for kind in kinds:
                if seen[(s, kind, i)] != 1:
                    raise AutosplitError(
                        f"schedule has {seen[(s, kind, i)]} copies of {Action(s, kind, i)}; needs exactly 1")
