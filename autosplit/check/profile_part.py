"""The profile part: today's ``autosplit profile`` (autosplit/profiling/job.py), run inside the check's world.

Terms: see autosplit/check/__init__.py (part, record) and autosplit/profiling/job.py (*in a job*: the
device's kernels on rank 0, the collectives of every group size and node span on every rank, fitted
into one profile that every rank gets).
  written -- rank 0 writes the profile file (``DIR/profile.json``) and reads it back: the part passes
             when every rank measured, the file was written and what it reads back is what was
             measured.  The prediction part then plans with that file (unless ``--device`` names
             another profile).
"""
from __future__ import annotations

import time
from pathlib import Path

from autosplit.check.record import make_record
from autosplit.profiling.cli import DEFAULT_SECONDS, describe

QUICK_SECONDS = 1.0


def run_profile_part(cw, directory, quick: bool = False, seconds: float | None = None) -> dict:
    """Measure the world's profile into ``directory/profile.json``; rank 0 prints it and the verdict.

    Args:
        cw: the check's world (job.py).
        directory: where the profile file goes.
        quick: time the kernels for ``QUICK_SECONDS`` instead of ``autosplit profile``'s default.
        seconds: the kernels' timed seconds (overrides ``quick``).
    Returns the part's record (the same on every rank); ``record["path"]`` is the file.
    """
    from autosplit.cost_model import profile_file
    from autosplit.profiling.job import measure_profile
    seconds = seconds or (QUICK_SECONDS if quick else DEFAULT_SECONDS)
    path = Path(directory) / "profile.json"
    if cw.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
    cw.barrier()                      # the folder exists before any rank measures (rank 0 writes into it)
    cw.say(f"profile: measuring {cw.size} rank{'s' if cw.size > 1 else ''} (kernels {seconds:g} s, collectives of "
           f"every group size) as autosplit profile does")
    start, problem, summary = time.perf_counter(), None, {}
    try:
        profile = measure_profile(str(path), seconds=seconds)
        if cw.rank == 0:
            back = profile_file.read(path)
            if profile_file.to_dict(back) != profile_file.to_dict(profile):
                problem = f"{path} reads back other numbers than were measured"
            summary = profile_file.to_dict(profile)
            cw.say(describe(profile))
    except Exception as exc:        # an AutosplitError or the backend's own: reported, the other parts still run
        problem = f"rank {cw.rank}: measure_profile: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
    seconds_taken = time.perf_counter() - start
    problems = [p for p in cw.gather(problem) if p]
    summary = cw.gather(summary)[0]
    if problems:
        record = make_record("profile", False, problems[0], seconds=seconds_taken, path=None, problems=problems)
    else:
        record = make_record("profile", True, f"measured in {seconds_taken:.1f} s, written to {path.resolve()}",
                             seconds=seconds_taken, path=str(path.resolve()), profile=summary)
    cw.say(record["line"])
    return record
