"""Before any process group is built: every rank passed ``parallelize`` the arguments the groups depend on.

Terms:
  layout arguments -- what decides which process groups a rank creates, and in which order: the mesh
                      (as given and as resolved against the world size), tp_mode and tp_depth.  Ranks
                      that disagree on them call ``new_group`` with different rank lists or a different
                      number of times, and group creation then waits forever (torch's own store timeout
                      at best), with no message.
  arrival          -- each rank writes its layout arguments to the job's store under the key of this
                      call (``autosplit/args/{call}/{rank}``) and waits, polling with ``timeout_s`` as
                      its deadline, until every rank's key is there; then every rank compares the same
                      texts and so raises the same AutosplitError, or none.
  call number      -- the how-many-th ``parallelize`` of this process: every rank builds its modules in
                      the same order (as DeviceMesh requires anyway), so the numbers match between ranks
                      without communicating.

Why the store and not an all_gather on the default group: the default group is the user's (on NCCL a
GPU collective, before this module has a Watchdog or heartbeats), and a store key can be waited for
with our own deadline and tells exactly which rank did not arrive.
"""
from __future__ import annotations

import itertools
import json
import time

from autosplit.errors import AutosplitError
from autosplit.runtime.faults.exchange import by_value

_CALLS = itertools.count()
_CHECK_EVERY_S = 0.02         # how often a waiting rank looks at the store (as deadlines.py)


def agree_on_arguments(store, rank: int, size: int, arguments: dict[str, str], timeout_s: float) -> None:
    """Raise the same AutosplitError on every rank unless all ``size`` ranks passed the same
    ``arguments`` (field -> readable text); raise an AutosplitError naming the ranks that did not
    arrive within ``timeout_s``.  Call before creating any process group (see the module docstring)."""
    call = next(_CALLS)
    keys = [f"autosplit/args/{call}/{r}" for r in range(size)]
    store.set(keys[rank], json.dumps(arguments, sort_keys=True))
    deadline = time.monotonic() + timeout_s
    # one check of every key at a time (``store.check`` of a list is one round trip): the keys of the
    # ranks that arrived are needed only for the message, so they are read after
    while not store.check(keys):
        if time.monotonic() > deadline:
            present = [r for r, k in enumerate(keys) if store.check([k])]
            missing = [r for r in range(size) if r not in present]
            raise AutosplitError(
                f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not reach "
                f"autosplit.parallelize (call {call + 1} of this process) within timeout_s={timeout_s:g} s, "
                f"where rank{'s' if len(present) > 1 else ''} {', '.join(map(str, present))} waited: every rank "
                f"must call parallelize, in the same order, with the same mesh (a rank that failed or "
                f"exited before it shows its own error)")
        time.sleep(_CHECK_EVERY_S)
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


def _who(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
