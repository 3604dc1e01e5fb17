"""The lowering pass: add point-to-point communication actions to compute-only schedules.

Terms:
  compute-only list -- a rank's ordered F/B actions, as ``generate.build_schedule`` makes them.
  lowered list      -- the same list with SEND_F/RECV_F/SEND_B/RECV_B actions inserted.
  edge              -- activation flow stage ``s`` -> ``s+1`` (forward) or gradient flow
                       ``s+1`` -> ``s`` (backward), for one microbatch.
  local hand-off    -- an edge whose two stages live on the same rank (only when pp == 1); the value
                       stays in memory, so no communication action is emitted for it.

Pass contract.
  requires: every list is compute-only (F and B); each action's stage is in ``[0, S)`` and lives on
            the rank whose list holds it (``stage % pp == rank``); each microbatch is in ``[0, m)``;
            every (stage, microbatch) has exactly one F and exactly one B, and the F comes first.
  ensures:  the compute actions keep their order; for every cross-rank edge there is exactly one
            send on the producer's rank, right after the producing compute (SEND_F after F of
            ``s < S-1``, SEND_B after B of ``s > 0``) and exactly one receive on the consumer's rank,
            right before the consuming compute (RECV_F before F of ``s > 0``, RECV_B before B of
            ``s < S-1``); local hand-offs get no communication actions.
"""
from __future__ import annotations

from collections import Counter

from autosplit.errors import AutosplitError

from .actions import RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F
from .generate import Schedule


def lower(schedule: Schedule) -> dict[int, list[Action]]:
    """Per rank, ``schedule.actions`` with SEND/RECV actions inserted (see the module contract)."""
    check_requires(schedule)
    return {r: _lower_rank(r, acts, schedule.pp, schedule.num_stages)
            for r, acts in sorted(schedule.actions.items())}


def _lower_rank(rank: int, actions: list[Action], pp: int, num_stages: int) -> list[Action]:
    def remote(stage: int) -> bool:
        return stage % pp != rank

    out: list[Action] = []
    for a in actions:
        s, i = a.stage, a.microbatch
        if a.kind is F:
            before = [Action(s, RECV_F, i)] if s > 0 and remote(s - 1) else []
            after = [Action(s, SEND_F, i)] if s < num_stages - 1 and remote(s + 1) else []
        else:
            before = [Action(s, RECV_B, i)] if s < num_stages - 1 and remote(s + 1) else []
            after = [Action(s, SEND_B, i)] if s > 0 and remote(s - 1) else []
        out += before + [a] + after
    return out


def check_requires(schedule: Schedule) -> None:
    """Raise AutosplitError naming the first action that breaks the pass's ``requires``."""
    pp, S, m = schedule.pp, schedule.num_stages, schedule.num_microbatches
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
            if a.stage % pp != rank:
                raise AutosplitError(
                    f"{where}: stage {a.stage} lives on rank {a.stage} % {pp} = {a.stage % pp}, not {rank}")
            if a.kind is B and seen[(a.stage, F, a.microbatch)] == 0:
                raise AutosplitError(f"{where}: B before the F of stage {a.stage} microbatch {a.microbatch}")
            seen[(a.stage, a.kind, a.microbatch)] += 1
    for s in range(S):
        for i in range(m):
            for kind in (F, B):
                if seen[(s, kind, i)] != 1:
                    raise AutosplitError(
                        f"schedule has {seen[(s, kind, i)]} copies of {Action(s, kind, i)}; needs exactly 1")
