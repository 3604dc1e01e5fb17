"""Where one traced step's time went, in the parts ``plan.predicted_step()`` names, and which part differs most.

Terms: see runtime/pipeline/trace_step.py (range, lanes, net time) and cost_model/step_time.py (the
predicted parts).
  parts    -- of one rank's traced step (seconds): ``compute`` (its F / B / I / W actions, net of the
              communication ranges nested in them), ``tp`` (tensor-parallel collective waits: ranges
              named ``... over <axis>``), ``dp`` (``dp all_reduce ...`` and ``loss all_reduce``), ``pp``
              (every other communication range: posting transfer groups, waiting for a receive or for
              the step's sends), ``bubble`` (the rest of the step: idle, or host work no range covers).
              A communication range nested in another communication range counts once, in the outer one.
  differs  -- the part whose measured and predicted seconds are furthest apart (absolute).
"""
from __future__ import annotations

PARTS = ("compute", "tp", "pp", "dp", "bubble")
_PREDICTED = {"compute": "compute", "tp": "tp_comm", "pp": "pp_comm", "dp": "dp_comm", "bubble": "bubble"}


def _kind(name: str) -> str:
    if name.startswith("dp ") or name.startswith("loss all_reduce"):
        return "dp"
    if " over " in name:
        return "tp"
    return "pp"


def _inside(inner: dict, outer: dict) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] and inner is not outer


def measured_parts(events: list[dict], rank: int) -> dict[str, float]:
    """The parts of global rank ``rank``'s step (seconds) from ``StepTrace.events``, and ``step``."""
    mine = [e for e in events if e.get("ph") == "X" and e["pid"] == rank]
    step = sum(e["dur"] for e in mine if e["name"] == "step")
    comm = [e for e in mine if e["cat"] == "communication"]
    outer = [e for e in comm if not any(_inside(e, o) for o in comm)]
    out = dict.fromkeys(PARTS, 0.0)
    for e in outer:
        out[_kind(e["name"])] += e["dur"]
    for e in mine:
        if e["cat"] == "compute":
            out["compute"] += e["dur"] - sum(c["dur"] for c in outer if _inside(c, e))
    out["bubble"] = max(0.0, step - sum(out[p] for p in PARTS if p != "bubble"))
    out = {k: v * 1e-6 for k, v in out.items()}          # the trace's microseconds -> seconds
    out["step"] = step * 1e-6
    return out


def predicted_parts(prediction) -> dict[str, float]:
    """The same parts of a ``StepPrediction`` (seconds)."""
    return {p: getattr(prediction, _PREDICTED[p]) for p in PARTS}


def differs_most(measured: dict[str, float], predicted: dict[str, float]) -> tuple[str, float, float]:
    """(part, measured s, predicted s) of the part furthest from its prediction."""
    part = max(PARTS, key=lambda p: abs(measured[p] - predicted[p]))
    return part, measured[part], predicted[part]
