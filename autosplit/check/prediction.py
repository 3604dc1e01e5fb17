"""The prediction part: a few steps of the user's own plan, timed, beside ``plan.predicted_step()``.

Terms: see autosplit/check/__init__.py (part, record), step_parts.py (parts, differs) and memory.py (peak).
  case      -- one (model, global batch) to run: ``--model NAME --mesh PP,TP,DP --batch B`` (``--batch``
               may list several, e.g. 8,16,32: one case each, in one world); every plan option of
               ``autosplit plan`` applies (``--num-microbatches``, ``--schedule``, ``--autocast``, ...).
  global batch -- rows of one ``pm.step`` over all dp replicas (replica k takes rows [k*B/dp, (k+1)*B/dp)),
               split into ``num_microbatches`` microbatches; default 8 rows a microbatch.
  measured  -- per rank the median of ``steps`` timed ``pm.step`` calls (after ``warmup`` untimed ones;
               on CUDA each ended by a synchronize), the optimizer step (AdamW, so its two moments
               exist as the plan's memory assumes) outside the timing; the step's time is the slowest
               rank's median.
  model     -- built on the meta device as ``autosplit plan`` builds it, each rank initializing only its
               own shards with ``fill`` (the values do not change the timing).
  predicted -- ``plan.predicted_step()`` of the plan ``parallelize`` built: with ``--device`` its profile,
               else the profile part's file when that part ran, else parallelize's default (the GPU's
               built-in profile, or this machine measured).  Predicted memory per rank: the sum of
               ``memory_bytes`` of the stages the rank runs.
  ratio     -- measured / predicted step time; the case passes when every rank's loss is finite and
               the ratio lies within [1 / max_ratio, max_ratio].
  traced    -- one more step under ``pm.trace_step`` (its Chrome trace written beside the records), whose
               parts on the predicted slowest pipeline rank name the part that differs most.
"""
from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch

from autosplit.check.job import one_line, release_open_modules
from autosplit.check.memory import PeakMemory
from autosplit.check.record import make_record
from autosplit.check.step_parts import PARTS, differs_most, measured_parts, predicted_parts
from autosplit.errors import AutosplitError

DEFAULT_MODEL = "autosplit.check.tiny_vit:tiny_vit"
ROWS_PER_MICROBATCH = 8


def fill(name: str, t: torch.Tensor) -> None:
    """``init_fn`` for a model built on the meta device: values that train sanely for a few timed steps
    (the timing does not depend on them): small normal values for matrices and embeddings, ones for
    1-dim weights (norms' scales), zeros for the other vectors (biases)."""
    if t.dim() >= 2:
        torch.nn.init.normal_(t, std=0.02)
    elif name.endswith("weight"):
        torch.nn.init.ones_(t)
    else:
        torch.nn.init.zeros_(t)


def _gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.3g}"


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch(batch: int | None, mesh, m: int) -> int:
    if batch is None:
        return ROWS_PER_MICROBATCH * mesh.dp * m
    if batch % (mesh.dp * m):
        raise AutosplitError(f"--batch {batch}: not divisible by dp({mesh.dp}) * num_microbatches({m}) = "
                             f"{mesh.dp * m}; use a multiple of {mesh.dp * m}")
    return batch


