"""A part's record and its one verdict line; the JSON file the records go to.

Terms: see autosplit/check/__init__.py (part, record).  A record is a plain dict::

    {"part": "numerics", "passed": True, "line": "numerics: PASS ...", ...the part's numbers}

``write_records`` (rank 0) puts every part's record, with the world's description, into ``DIR/check.json``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path


def verdict_line(part: str, passed: bool, text: str) -> str:
    """``"<part>: PASS <text>"`` or ``"<part>: FAIL <text>"``: the line a part ends in."""
    return f"{part}: {'PASS' if passed else 'FAIL'} {text}"


def make_record(part: str, passed: bool, text: str, **numbers) -> dict:
    """A part's record: its verdict, its line and its numbers (JSON-ready values)."""
    return {"part": part, "passed": bool(passed), "line": verdict_line(part, passed, text), **numbers}


def _plain(value):
    """``value`` with what JSON cannot hold made plain: non-finite floats as strings, tuples as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def write_records(directory, world: dict, records: list[dict]) -> Path:
    """Write ``{"world": world, "parts": {part: record}}`` to ``directory/check.json``; returns its path."""
    path = Path(directory) / "check.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_plain({"world": world, "parts": {r["part"]: r for r in records}}), indent=1))
    return path
