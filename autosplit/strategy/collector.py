"""Python's cyclic garbage collector paced for a long search: survivors of a full collection frozen.

Terms:
  full collection -- CPython's generation-2 collection: it walks every container object the collector
                     tracks.  It runs whenever the objects promoted since the last one exceed a quarter of
                     those that survived it, so a heap that keeps growing pays a walk of the whole heap
                     again and again.
  frozen          -- moved to the permanent generation by ``gc.freeze()``: never walked by a collection
                     until ``gc.unfreeze()`` puts them back into generation 2.  Reference counting still
                     frees a frozen object whose count drops to 0; only a frozen object in an unreachable
                     reference cycle stays allocated until it is unfrozen.

Why: a search builds one fx graph per tensor-parallel layout (per microbatch size for a cp layout), each
of thousands of nodes with meta tensors on them, and keeps them to the end, so its heap grows to
millions of tracked objects. The 22B-like search on 1024 devices (benchmarks/bench_search.py) ran 27
full collections that walked that heap for 14-18 s of its 88-105 s. Freezing what survived each full
collection leaves the next one only the objects made since (then 125 full collections, 1.2-1.6 s in
all). The cycles a search drops (a rewrite whose graph came out as one already kept) are mostly young:
a gen-0 or gen-1 collection still takes them before any freeze. On leaving, everything frozen goes back
into generation 2, where the next full collection frees the search's graphs as it would have without
this.

Nothing is done where the caller already froze objects (``gc.unfreeze()`` would thaw theirs) or turned the
collector off.
"""
from __future__ import annotations

import contextlib
import gc


def _freeze_after_full(phase: str, info: dict) -> None:
    if phase == "stop" and info.get("generation") == 2:
        gc.freeze()


@contextlib.contextmanager
def frozen_survivors():
    """Within it, every object that survives a full collection is frozen (see the module docstring);
    all are unfrozen on leaving, error or not."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.callbacks.append(_freeze_after_full)
    try:
        yield
    finally:
        gc.callbacks.remove(_freeze_after_full)
        gc.unfreeze()
