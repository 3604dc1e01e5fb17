"""Functions run on every rank of a test pool for tests/test_timm_zoo.py (see dist_pool.py).

Terms:
  reference -- single-device training of the same model (same seed) on the same batches with the same
               SGD steps.  For the models of ``BATCHNORM`` it is gradient accumulation over the same
               microbatches, each forwarded separately (per-microbatch batch statistics, and the running
               statistics updated once per microbatch, as in GPipe); for the others one forward of the
               whole batch (equal, for them, to accumulation up to rounding).
  refused   -- ``parallelize`` raised an ``AutosplitError`` while planning: the model is reported with
               the error's type and message, for the test to judge.
"""
from __future__ import annotations

import copy
import time
import traceback

import torch

import autosplit
from autosplit.errors import AutosplitError
from tests.models_zoo import BATCHNORM, IMAGE, build

STEPS, BATCH, MICROBATCHES, LR = 3, 8, 2, 0.1


def _batches(image: int):
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(STEPS, BATCH, 3, image, image, generator=g)   # (steps, B, 3, H, W)
    ys = torch.randint(0, 10, (STEPS, BATCH), generator=g)
    return xs, ys


def _reference(model, xs, ys, microbatches: int):
    """Losses and state dict after SGD steps of one device, each step accumulating ``microbatches``
    equal row chunks of the batch (1: the whole batch in one forward)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in zip(xs, ys):
        total = 0.0
        for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):
            loss = torch.nn.functional.cross_entropy(model(xm), ym) / microbatches
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model.state_dict()


def _one(name: str, mesh, tp_mode: str, **kw) -> dict:
    """Train ``name`` on ``mesh`` and compare with its reference (every rank computes the reference)."""
    model = build(name)
    xs, ys = _batches(IMAGE[name])
    m = kw.pop("num_microbatches", MICROBATCHES)
    ref_losses, ref_state = _reference(model, xs, ys, m if name in BATCHNORM else 1)
    start = time.perf_counter()
    try:
        pm = autosplit.parallelize(model, mesh=mesh, loss_fn=torch.nn.CrossEntropyLoss(),
                                   num_microbatches=m, tp_mode=tp_mode, example_input=xs[0, : BATCH // m], **kw)
        opt = torch.optim.SGD(pm.parameters(), lr=LR)
    except AutosplitError as exc:
        return {"refused": f"{type(exc).__name__}: {exc}"}
    planned = time.perf_counter()
    losses = []
    with pm:
        for x, y in zip(xs, ys):
            losses.append(pm.step(x, y))
            opt.step()
            opt.zero_grad()
        state = pm.full_state_dict()
    if set(state) != set(ref_state):
        return {"error": f"state keys differ: missing {sorted(set(ref_state) - set(state))}, "
                         f"extra {sorted(set(state) - set(ref_state))}"}
    diffs = {k: (state[k].float() - ref_state[k].float()).abs().max().item() for k in ref_state}
    worst = max(diffs, key=diffs.get)
    return {"loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)), "param_diff": diffs[worst],
            "worst": worst, "losses": losses, "ref_losses": ref_losses,
            "seconds": (planned - start, time.perf_counter() - planned)}


def train_zoo(names: list[str], mesh, tp_mode: str = "1d", **kw) -> dict:
    """Per model name: {"loss_diff", "param_diff", "worst" (the state key of param_diff), "seconds"
    (planning, training), ...} against its reference (``kw``: more parallelize options, e.g. tp_depth), or {"refused": message}, or {"error": message
    with traceback}.  One model's failure does not stop the next (a rank that fails inside a
    collective leaves the others to their timeout)."""
    out = {}
    for name in names:
        try:
            out[name] = _one(name, mesh, tp_mode, **kw)
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    return out
