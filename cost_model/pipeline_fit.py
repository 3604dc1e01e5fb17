"""Fit a profile's ``pass_overhead`` to a reference pipeline measured on its host.

Terms:
  reference  -- one round of profiling/pipeline_bench.py's result: a 1F1B pipeline of ``microbatches`` over the host's
                ``ranks`` (one identical stage each), its stage's forward and backward timed alone, the
                slowest rank's step as measured, and the bytes of one activation (the boundary).
  priced     -- step_time.predict_step of that pipeline with the profile's own sharing, posting, wake and
                resume, every stage priced at the alone times, each boundary at the profile's send_recv
                for its bytes, and ``pass_overhead`` = x.
  fit        -- the x >= 0 at which priced = measured (bisection: priced grows with x); 0 where the
                profile prices the reference at or above what it measured (then nothing is missing).
                Capped at the alone forward + backward: a residual larger than a pass is not a per-pass
                cost.  The profile's is the median over the rounds' fits (one round's is noise's too).
Pure: no process group, no tensors (it prices; profiling/pipeline_bench.py measures).
"""
from __future__ import annotations

import dataclasses

from autosplit.cost_model.comm import p2p_time
from autosplit.cost_model.step_time import StageTimes, predict_step, sharing_of

SCHEDULE = "1f1b"
ITERATIONS = 40       # bisection steps: the bracket shrinks 2^40-fold, far below a microsecond


def priced(profile, ranks: int, microbatches: int, fwd: float, bwd: float, nbytes: int, overhead: float) -> float:
    """Seconds the step predictor gives the reference pipeline with ``pass_overhead`` = ``overhead``."""
    send = p2p_time(nbytes, profile)
    stages = [StageTimes(fwd=fwd, bwd=bwd, send=send if s < ranks - 1 else 0.0) for s in range(ranks)]
    return predict_step(SCHEDULE, ranks, microbatches, 1, stages, sharing_of(profile, 1), profile.p2p_post,
                        profile.p2p_wake, 0.0, profile.resume, overhead).total


def fit_pass_overhead(profile, ranks: int, microbatches: int, reference: tuple[float, float, float, int]) -> float:
    """The *fit* of ``pass_overhead`` for ``profile`` (see the module docstring).

    Args:
        profile: the measured DeviceProfile (its other fields final).
        ranks: the reference pipeline's stages (the host's local ranks).
        microbatches: its microbatch count.
        reference: (alone forward s, alone backward s, measured step s, activation bytes).
    """
    fwd, bwd, measured, nbytes = reference
    if priced(profile, ranks, microbatches, fwd, bwd, nbytes, 0.0) >= measured:
        return 0.0
    lo, hi = 0.0, fwd + bwd
    if priced(profile, ranks, microbatches, fwd, bwd, nbytes, hi) <= measured:
        return hi
    for _ in range(ITERATIONS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if priced(profile, ranks, microbatches, fwd, bwd, nbytes, mid) < measured else (lo, mid)
    return (lo + hi) / 2


def with_pass_overhead(profile, ranks: int, microbatches: int, rounds) -> object:
    """``profile`` with its ``pass_overhead`` the median of the fits to each of ``rounds`` (references as
    ``fit_pass_overhead`` takes them, measured in turn); unchanged where there are none."""
    if not rounds:
        return profile
    fits = sorted(fit_pass_overhead(profile, ranks, microbatches, r) for r in rounds)
    return dataclasses.replace(profile, pass_overhead=fits[len(fits) // 2])
