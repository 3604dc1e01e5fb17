"""The vocabulary of the step predictor's timed run: stage durations, events, and what a compute lasts.

Terms: see step_time.py (StageTimes, timed run, groups) and host_contention.py (sharing, wake, resume).
Shared by both so that neither imports the other's internals.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from autosplit.schedule.actions import B, F, I, W


@dataclass(frozen=True)
class StageTimes:
    """One global stage's durations (see the module docstring); seconds."""
    fwd: float
    bwd: float
    w: float = 0.0
    tp_fwd: float = 0.0
    tp_bwd: float = 0.0
    send: float = 0.0
    dp: float = 0.0
    dp_buckets: int = 1      # the dp sync's pieces, sent as the final backward produces them (1: after it)
    tp_hidden: float = 0.0   # of tp_bwd, seconds a B hides under its weight-gradient GEMMs (step_time.py)
    gather_fwd: float = 0.0  # FSDP2 "layer": exposed all-gather seconds per forward (step_time.py *fsdp gathers*)
    gather_bwd: float = 0.0  # ... per backward (B, or I under a split backward)
    gather_first: float = 0.0  # FSDP2 "stage": the stage's one all-gather, before its first forward
    opt: float = 0.0         # the optimizer step over the stage's parameters this rank owns (optimizer_step.py)


class _Node(NamedTuple):
    """One value of the timed run: a compute's end, a group's activation, or a group's end (a named tuple:
    a long schedule's run has ~10^5 of them, built once per structure)."""
    kind: str                 # "compute", "posted", "active", "done"
    rank: int
    deps: tuple[int, ...]     # node indices whose values it waits for
    action: object = None     # the compute (kind "compute")
    transfers: tuple = ()     # kind "done": ((peer active node, boundary stage), ...)
    feed: int = -1            # kind "compute": the "done" node of the group bringing its input, or -1


def _duration(a, t: StageTimes) -> float:
    if a.kind is F:
        return t.fwd + t.tp_fwd + _gather_part(a, t)
    if a.kind is B:
        return t.bwd + t.tp_bwd - t.tp_hidden + t.gather_bwd
    if a.kind is I:
        return t.bwd - t.w + t.tp_bwd + t.gather_bwd
    return t.w


def _gather_part(a, t: StageTimes) -> float:
    """FSDP2's exposed all-gathers inside compute ``a`` (step_time.py *fsdp gathers*)."""
    if a.kind is F:
        return t.gather_fwd + (t.gather_first if a.microbatch == 0 else 0.0)
    return 0.0 if a.kind is W else t.gather_bwd


def _tp_part(a, t: StageTimes) -> float:
    """The blocking collectives inside compute ``a``: tp's and FSDP2's exposed all-gathers (not compute:
    sharing does not stretch them)."""
    if a.kind is B:
        return t.tp_bwd - t.tp_hidden + t.gather_bwd
    if a.kind is F:
        return t.tp_fwd + _gather_part(a, t)
    return 0.0 if a.kind is W else t.tp_bwd + t.gather_bwd


def _transfer_end(n: _Node, value: list, stages, p2p: bool) -> float:
    mine = value[n.deps[0]]
    return max((max(mine, value[peer]) + (stages[b].send if p2p else 0.0) for peer, b in n.transfers), default=mine)


def _instant(n: _Node, value: list, stages, p2p: bool, post: float) -> float:
    """The value of a non-compute node once its dependencies' values are known."""
    start = max((value[d] for d in n.deps), default=0.0)
    if n.kind == "active":
        return start
    if n.kind == "posted":
        return start + (post if p2p else 0.0)
    return _transfer_end(n, value, stages, p2p)
