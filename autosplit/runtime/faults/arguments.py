"""Before any process group is built: every rank passed ``parallelize`` the arguments the groups depend on.

Terms:
  layout arguments -- what decides which process groups a rank creates, and in which order: the mesh
                      (as given and as resolved against the world size), tp_mode and tp_depth.  Ranks
                      that disagree on them call ``new_group`` with different rank lists or a different
                      number of times, and group creation then waits forever (torch's own store timeout
                      at best), with no message.
  round            -- one meeting of every rank, numbered by the store's counter ``autosplit/args/round``:
                      a call joins the round the counter names when it arrives, so the number does not
                      depend on what this process did before (a process counter drifted: a call that
                      raised on one rank before this check left that rank one number behind the others
                      for good, and they then waited on keys it never wrote).
  arrival          -- each rank writes its layout arguments under ``autosplit/args/{round}/{rank}`` and
                      adds 1 to the round's ``arrived`` count; it then waits, polling with ``timeout_s`` as
                      its deadline, for the round's *outcome*.
  outcome          -- the key ``autosplit/args/{round}/outcome``, written once (``compare_set`` on an
                      absent key: the first writer wins, the others read its value): "complete" by the rank
                      whose arrival made the count the world size, or, by a rank whose deadline passed
                      first, which ranks it found missing.  Every rank of the round reads the same outcome,
                      so no rank builds groups while another gives up (a rank arriving just as a peer
                      gives up learns that it gave up).  Either way the counter then moves to the next
                      round (``compare_set`` from this round's number: only the first move counts), and a
                      complete round compares the same texts on every rank, so every rank raises the same
                      AutosplitError, or none.

Why the store and not an all_gather on the default group: the default group is the user's (on NCCL a
GPU collective, before this module has a Watchdog or heartbeats), or not created yet (world.py agrees
before it starts the default group), and a store key can be waited for with our own deadline and tells
exactly which rank did not arrive.
"""
from __future__ import annotations

import json
import time

from autosplit.errors import AutosplitError
from autosplit.runtime.faults.exchange import by_value

_ROUND = "autosplit/args/round"
_CHECK_EVERY_S = 0.02         # how often a waiting rank looks at the store (as deadlines.py)
_COMPLETE = "complete"


def agree_on_arguments(store, rank: int, size: int, arguments: dict[str, str], timeout_s: float,
                       arrive: str = "reach autosplit.parallelize", wait_s: float | None = None) -> None:
    """Raise the same AutosplitError on every rank unless all ``size`` ranks passed the same
    ``arguments`` (field -> readable text); raise an AutosplitError naming the ranks that did not
    arrive within ``timeout_s`` and those that did.  Call before creating any process group (see the
    module docstring).

    Args:
      store: the job's store (the default group's, or the one world.py starts it with).
      rank, size: this rank and the world size.
      arguments: field -> readable text; every field must be equal on every rank.
      timeout_s: how long to wait for the other ranks.
      arrive: what a missing rank did not do, for the message ("reach autosplit.parallelize").
      wait_s: how long to wait from now (default ``timeout_s``; less when part of it was spent joining).
    """
    number = store.add(_ROUND, 0)          # the round the counter names now (see *round*)
    prefix = f"autosplit/args/{number}/"
    keys = [f"{prefix}{r}" for r in range(size)]
    store.set(keys[rank], json.dumps(arguments, sort_keys=True))
    outcome = _decide(store, prefix, _COMPLETE) if store.add(prefix + "arrived", 1) == size else None
    deadline = time.monotonic() + (timeout_s if wait_s is None else wait_s)
    while outcome is None:
        if store.check([prefix + "outcome"]):
            outcome = store.get(prefix + "outcome").decode()
        elif time.monotonic() > deadline:
            present = [r for r, k in enumerate(keys) if store.check([k])]
            outcome = _decide(store, prefix, json.dumps({"by": rank, "present": present}))
        else:
            time.sleep(_CHECK_EVERY_S)
    # the next call meets in a fresh round, whoever moves the counter first (see *outcome*)
    store.compare_set(_ROUND, str(number), str(number + 1))
    if outcome != _COMPLETE:
        raise AutosplitError(_missing(json.loads(outcome), rank, size, timeout_s, arrive))
    everyone = [json.loads(store.get(k).decode()) for k in keys]
    problems = []
    for field in sorted(arguments):
        values = [a.get(field, "(not given)") for a in everyone]
        if len(set(values)) == 1:
            continue
        groups = by_value(values)
        said = [f"{_who(ranks)} passed {field}={value}" if k == 0 else f"{_who(ranks)} passed {value}"
                for k, (ranks, value) in enumerate(groups)]
        problems.append(", ".join(said))
    if problems:
        raise AutosplitError("ranks passed different arguments to autosplit.parallelize, so no rank built its "
                             "process groups (they would wait on each other forever): " + "; ".join(problems)
                             + ". Every rank must call parallelize with the same mesh, tp_mode and tp_depth")


def _decide(store, prefix: str, outcome: str) -> str:
    """Write the round's outcome unless a rank did first; the outcome that stands."""
    return store.compare_set(prefix + "outcome", "", outcome).decode()


def _missing(gave_up: dict, rank: int, size: int, timeout_s: float, arrive: str) -> str:
    present = gave_up["present"]
    missing = [r for r in range(size) if r not in present]
    text = (f"{_who(missing)} did not {arrive} within timeout_s={timeout_s:g} s, where {_who(present)} "
            f"waited")
    if rank not in present:       # this rank arrived after the one that gave up had looked
        text = f"this rank ({rank}) arrived only after rank {gave_up['by']} had stopped waiting: " + text
    return (text + ": every rank must call parallelize, in the same order, with the same mesh (a rank that "
            "failed or exited before it shows its own error)")


def _who(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