def _time_steps(pm, x, y, steps: int, warmup: int, device) -> tuple[list[float], float]:
    """(the timed steps' seconds, the last loss) on this rank (see *measured*)."""
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    times, loss = [], float("nan")
    for k in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        loss = pm.step(x, y)
        _sync(device)
        if k >= warmup:
            times.append(time.perf_counter() - t0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return times, loss


def run_case(cw, spec: str, mesh, batch: int | None, options, image_size: int | None, steps: int, warmup: int,
             trace_path: Path | None) -> dict:
    """One case on this rank: its measurements, or ``failure`` naming the action that raised."""
    import dataclasses

    import autosplit
    from autosplit.model_spec import build_model
    from autosplit.inputs import default_input_shape
    out = {"rank": cw.rank, "failure": None}
    action = "build the model"
    try:
        m = options.num_microbatches or 2 * mesh.pp
        options = dataclasses.replace(options, num_microbatches=m)
        batch = _batch(batch, mesh, m)
        model = build_model(spec, image_size)                     # on the meta device
        shape = default_input_shape(model, image_size)
        classes = getattr(model, "num_classes", None) or 1
        rows = batch // mesh.dp
        memory = PeakMemory(cw.device)
        memory.start()
        action = "parallelize"
        pm = autosplit.parallelize(model, mesh=mesh, options=options,
                                   example_input=torch.randn(rows // m, *shape), init_fn=fill)
        # every rank of a replica (its pp and tp ranks) feeds the same batch: seeded by the dp coordinate
        g = torch.Generator(device=cw.device).manual_seed(mesh.coord_of(cw.rank).dp + 1)
        x = torch.randn(rows, *shape, device=cw.device, generator=g)
        y = torch.randint(0, classes, (rows,), device=cw.device, generator=g)
        action = "timed steps"
        times, loss = _time_steps(pm, x, y, steps, warmup, cw.device)
        peak = memory.peak()
        action = "trace_step"
        traced = pm.trace_step(x, y, trace_path)
        prediction = pm.plan.predicted_step()
        slow_rank = cw_rank_of(mesh, prediction.rank)
        out.update(batch=batch, microbatch=rows // m, num_microbatches=m, median=statistics.median(times),
                   times=times, loss=loss, peak=peak, memory_kind=memory.kind,
                   predicted_memory=sum(s.memory_bytes for s in pm.plan.stages if s.pp_rank == pm.pp_rank),
                   predicted=prediction.total, predicted_parts=predicted_parts(prediction),
                   slow_rank=slow_rank, measured_parts=measured_parts(traced.events, slow_rank),
                   profile=getattr(pm.plan.profile, "name", str(options.device)))
        action = "close"
        pm.close()
    except Exception as exc:
        out["failure"] = f"rank {cw.rank}, {action}: {one_line(exc)}"
        release_open_modules()
    return out


def cw_rank_of(mesh, pp_rank: int) -> int:
    """The global rank at (pp_rank, tp 0, dp 0): whose traced step stands for that pipeline rank."""
    return mesh.rank_of(pp=pp_rank, tp=0, dp=0)


def _case_record(spec, mesh, options, results: list[dict], max_ratio: float) -> dict:
    failed = [r["failure"] for r in results if r["failure"]]
    if failed:
        return {"model": spec, "mesh": [mesh.pp, mesh.tp, mesh.dp], "passed": False, "failure": failed[0],
                "ranks": results}
    r0 = results[0]
    measured = max(r["median"] for r in results)
    ratio = measured / r0["predicted"] if r0["predicted"] > 0 else float("inf")
    part, part_measured, part_predicted = differs_most(r0["measured_parts"], r0["predicted_parts"])
    finite = all(math.isfinite(r["loss"]) for r in results)
    passed = finite and 1 / max_ratio <= ratio <= max_ratio
    return {"model": spec, "mesh": [mesh.pp, mesh.tp, mesh.dp], "batch": r0["batch"], "microbatch": r0["microbatch"],
            "num_microbatches": r0["num_microbatches"], "autocast": str(options.autocast), "profile": r0["profile"],
            "passed": passed, "finite_loss": finite, "measured": measured, "predicted": r0["predicted"],
            "ratio": ratio, "max_ratio": max_ratio, "slow_rank": r0["slow_rank"],
            "measured_parts": r0["measured_parts"], "predicted_parts": r0["predicted_parts"],
            "differs_most": {"part": part, "measured": part_measured, "predicted": part_predicted},
            "memory": [{"rank": r["rank"], "measured": r["peak"], "predicted": r["predicted_memory"],
                        "kind": r["memory_kind"]} for r in results],
            "ranks": results}


def _lines(c: dict) -> list[str]:
    mesh = "(" + ",".join(map(str, c["mesh"])) + ")"
    if "failure" in c:
        return [f"  FAIL {c['model']} mesh {mesh}: {c['failure']}"]
    ms = lambda s: f"{s * 1e3:.4g}"                 # noqa: E731
    parts = ", ".join(f"{p} {ms(c['measured_parts'][p])}/{ms(c['predicted_parts'][p])}" for p in PARTS)
    memory = ", ".join(f"rank {e['rank']} {_gib(e['measured'])}/{_gib(e['predicted'])}" for e in c["memory"][:8])
    more = f", ... ({len(c['memory'])} ranks)" if len(c["memory"]) > 8 else ""
    d = c["differs_most"]
    return [f"  {'PASS' if c['passed'] else 'FAIL'} {c['model']} mesh {mesh}, batch {c['batch']} "
            f"({c['num_microbatches']} x {c['microbatch']} rows), autocast {c['autocast']}, profile {c['profile']}",
            f"    step: measured {ms(c['measured'])} ms (median, slowest rank), predicted {ms(c['predicted'])} ms, "
            f"measured/predicted {c['ratio']:.2f}" + ("" if c["finite_loss"] else "; loss not finite"),
            f"    parts of rank {c['slow_rank']}'s traced step, ms measured/predicted: {parts}",
            f"    peak memory GiB measured ({c['memory'][0]['kind']})/predicted: {memory}{more}",
            f"    differs most: {d['part']} (measured {ms(d['measured'])} ms, predicted {ms(d['predicted'])} ms)"]


def run_prediction(cw, spec: str | None, mesh, batches: list[int] | None, options, image_size: int | None = None,
                   steps: int = 5, warmup: int = 2, directory=None, max_ratio: float = 2.0) -> dict:
    """Time every case on every rank; rank 0 prints each case and the part's verdict.

    Args:
        cw: the check's world (job.py).
        spec: a timm model name or ``package.module:factory``; None: the check's tiny ViT.
        mesh: (pp, tp, dp) or "pp,tp,dp" (dp may be -1: the rest of the world).
        batches: global batches, one case each; None: one case at 8 rows a microbatch.
        options: the plan's ``PlanOptions`` (``device`` None: see *predicted*).
        image_size: the input's height and width (default: the model's).
        steps, warmup: timed and untimed steps per case.
        directory: where each case's Chrome trace goes (``prediction-trace-<k>.json``); None: not written.
        max_ratio: the band the measured/predicted ratio must lie in (see *ratio*).
    Returns the part's record (the same on every rank).
    """
    from autosplit.mesh import MeshShape
    start = time.perf_counter()
    spec = spec or DEFAULT_MODEL
    shape = MeshShape.parse(mesh, world_size=cw.size)
    cw.say(f"prediction: {spec}, mesh {shape}, {steps} timed steps after {warmup} (median), against "
           f"plan.predicted_step()")
    cases = []
    for k, batch in enumerate(batches or [None]):
        trace = Path(directory) / f"prediction-trace-{k}.json" if directory is not None else None
        mine = run_case(cw, spec, shape, batch, options, image_size, steps, warmup, trace)
        cases.append(_case_record(spec, shape, options, cw.gather(mine), max_ratio))
        for line in _lines(cases[-1]):
            cw.say(line)
    failed = [c for c in cases if not c["passed"]]
    done = [c for c in cases if "ratio" in c]
    ratios = ", ".join(f"{c['ratio']:.2f}" for c in done)
    if failed:
        c = failed[0]
        why = c.get("failure") or (f"batch {c['batch']}: measured/predicted {c['ratio']:.2f} outside "
                                   f"[{1 / max_ratio:.2f}, {max_ratio:.2f}]"
                                   + ("" if c["finite_loss"] else ", loss not finite")
                                   + f"; differs most: {c['differs_most']['part']}")
        text = f"{spec}: {why}" + (f" ({len(failed)} of {len(cases)} cases failed)" if len(cases) > 1 else "")
    else:
        parts = ", ".join(sorted({c["differs_most"]["part"] for c in done}))
        text = (f"{spec}: measured/predicted {ratios} (within [{1 / max_ratio:.2f}, {max_ratio:.2f}]); "
                f"differs most: {parts}")
    record = make_record("prediction", not failed, text, seconds=time.perf_counter() - start, cases=cases)
    cw.say(record["line"])
    return record
