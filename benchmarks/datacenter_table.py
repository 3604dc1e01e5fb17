"""Predicted vs published step time of the datacenter training runs, priced by autosplit's own planner.

Terms (rows and layouts: cost_model/datacenter_rows.py; the fit: cost_model/datacenter_fit.py):
  row model  -- the row's transformer as torch modules on the meta device (datacenter_models.py).
  predicted  -- ``autosplit.compile(model, mesh=(pp, tp, dp), example_input=<one microbatch>,
                device=<the GPU's built-in profile>, autocast=, recompute=, dp_shard=, schedule=,
                chunks_per_rank=, num_microbatches=)`` then ``plan.predicted_step().total``: one optimizer
                step of the slowest rank.
  error      -- predicted / published - 1; per half of the rows (fit / held out, datacenter_fit.halves)
                the median |error| and the worst; the rows off by more than 35 % with their error when
                every collective is free (compute + bubble + optimizer alone: ``free_comm``).
  MFU        -- model FLOPs per second per GPU over the datasheet peak (datacenter_rows.py *model FLOPs*),
                of the published time and of the predicted one.

Run:
  python benchmarks/datacenter_table.py [--rows ID ...]       price every row with the built-in profiles
  python benchmarks/datacenter_table.py --features            the same, and store each row's features
                                                              (FEATURES) for the fit
  ... --cache FILE                                            keep priced rows in FILE (JSON lines): a run
                                                              split over processes with --rows, or resumed
  python benchmarks/datacenter_table.py --fit                 fit H100 / A100 on the stored features'
                                                              fit half and write the numbers into
                                                              cost_model/device.py
A full pricing run compiles 64 models (tens of layers each): about 20 minutes of one core (meg-15, 1T
parameters over pp 64 and 512 microbatches, alone takes about 2).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from datacenter_models import build  # noqa: E402

import autosplit  # noqa: E402
from autosplit.cost_model import datacenter_fit as dcfit  # noqa: E402
from autosplit.cost_model.datacenter_rows import load_rows  # noqa: E402
from autosplit.cost_model.device import BUILTIN  # noqa: E402

HERE = Path(__file__).resolve().parent
FEATURES = HERE / "datacenter_features.json"
RESULTS = HERE / "datacenter_results.json"
DEVICE = HERE.parent / "cost_model" / "device.py"
FITTED_GPUS = ("h100", "a100")
WORST = 0.35            # issue 51's bound on the worst row: the rows past it are listed with ``free_comm``


def compile_row(row, profile=None):
    """The row's Plan on ``profile`` (default: its GPU's built-in profile)."""
    model, ids = build(row)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autosplit.compile(
            model, mesh=(row.pp, row.tp, row.dp), example_input=ids, device=profile or BUILTIN[row.gpu],
            schedule="interleaved" if row.chunks > 1 else "1f1b", chunks_per_rank=row.chunks,
            num_microbatches=row.microbatches, autocast=getattr(torch, row.autocast), recompute=row.recompute,
            dp_shard=row.dp_shard)


def price(rows, keep_features: bool, cache: Path | None = None) -> tuple[list[dict], list[dict]]:
    """(one result per row, features per row) of compiling and predicting every priceable row.  With
    ``cache`` (a JSON-lines file), rows already in it are read back and each new row is appended as
    it is priced, so that a long run can be split over processes (``--rows``) and resumed."""
    done = {}
    if cache is not None and cache.exists():
        for line in cache.read_text().splitlines():
            entry = json.loads(line)
            done[entry["result"]["id"]] = entry
    results, feats = [], []
    for row in rows:
        if row.id in done:
            results.append(done[row.id]["result"])
            if done[row.id].get("features"):
                feats.append(done[row.id]["features"])
            continue
        entry = _price_row(row, keep_features)
        results.append(entry["result"])
        if entry.get("features"):
            feats.append(entry["features"])
        if cache is not None:
            with cache.open("a") as f:
                f.write(json.dumps(entry) + "\n")
    return results, feats


def _price_row(row, keep_features: bool) -> dict:
    if row.unpriceable:
        return {"result": dict(id=row.id, gpu=row.gpu, reason=row.unpriceable)}
    t = time.perf_counter()
    try:
        plan = compile_row(row)
    except Exception as exc:            # a layout the planner refuses: listed with its reason
        return {"result": dict(id=row.id, gpu=row.gpu, reason=f"refused: {type(exc).__name__}: {exc}"[:200])}
    p = plan.predicted_step()
    result = dict(id=row.id, gpu=row.gpu, model=row.model, layout=_layout(row), approx=row.approx,
                  published=row.published_s, predicted=p.total, compute=p.compute, bubble=p.bubble,
                  tp=p.tp_comm, pp=p.pp_comm, dp=p.dp_comm, optimizer=getattr(p, "optimizer", 0.0),
                  mfu_published=row.mfu(row.published_s), mfu_predicted=row.mfu(p.total),
                  seconds=time.perf_counter() - t)
    print(f"{row.id}: predicted {p.total:.3f} s, published {row.published_s:.3f} s "
          f"({p.total / row.published_s - 1:+.0%}), {time.perf_counter() - t:.0f} s to price", flush=True)
    features = dcfit.features_of(plan, row, BUILTIN[row.gpu]).to_json() if keep_features else None
    return {"result": result, "features": features}


def _layout(row) -> str:
    shard = "fsdp" if row.dp_shard else "ddp"
    parts = [f"tp{row.tp}", f"pp{row.pp}" + (f"x{row.chunks}" if row.chunks > 1 else ""), f"dp{row.dp} {shard}",
             f"mb{row.micro_batch}x{row.microbatches}",
             {"bfloat16": "bf16", "float16": "fp16"}.get(row.autocast, "fp32")]
    if row.recompute:
        parts.append("recompute")
    return " ".join(parts)


def summary(results: list[dict], ids: list[str]) -> tuple[float, float, str]:
    """(median |error|, worst |error|, the worst row's id) over the rows ``ids`` that were priced."""
    errs = {r["id"]: error(r) for r in results if "predicted" in r and r["id"] in ids}
    if not errs:
        return float("nan"), float("nan"), ""
    worst = max(errs, key=lambda k: abs(errs[k]))
    return statistics.median(abs(e) for e in errs.values()), abs(errs[worst]), worst


def error(r: dict) -> float:
    """A priced row's predicted / published - 1."""
    return r["predicted"] / r["published"] - 1


def free_comm(r: dict) -> float:
    """A priced row's error with every collective free: (compute + bubble + optimizer) / published - 1, the
    least any communication model can predict with these kernel numbers."""
    return (r["compute"] + r["bubble"] + r["optimizer"]) / r["published"] - 1


def table(results: list[dict]) -> str:
    """A markdown table of every row, the halves' summaries, then the rows not priced."""
    priced = [r for r in results if "predicted" in r]
    fit, held = dcfit.halves([r["id"] for r in priced])
    lines = ["| row | GPU | model | layout | half | published s | predicted s | error | MFU pub. | MFU pred. | "
             "compute / bubble / tp / pp / dp / opt. s |", "|" + "---|" * 11]
    for r in priced:
        lines.append(f"| {r['id']} | {r['gpu']} | {r['model']} | {r['layout']} | "
                     f"{'fit' if r['id'] in fit else 'held'} | {r['published']:.3f} | {r['predicted']:.3f} | "
                     f"{error(r):+.0%} | {r['mfu_published']:.0%} | "
                     f"{r['mfu_predicted']:.0%} | {r['compute']:.2f} / {r['bubble']:.2f} / {r['tp']:.2f} / "
                     f"{r['pp']:.2f} / {r['dp']:.2f} / {r['optimizer']:.2f} |")
    lines.append("")
    for name, ids in (("fit half", fit), ("held-out half", held), ("all", fit + held)):
        med, worst, which = summary(priced, ids)
        lines.append(f"- {name} ({len(ids)} rows): median |error| {med:.1%}, worst {worst:.1%} ({which})")
    for gpu in FITTED_GPUS:
        for name, ids in (("fit", fit), ("held", held)):
            mine = [r["id"] for r in priced if r["gpu"] == gpu and r["id"] in ids]
            med, worst, which = summary(priced, mine)
            lines.append(f"  - {gpu} {name} ({len(mine)} rows): median {med:.1%}, worst {worst:.1%} ({which})")
    for name, ids in (("fit half", fit), ("held-out half", held)):
        lines.append(f"- {name}, rows off by more than {WORST:.0%}, and with every collective free: " + (", ".join(
            f"{r['id']} {error(r):+.0%} ({free_comm(r):+.0%})" for r in priced
            if r["id"] in ids and abs(error(r)) > WORST) or "none"))
    lines.append("")
    lines.append("Not priced: " + "; ".join(f"{r['id']} ({r['reason']})" for r in results if "reason" in r))
    return "\n".join(lines)


def fit_and_write() -> dict:
    """Fit each GPU on its fit-half rows of FEATURES and write DATACENTER_FIT into cost_model/device.py."""
    feats = [dcfit.RowFeatures(**f) for f in json.loads(FEATURES.read_text())]
    fitted, rows = dcfit.fit_all(feats)
    text = DEVICE.read_text()
    start, end = text.index("DATACENTER_FIT = {"), text.index("# <<< datacenter fit")
    block = "DATACENTER_FIT = {\n"
    for gpu in FITTED_GPUS:
        values = ", ".join(f"{k}={v:.4g}" if k != "op_overhead" else f"{k}={round(v * 1e6, 1)}e-6"
                           for k, v in fitted[gpu].items())
        block += f'    "{gpu}": dict({values}),\n'
    block += "}\nDATACENTER_FIT_ROWS = {\n"
    for gpu in FITTED_GPUS:
        ids = [f'"{i}"' for i in rows[gpu]]
        lines = [", ".join(ids[k:k + 9]) for k in range(0, len(ids), 9)]
        block += f'    "{gpu}": (' + ",\n              ".join(lines) + "),\n"
    block += "}\n"
    DEVICE.write_text(text[:start] + block + text[end:])
    return fitted


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="*", help="row ids (default: every row)")
    ap.add_argument("--features", action="store_true", help="store each priced row's features for --fit")
    ap.add_argument("--fit", action="store_true", help="fit on the stored features and write cost_model/device.py")
    ap.add_argument("--cache", type=Path, help="JSON-lines file of priced rows: read back, and appended to")
    args = ap.parse_args()
    if args.fit:
        for gpu, values in fit_and_write().items():
            print(gpu, values)
        return
    rows = [r for r in load_rows() if not args.rows or r.id in args.rows]
    results, feats = price(rows, args.features, args.cache)
    if args.features and not args.rows:
        FEATURES.write_text(json.dumps(feats))
    if not args.rows:
        RESULTS.write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
