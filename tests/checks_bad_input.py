"""Bad-input cases run on every rank of a test pool (see test_bad_input_runtime.py for the table).

Terms:
  case    -- a function run on every rank that makes one mistake (on every rank, or on one rank
             only) and returns {"error": "Type: message" or None, "ok_after": loss or None}.
  ok_after -- a good step after the mistake: the mistake left the module usable.
Every case builds its own ParallelModule with timeout_s=20, so that a regression hangs for 20 s and
reports, instead of blocking the pool.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import autosplit
from tests.dist_checks import error_of
from tests.models import VARIANTS

TIMEOUT_S = 20


def _rank() -> int:
    return dist.get_rank()


def _batch(rows: int, label_rows: int | None = None):
    g = torch.Generator().manual_seed(rows)
    return torch.randn(rows, 3, 32, 32, generator=g), torch.randint(0, 10, (label_rows or rows,), generator=g)


def _model(seed: int = 0, cls=None):
    torch.manual_seed(seed)
    return (cls or VARIANTS["timm_cls"])()


def _pm(mesh=(2, 1, 1), microbatches=2, example_rows: int | None = 2, seed: int = 0, model=None, **kw):
    example = torch.randn(example_rows, 3, 32, 32) if example_rows else None
    return autosplit.parallelize(model or _model(seed), mesh=mesh, num_microbatches=microbatches,
                                 example_input=example, timeout_s=kw.pop("timeout_s", TIMEOUT_S), **kw)


def _result(error, pm=None) -> dict:
    return {"error": error, "ok_after": pm.step(*_batch(4)) if pm is not None else None}


# ---- parallelize arguments (raised on every rank without communicating) ------------------------
def mesh_product():
    return _result(error_of(_pm, (2, 1, 2)))


def dp_leftover():
    return _result(error_of(_pm, (3, 1, -1)))


def mesh_axis_zero():
    return _result(error_of(_pm, (0, 1, 2)))


def mesh_not_three():
    return _result(error_of(_pm, (2, 1)))


def timeout_zero():
    return _result(error_of(lambda: _pm(timeout_s=0)))


def timeout_negative():
    return _result(error_of(lambda: _pm(timeout_s=-5.0)))


def microbatches_zero():
    return _result(error_of(lambda: _pm(microbatches=0)))


def bad_schedule():
    return _result(error_of(lambda: _pm(schedule="zigzag")))


def loss_reduction_none():
    return _result(error_of(lambda: _pm(loss_fn=torch.nn.CrossEntropyLoss(reduction="none"))))


class _TupleOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = VARIANTS["timm_cls"]()

    def forward(self, x):
        logits = self.inner(x)
        return logits, logits.mean()


class _DictOut(_TupleOut):
    def forward(self, x):
        return {"logits": self.inner(x)}


def tuple_output():
    return _result(error_of(lambda: _pm(model=_model(cls=_TupleOut))))


def dict_output():
    return _result(error_of(lambda: _pm(model=_model(cls=_DictOut))))


# ---- step / predict arguments --------------------------------------------------------------------
def labels_rows_everywhere():
    pm = _pm()
    x, _ = _batch(4)
    return _result(error_of(pm.step, x, torch.randint(0, 10, (2,))), pm)


def labels_rows_one_rank():
    pm = _pm()
    x, y = _batch(4, label_rows=2 if _rank() == 1 else 4)
    return _result(error_of(pm.step, x, y), pm)


def images_not_tensor():
    pm = _pm()
    return _result(error_of(pm.step, "images", torch.zeros(4, dtype=torch.long)), pm)


def indivisible_one_rank():
    pm = _pm()
    return _result(error_of(pm.step, *_batch(5 if _rank() == 1 else 4)), pm)


def shape_one_rank_after_first_step():
    pm = _pm()
    pm.step(*_batch(4))
    return _result(error_of(pm.step, *_batch(8 if _rank() == 1 else 4)), pm)


def lazy_plans_differ_in_batch():
    pm = _pm(example_rows=None)
    return _result(error_of(pm.step, *_batch(8 if _rank() == 1 else 4)), None)


def predict_bad_dtype_one_rank():
    pm = _pm()
    x, _ = _batch(4)
    return _result(error_of(pm.predict, x.double() if _rank() == 1 else x), pm)


# ---- calls that only some ranks make ---------------------------------------------------------------
def clip_on_one_rank():
    pm = _pm()
    pm.step(*_batch(4))
    error = error_of(pm.clip_grad_norm_, 1.0) if _rank() == 1 else error_of(pm.step, *_batch(4))
    return _result(error, pm)


def predict_while_step():
    pm = _pm()
    x, y = _batch(4)
    return _result(error_of(pm.predict, x) if _rank() == 0 else error_of(pm.step, x, y), pm)


def full_state_dict_on_one_rank():
    pm = _pm()
    error = error_of(pm.full_state_dict) if _rank() == 0 else error_of(pm.step, *_batch(4))
    return _result(error, pm)


def clip_max_norm_differs():
    pm = _pm()
    pm.step(*_batch(4))
    return _result(error_of(pm.clip_grad_norm_, 2.0 if _rank() == 1 else 1.0), pm)


def clip_bad_max_norm():
    pm = _pm()
    pm.step(*_batch(4))
    return _result(error_of(pm.clip_grad_norm_, -1.0), pm)


# ---- ranks that planned different jobs or hold different models -----------------------------------
def microbatches_differ():
    one = _rank() == 1
    pm = _pm(microbatches=4 if one else 2, example_rows=1 if one else 2)
    return _result(error_of(pm.step, *_batch(4)))


def schedule_differs():
    pm = _pm(schedule="gpipe" if _rank() == 1 else "1f1b")
    return _result(error_of(pm.step, *_batch(4)))


def seeds_differ_dp():
    pm = _pm(mesh=(1, 1, 2), seed=1 if _rank() == 1 else 0)
    return _result(error_of(pm.step, *_batch(4)))


def seeds_differ_pp():
    pm = _pm(seed=7 if _rank() == 1 else 0)
    return _result(error_of(pm.step, *_batch(4)))


def load_missing_keys_one_rank():
    pm = _pm()
    state = {"nope": torch.zeros(1)} if _rank() == 1 else _model(0).state_dict()
    return _result(error_of(pm.load_full_state_dict, state), pm)


def load_different_values():
    pm = _pm()
    return _result(error_of(pm.load_full_state_dict, _model(5 if _rank() == 1 else 0).state_dict()))


def load_not_a_dict():
    pm = _pm()
    return _result(error_of(pm.load_full_state_dict, [1, 2]), pm)


# ---- mistakes found while running (leave the ranks unusable: fresh pool) ----------------------------
def loss_not_scalar():
    pm = _pm(loss_fn=lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="none"))
    return _result(error_of(pm.step, *_batch(4)))


def run_case(name: str) -> dict:
    """Run the case ``name`` on this rank (the pool runs module-level functions only)."""
    return globals()[name]()


# ---- cost of the checks (run by hand: see the README's "Ranks must agree") -----------------------------
def measure_check_cost(steps: int = 40, mesh=(2, 1, 1)) -> dict:
    """Median step time with and without the per-call check, the check alone, and the one-time
    agreement (plan fields + model checksums) on this rank."""
    import statistics
    import time
    from autosplit.runtime.faults.agreement import check_agreement, model_checksums
    pm = _pm(mesh=mesh)
    x, y = _batch(4)
    pm.step(x, y)

    def median_step() -> float:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            pm.step(x, y)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    with_check, enter = median_step(), pm._enter
    pm._enter = lambda *args: None
    without_check = median_step()
    pm._enter = enter
    gate = []
    for _ in range(200):
        start = time.perf_counter()
        pm._enter("step", x, y)
        gate.append(time.perf_counter() - start)
    start = time.perf_counter()
    check_agreement(pm.world, pm.watchdog, pm.plan, pm.model, False)   # after training the model is
    plan_ms = 1e3 * (time.perf_counter() - start)                         # no longer whole: plan only
    start = time.perf_counter()
    model_checksums(pm.model)
    return {"step_with_ms": 1e3 * with_check, "step_without_ms": 1e3 * without_check,
            "gate_ms": 1e3 * statistics.median(gate), "plan_agreement_ms": plan_ms,
            "checksums_ms": 1e3 * (time.perf_counter() - start),
            "params": sum(p.numel() for p in pm.model.parameters())}


def plan_fails_on_one_rank():
    """Rank 1 cannot plan (a memory budget nothing fits in) at its first step; rank 0 can."""
    pm = _pm(example_rows=None, **({"memory_budget": 1.0} if _rank() == 1 else {}))
    return _result(error_of(pm.step, *_batch(4)))
