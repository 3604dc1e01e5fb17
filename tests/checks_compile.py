"""Checks run inside gloo worlds for compiled stages (tests/test_compile_stages.py)."""
from __future__ import annotations

import copy

import torch
import torch._dynamo

import autosplit
from autosplit.runtime.pipeline.compiled_stages import graph_breaks
from autosplit.weight_grad import DEFERRED
from tests.dist_checks import batches, logged, train_matches_single_device
from tests.models import VARIANTS


def _fresh_counters() -> None:
    """Dynamo's state and counters from scratch: the graphs compiled by an earlier check in this pool
    process (and the fake tensors they hold) go."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def _dynamo_counts() -> dict:
    """What dynamo counted; then its state goes (the graphs and fake tensors a later test in this pool
    process would otherwise find)."""
    counts = {"graph_breaks": graph_breaks(), "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
              "breaks": list(torch._dynamo.utils.counters["graph_break"])}
    torch._dynamo.reset()
    return counts


def compiled_matches(name: str, mesh, schedule: str = "1f1b", chunks: int = 1, backend: str = "inductor",
                     **kw) -> dict:
    """train_matches_single_device with compiled stages, plus what dynamo counted (graph breaks,
    graphs), the weight GEMMs deferred to W, and the compile lines logged."""
    _fresh_counters()
    deferred, records = [], []
    defer = DEFERRED.defer
    DEFERRED.defer = lambda w, work: (deferred.append(w), defer(w, work))[1]    # counted, then queued
    try:
        with logged(records):
            out = train_matches_single_device(name, mesh, schedule, chunks, compile_stages={"backend": backend}, **kw)
    finally:
        del DEFERRED.defer
    return {**out, **_dynamo_counts(), "deferred": len(deferred),
            "logged": [r for r in records if "compil" in r]}


def compiled_predict(name: str, mesh, backend: str = "aot_eager", **kw) -> dict:
    """``predict`` with compiled stages against the model's own forward, then a training step: the
    grad mode changes, so each unit compiles once more (logged as a recompile) and only once."""
    _fresh_counters()
    torch.manual_seed(0)
    model = VARIANTS[name]()
    x, y = batches(2, 8)
    want = model(x[0]).detach()
    records = []
    with logged(records):
        pm = autosplit.parallelize(copy.deepcopy(model), mesh=mesh, num_microbatches=2, example_input=x[0, :4],
                                   compile_stages={"backend": backend}, **kw)
        got = pm.predict(x[0])
        pm.step(x[0], y[0])
        pm.step(x[1], y[1])
        pm.predict(x[1])
    return {"diff": (got - want).abs().max().item(), **_dynamo_counts(), "compile_seconds": pm.compile_seconds,
            "logged": [r for r in records if "compil" in r]}


def compiled_like_eager(name: str, mesh, backend: str = "aot_eager", steps: int = 3, **kw) -> dict:
    """Losses of the same parallel training eager and compiled (for autocast, whose single-device
    reference rounds differently from any split)."""
    losses = {}
    for compiled in (False, True):
        _fresh_counters()
        torch.manual_seed(0)
        model = VARIANTS[name]()
        xs, ys = batches(steps, 8)
        pm = autosplit.parallelize(model, mesh=mesh, num_microbatches=2, example_input=xs[0, :8 // mesh[2] // 2],
                                   compile_stages={"backend": backend} if compiled else False, **kw)
        opt = torch.optim.SGD(pm.parameters(), lr=0.1)
        rows = 8 // pm.dp_size
        run = []
        for x, y in zip(xs, ys):
            sl = slice(pm.dp_rank * rows, (pm.dp_rank + 1) * rows)
            run.append(pm.step(x[sl], y[sl]))
            opt.step()
            opt.zero_grad()
        losses[compiled] = run
        pm.close()
    return {"eager": losses[False], "compiled": losses[True], **_dynamo_counts()}


def compiled_zoo(names: list[str], mesh) -> dict:
    """Per timm / torchvision architecture (tests/models_zoo.py): checks_zoo's comparison with one device
    with compiled stages (aot_eager), and the graph breaks dynamo counted for it."""
    from tests import checks_zoo
    out = {}
    for name in names:
        _fresh_counters()
        r = checks_zoo._one(name, mesh, "1d", compile_stages={"backend": "aot_eager"})
        out[name] = {**{k: r.get(k) for k in ("loss_diff", "param_diff", "refused")}, **_dynamo_counts()}
    return out
