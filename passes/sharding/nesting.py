"""The order in which one tensor's collectives run over several axes, and the moves that order cannot make.

Terms (place: strategies.py; chain: lower.py):
  state   -- one axis's place of the tensor, as this module sees it: ``R``, ``P`` or the tensor dim its
             Shard splits (an int).
  nesting -- a dim split over several axes holds its parts nested in axis order: the first axis's
             parts outermost (DeviceMesh's convention).  Over axes (a, b) with 2 ranks each, rank
             (a, b) holds the quarter a*2 + b of the dim.
  order   -- the chain's order of one collective per axis that changes: the sums first (a Partial is
             reduced before anything moves it), then the Shards that change, innermost axis first, then
             the new places, outermost axis first.
  fault   -- a step of that order that would break the nesting, so that the parts the ranks hold are not
             the blocks the layout names (a silent wrong answer, not an error, if run):
             * "split": an axis splits a dim that a later (inner) axis already splits: its parts would
               land inside the inner axis's;
             * "gathered": an axis gathers (or moves away) its split of a dim that a later axis still
               splits: the gather concatenates the outer parts of one inner part, which is no block of
               the dim (2 x 2: the ranks b = 0 would hold quarters 0 and 2).

The lowering runs this order (lower.py ``chain``) and refuses a fault with a PlanError; the joint program
of two axes (joint.py) leaves out every edge with a fault, so that a layout it picks always lowers.
"""
from __future__ import annotations

from autosplit.passes.sharding.strategies import P, R


def state(place, enum, layout, token):
    """``place`` (strategies.py: R, P or ("S", class)) as this module reads it: R, P or the tensor dim
    its class lies in under ``layout`` (the Enumerator ``enum``'s ``where``); ``token`` where the
    layout is a tuple's or holds no such class (a move per element: a token no other axis shares)."""
    if not isinstance(place, tuple):
        return place
    w = None if isinstance(layout, tuple) else enum.where(layout, place[1])
    return token if w is None else w[0]


def order(states: list) -> list[int]:
    """The axes (indices into ``states``: (have, need) per axis, outermost first) in chain order."""
    sums = [i for i, (have, _) in enumerate(states) if have == P]
    moved = [i for i, (have, need) in enumerate(states) if isinstance(have, int) and need != have]
    rest = [i for i in range(len(states)) if i not in sums and i not in moved]
    return [*sums, *reversed(moved), *rest]


def fault(states: list, steps: list[int] | None = None):
    """The first step of ``steps`` (default ``order(states)``) that breaks the nesting: (axis index, dim,
    "split" | "gathered", [the later axes that split the dim then]), or None."""
    now = [have for have, _ in states]
    for i in order(states) if steps is None else steps:
        have, need = states[i]
        if need == have:
            continue
        for kind, d in (("gathered", have), ("split", need)):
            if isinstance(d, int):
                later = [j for j in range(i + 1, len(states)) if now[j] == d]
                if later:
                    return i, d, kind, later
        now[i] = need
    return None
