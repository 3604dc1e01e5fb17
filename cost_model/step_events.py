"""The vocabulary of the step predictor's timed run: stage durations, events, and what a compute lasts.

Terms: see step_time.py (StageTimes, timed run, groups) and host_contention.py (sharing, wake, resume).
Shared by both so that neither imports the other's internals.
"""
from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class _Node:
    """One value of the timed run: a compute's end, a group's activation, or a group's end."""
    kind: str                 # "compute", "posted", "active", "done"
    rank: int
    deps: tuple[int, ...]     # node indices whose values it waits for
    action: object = None     # the compute (kind "compute")
    transfers: tuple = ()     # kind "done": ((peer active node, boundary stage), ...)
    feed: int = -1            # kind "compute": the "done" node of the group bringing its input, or -1


def _duration(a, t: StageTimes) -> float:
    if a.kind is F:
        return t.fwd + t.tp_fwd
    if a.kind is B:
        return t.bwd + t.tp_bwd - t.tp_hidden
    if a.kind is I:
        return t.bwd - t.w + t.tp_bwd
    return t.w


def _tp_part(a, t: StageTimes) -> float:
    """The blocking tp collectives inside compute ``a`` (not compute: sharing does not stretch them)."""
    if a.kind is B:
        return t.tp_bwd - t.tp_hidden
    return t.tp_fwd if a.kind is F else 0.0 if a.kind is W else t.tp_bwd


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
