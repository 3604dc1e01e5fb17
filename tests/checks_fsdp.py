"""Functions run on every rank of a test pool (see dist_pool.py) for tests/test_fsdp.py: sharded data
parallelism (``dp_shard``, runtime/parallel/fsdp.py) against single-device training.  Each returns plain data."""
from __future__ import annotations

import copy
import gc
import math

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import autosplit
from tests.dist_checks import batches, max_diff, train_accumulating
from tests.models import VARIANTS


def _adamw(params):
    """AdamW with eps=1e-4: the attention key bias has a true gradient of 0 (softmax ignores a constant
    per query), so its computed gradient is round-off (~1e-8) that differs with the summation order;
    at the default eps=1e-8 Adam would turn that noise into lr-sized steps on both sides."""
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-4)


def _parallel(name, mesh, microbatches, batch, example: bool = True, **kw):
    """``example`` False: no example_input, so the first step re-plans the provisional plan (the
    README's recipe: the optimizer is built over ``pm.parameters()`` before that step)."""
    torch.manual_seed(0)
    model = VARIANTS[name]()
    ref = copy.deepcopy(model)
    dp = mesh[2]
    example_input = torch.randn(batch // dp // microbatches, 3, 32, 32) if example else None
    pm = autosplit.parallelize(model, mesh=mesh, num_microbatches=microbatches, example_input=example_input, **kw)
    rows = slice(pm.dp_rank * batch // dp, (pm.dp_rank + 1) * batch // dp)
    return pm, ref, rows


def adamw_matches(name: str, mesh, schedule: str = "1f1b", chunks: int = 1, microbatches: int = 4,
                  batch: int = 8, steps: int = 3, clip: float | None = None, close: bool = False, **kw):
    """``steps`` AdamW steps with ``dp_shard`` vs single-device training: max |loss diff|, max |param
    diff| of full_state_dict, whether this rank's parameters are dp shards, and the global norms;
    ``close``: then ``pm.close()``."""
    pm, ref, rows = _parallel(name, mesh, microbatches, batch, schedule=schedule, chunks_per_rank=chunks, **kw)
    xs, ys = batches(steps, batch)
    opt, ref_opt = _adamw(pm.parameters()), _adamw(ref.parameters())
    loss_diff, norms = 0.0, []
    for x, y in zip(xs, ys):
        loss = pm.step(x[rows], y[rows])
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        if clip is not None:
            norms.append((pm.clip_grad_norm_(clip), torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item()))
        opt.step(), opt.zero_grad(), ref_opt.step(), ref_opt.zero_grad()
        loss_diff = max(loss_diff, abs(loss - ref_loss.item()))
    sharded = [isinstance(p, DTensor) for p in pm.parameters()]
    out = {"loss_diff": loss_diff, "param_diff": max_diff(pm.full_state_dict(), ref.state_dict()),
           "sharded": sum(sharded), "params": len(sharded), "norms": norms, "plan_dp_shard": pm.plan.dp_shard,
           "coord": (pm.pp_rank, pm.tp_rank, pm.dp_rank)}
    if close:
        pm.close()
    return out


def rebuilt_after_close(runs: list[tuple]) -> list[dict]:
    """``adamw_matches`` for each (name, mesh, options), each module closed before the next is built
    (a dropped one would only be an orphan, released by the next parallelize: not what this checks)."""
    return [adamw_matches(name, mesh, close=True, **kw) for name, mesh, kw in runs]


def accumulate_and_predict(name: str, mesh, micro_steps: int = 2, batch: int = 8, **kw):
    """no_sync accumulation over ``micro_steps`` calls of ``step`` (SGD), then predict and a
    load_full_state_dict round trip, against single-device training."""
    pm, ref, rows = _parallel(name, mesh, 2, batch, **kw)
    xs, ys = batches(micro_steps * 2, batch)
    train_accumulating(pm, ref, xs, ys, rows, micro_steps, updates=2, lr=0.5)
    out = {"param_diff": max_diff(pm.full_state_dict(), ref.state_dict())}
    with torch.no_grad():
        out["predict"] = (pm.predict(xs[0][rows]) - ref(xs[0][rows])).abs().max().item()
    torch.manual_seed(5)
    other = VARIANTS[name]().state_dict()
    pm.load_full_state_dict(other)
    out["load"] = max_diff(pm.full_state_dict(), other)
    return out


def bf16_close(name: str, mesh, steps: int = 3, batch: int = 8, **kw):
    """autocast=bfloat16 with dp_shard (FSDP2's MixedPrecisionPolicy gathers bf16, keeps fp32 shards)
    vs the same model under autocast on one device; and the parameters' dtype."""
    pm, ref, rows = _parallel(name, mesh, 2, batch, autocast=torch.bfloat16, **kw)
    xs, ys = batches(steps, batch)
    opt, ref_opt = _adamw(pm.parameters()), _adamw(ref.parameters())
    loss_diff = 0.0
    for x, y in zip(xs, ys):
        loss = pm.step(x[rows], y[rows])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        opt.step(), opt.zero_grad(), ref_opt.step(), ref_opt.zero_grad()
        loss_diff = max(loss_diff, abs(loss - ref_loss.item()))
    dtypes = sorted({str(p.dtype) for p in pm.parameters()})
    return {"loss_diff": loss_diff, "param_diff": max_diff(pm.full_state_dict(), ref.state_dict()), "dtypes": dtypes}


def held_beyond_user_model(name: str, mesh, dp_shard: str = "stage", microbatches: int = 2, batch: int = 8,
                           drop_user_model: bool = False):
    """Issue 50 item 8: the live tensor bytes autosplit holds on this rank right after ``parallelize`` of
    a model built on the CPU (not meta) under ``dp_shard``, beyond the user's own model.

    The model is built here; its storages (the user's untrained copy, documented to stay theirs) are
    left out of the count (``drop_user_model``: the model is deleted after parallelize instead, so all
    that stays is autosplit's; ``pm.model`` keeps it, so it is counted then).  Against this rank's
    stages' parameter bytes at their full (tp-local) shapes and the bytes of its shards."""
    from tests.test_meta_init import _local_bytes, live_tensor_bytes
    before = live_tensor_bytes()
    torch.manual_seed(0)
    model = VARIANTS[name]()
    user = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    example = torch.randn(batch // mesh[2] // microbatches, 3, 32, 32)
    pm = autosplit.parallelize(model, mesh=mesh, num_microbatches=microbatches, example_input=example,
                               dp_shard=dp_shard)
    del example
    if drop_user_model:
        del model
        user = set()
    gc.collect()
    held = live_tensor_bytes(exclude=user) - before
    local = [p for m in pm.raw_modules for p in m.parameters()]
    stage = sum(math.prod(p.shape) * p.element_size() for p in local)
    shards = sum(_local_bytes(p) for p in local)
    return {"held": held, "stage": stage, "shards": shards, "ratio": held / stage,
            "sharded": sum(isinstance(p, DTensor) for p in local), "coord": (pm.pp_rank, pm.tp_rank, pm.dp_rank)}
