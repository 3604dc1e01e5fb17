"""The schedule's Gantt chart as inline SVG: one row per pipeline rank, one box per compute.

Terms: view, bar, bubble as in report/timeline.py.  A box is coloured by its action kind (the colour
map comes from the caller, built from the kinds found), numbered by microbatch, and drawn lighter for
chunks after the first.  The row's background is hatched, so every bubble (idle time) shows as a
hatched gap; each row's label gives its idle share.  A box's tooltip (SVG ``<title>``) names the
action, its stage and chunk, and its start and end.
"""
from __future__ import annotations

from html import escape as e

_LEFT, _WIDTH, _ROW, _TOP = 130, 1000, 30, 22    # px: label column, chart width, row height, axis height


def _nice_step(raw: float) -> float:
    """The smallest of 1, 2, 5 x a power of ten that is >= ``raw`` (> 0): the axis tick spacing."""
    power = 1.0
    while power * 10 <= raw:
        power *= 10
    while power > raw:
        power /= 10
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def gantt_svg(view: dict, pp: int, colours: dict[str, str]) -> str:
    """SVG text for one view (``timeline.timeline()["views"][name]``)."""
    span = view["makespan"] or 1.0
    unit = view["unit"]

    def x(v: float) -> float:
        return _LEFT + _WIDTH * v / span
    height = _TOP + pp * _ROW + 4
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="gantt-svg" width="{_LEFT + _WIDTH + 10}" '
           f'height="{height}" role="img" aria-label="pipeline schedule, {unit} view">',
           '<defs><pattern id="idle-{u}" width="6" height="6" patternUnits="userSpaceOnUse" '
           'patternTransform="rotate(45)"><rect width="6" height="6" fill="#fafafa"/>'
           '<line x1="0" y1="0" x2="0" y2="6" stroke="#d0d0d0" stroke-width="2"/></pattern></defs>'
           .replace("{u}", unit)]
    step = _nice_step(span / 6)
    k = 0
    while k * step <= span * 1.0001:
        tx = x(k * step)
        label = f"{k * step:g}" if unit == "step" else f"{k * step:.3g}"
        out.append(f'<line x1="{tx:.1f}" y1="{_TOP - 4}" x2="{tx:.1f}" y2="{height - 4}" class="tick"/>'
                   f'<text x="{tx:.1f}" y="{_TOP - 8}" class="axis">{label}</text>')
        k += 1
    out.append(f'<text x="4" y="{_TOP - 8}" class="axis">{e(unit)}</text>')
    for r in range(pp):
        y = _TOP + r * _ROW
        idle = 1 - view["busy"][r] / span if span else 0.0
        out.append(f'<text x="4" y="{y + _ROW / 2 + 4:.1f}" class="rowlabel">rank {r} '
                   f'<tspan class="idle">idle {100 * idle:.0f}%</tspan></text>'
                   f'<rect x="{_LEFT}" y="{y + 2}" width="{_WIDTH}" height="{_ROW - 4}" fill="url(#idle-{unit})"/>')
    for b in view["bars"]:
        x0, x1 = x(b["start"]), x(b["end"])
        y = _TOP + b["rank"] * _ROW + 2
        w = max(x1 - x0, 0.5)
        fade = 1.0 - 0.45 * min(b["chunk"], 3) / 3
        tip = (f"{b['stage']}{b['kind']}{b['microbatch']}: stage {b['stage']} (chunk {b['chunk']}), {b['kind']} of "
               f"microbatch {b['microbatch']}, {b['start']:.4g}-{b['end']:.4g} {unit}")
        out.append(f'<g class="box" data-kind="{e(b["kind"])}"><title>{e(tip)}</title>'
                   f'<rect x="{x0:.2f}" y="{y}" width="{w:.2f}" height="{_ROW - 4}" '
                   f'fill="{colours.get(b["kind"], "#888")}" fill-opacity="{fade:.2f}" stroke="#fff" stroke-width="0.5"/>')
        if w >= 9:
            out.append(f'<text x="{(x0 + x1) / 2:.2f}" y="{y + _ROW / 2 + 2:.1f}" class="mb">{b["microbatch"]}</text>')
        out.append("</g>")
    idle = view["idle_fraction"]
    out.append("</svg>")
    return "".join(out) + f'<p class="note">makespan {span:.4g} {unit}; bubbles {100 * idle:.1f}% of rank-time</p>'
