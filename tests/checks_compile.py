"""Checks run inside gloo worlds for compiled stages (tests/test_compile_stages.py)."""
from __future__ import annotations

import torch
import torch._dynamo

from autosplit.runtime.compiled_stages import graph_breaks
from autosplit.weight_grad import DEFERRED
from tests.dist_checks import train_matches_single_device


def compiled_matches(name: str, mesh, schedule: str = "1f1b", backend: str = "inductor", **kw) -> dict:
    """train_matches_single_device with compiled stages, plus the graph breaks and graphs dynamo counted."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    deferred = []
    defer = DEFERRED.defer
    DEFERRED.defer = lambda w, work: (deferred.append(w), defer(w, work))[1]    # counted, then queued
    try:
        out = train_matches_single_device(name, mesh, schedule, 1, compile_stages={"backend": backend}, **kw)
    finally:
        del DEFERRED.defer
    out["deferred"] = len(deferred)
    out["graph_breaks"] = graph_breaks()
    out["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    out["breaks"] = dict(torch._dynamo.utils.counters["graph_break"])
    return out
