"""``report.html``: one self-contained page that shows a Plan (no network: styles, script and data inline).

Sections: the mesh and rank layout; the stage table; per-stage bars of predicted forward / backward /
communication time and of memory against the budget; the schedule as a Gantt chart per pipeline rank;
tensor parallelism (regions, split parameters, the collectives of each block); each rank's stage code,
searchable, with the module path beside every line.

Terms (plan.py has the rest):
  budget  -- the memory a stage may use: the device profile's memory size (``DeviceProfile.memory_bytes``);
             unknown (no bar marker) when the plan's device is not a built-in profile name and no profile
             is passed in.
  model states -- parameters, gradients and optimizer moments of a stage: its predicted memory minus
             the activations it keeps (in flight x per microbatch) and its recomputation peak.
  kind colour -- one colour per action kind, from the kind's position in ``ActionKind`` (then a hash
             of its name), so a kind added later gets a colour of its own with no change here.

The page reads ``plan.to_dict()`` (the plan.json data), the simulator's grid and the graph's
collective nodes; it names no model, layer type, op or mesh axis.  The script and style are package
data next to this file (``html.js`` / ``html.css``, listed in pyproject.toml).
"""
from __future__ import annotations

import html
import json
import zlib
from importlib import resources

from autosplit.cost_model.comm import p2p_time
from autosplit.cost_model.profiles import NAMES, get_profile
from autosplit.report.gantt import gantt_svg
from autosplit.report.summary import _boundary, _bytes, _count, summary_table
from autosplit.report.timeline import timeline
from autosplit.report.tp_tables import collectives, per_block, stage_extra
from autosplit.schedule.actions import ActionKind


_PALETTE = ("#4e79a7", "#59a14f", "#9c755f", "#bab0ac", "#76b7b2", "#edc948", "#f28e2b", "#b07aa1",
            "#e15759", "#ff9da7")
e = html.escape


def kind_colour(kind: str) -> str:
    known = [k.name for k in ActionKind]
    if kind in known and known.index(kind) < len(_PALETTE):
        return _PALETTE[known.index(kind)]
    return f"hsl({zlib.crc32(kind.encode()) % 360}, 55%, 55%)"


def _profile(plan, profile):
    """The device profile the plan was made for: the one given, else the plan's own (``plan.profile``,
    set by compile), else a built-in name (a measured CPU profile is not rebuilt here: measuring again
    would give other numbers)."""
    if profile is not None:
        return profile
    if plan.profile is not None:
        return plan.profile
    name = plan.device.lower()
    return get_profile(name) if name in NAMES and name != "cpu" else None


def render_report(plan, codes: dict[tuple[int, int, int], str], profile=None) -> str:
    """The page as one HTML string.

    Args:
        plan: the Plan to show.
        codes: (pp rank, tp rank, stage) -> that rank's annotated stage code (``dump.rank_codes``).
        profile: the DeviceProfile the plan was made with, for the budget and communication times
            (default: the built-in profile named by ``plan.device``).
    """
    profile = _profile(plan, profile)
    data = plan.to_dict()
    data.pop("nodes")
    rows = collectives(plan, profile) if plan.tp_plan is not None else []

    def edge_time(stage: int) -> float:
        return p2p_time(sum(t.nbytes for t in plan.stages[stage].outputs), profile) if profile else 0.0

    tl = timeline(plan, edge_time, stage_extra(rows))
    colours = {k: kind_colour(k) for k in tl["kinds"]}
    body = [
        f"<header><h1>autosplit plan</h1><p>{e(summary_table(plan).splitlines()[0])}</p>"
        f"<p class=note>Predicted by the cost model for device profile <b>{e(plan.device)}</b>; nothing "
        f"here is measured.</p></header>",
        _section("mesh", "Mesh and rank layout", _mesh(plan)),
        _section("stages", "Stages", _stage_table(plan)),
        _section("bars", "Predicted time and memory per stage", _bars(plan, profile)),
        _section("schedule", "Schedule", _schedule(plan, tl, colours)),
        _section("tp", "Tensor parallelism", _tensor_parallel(data["tensor_parallel"], rows)),
        _section("code", "Stage code per rank", _code(plan, codes)),
        f'<script type="application/json" id="plan-data">{_json(data)}</script>',
    ]
    return _page(body)


def _json(data) -> str:
    return json.dumps(data, default=str).replace("</", "<\\/")


def _asset(name: str) -> str:
    return resources.files("autosplit.report").joinpath(name).read_text(encoding="utf-8")


def _page(body: list[str]) -> str:
    csp = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>autosplit plan</title><style>{_asset('html.css')}</style></head><body>"
            f"<nav>{_nav()}</nav><main>{''.join(body)}</main>"
            f"<script>{_asset('html.js')}</script></body></html>\n")


_SECTIONS = (("mesh", "mesh"), ("stages", "stages"), ("bars", "time & memory"), ("schedule", "schedule"),
             ("tp", "tensor parallel"), ("code", "code"))


def _nav() -> str:
    return " ".join(f'<a href="#{k}">{t}</a>' for k, t in _SECTIONS)


def _section(key: str, title: str, inner: str) -> str:
    return f'<section id="{key}"><h2>{e(title)}</h2>{inner}</section>'


def _table(header, rows, cls="") -> str:
    head = "".join(f"<th>{e(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _mesh(plan) -> str:
    m = plan.mesh
    text = (f"<p>pp={m.pp} pipeline ranks x tp={m.tp} tensor-parallel ranks x dp={m.dp} data-parallel "
            f"replicas = {m.size} ranks. Global rank = (pp_rank * dp + dp_rank) * tp + tp_rank: the ranks of "
            f"one tensor-parallel group are consecutive. "
            + ("Rank r holds stages r and 2pp-1-r (zb-v's V placement).</p>" if plan.placement.kind == "v"
               else "Chunk c of pipeline rank r is stage c * pp + r.</p>"))
    header = ["pp rank", "stages"] + [f"dp {d}" for d in range(m.dp)]
    rows = []
    for r in range(m.pp):
        held = ", ".join(str(s.index) for s in plan.stages if s.pp_rank == r)
        cells = ["".join(f'<span class="rank" title="pp={r} tp={t} dp={d}">{m.rank_of(r, t, d)}'
                         f"<small>tp{t}</small></span>" for t in range(m.tp)) for d in range(m.dp)]
        rows.append([str(r), e(held)] + cells)
    return text + _table(header, rows, "mesh")


def _stage_table(plan) -> str:
    header = ["stage", "rank", "layers", "params", "fwd ms", "bwd ms", "comm ms", "act/mb", "in flight",
              "recompute", "memory", "boundary"]
    rows = [[str(s.index), f"pp{s.pp_rank}.c{s.chunk}", e(s.layers), _count(s.n_params),
             f"{s.fwd_time * 1e3:.3f}", f"{s.bwd_time * 1e3:.3f}", f"{s.comm_time * 1e3:.3f}",
             _bytes(s.activation_bytes), str(s.in_flight), _bytes(s.recompute_bytes) if plan.recompute else "-",
             _bytes(s.memory_bytes), e(_boundary(s))] for s in plan.stages]
    foot = "<br>".join(e(line) for line in summary_table(plan).splitlines()[len(plan.stages) + 3:])
    return _table(header, rows, "stages") + f"<p class=note>{foot}</p>"


def _bar(parts: list[tuple[str, float, str]], scale: float, marker: float | None = None) -> str:
    """A stacked horizontal bar: (label, value, css class) parts, widths as % of ``scale``."""
    segs = "".join(f'<span class="seg {c}" style="width:{100 * v / scale:.3f}%" title="{e(lab)}"></span>'
                   for lab, v, c in parts if v > 0)
    mark = f'<span class="budget" style="left:{100 * marker / scale:.3f}%"></span>' if marker else ""
    return f'<div class="bar">{segs}{mark}</div>'


def _bars(plan, profile) -> str:
    budget = getattr(profile, "memory_bytes", None)
    t_scale = max(s.time for s in plan.stages) or 1.0
    m_scale = max([s.memory_bytes for s in plan.stages] + [budget or 0]) or 1
    rows = []
    for s in plan.stages:
        ms = [("fwd", s.fwd_time * 1e3, "fwd"), ("bwd", s.bwd_time * 1e3, "bwd"), ("comm", s.comm_time * 1e3, "comm")]
        acts = s.in_flight * s.activation_bytes
        mem = [("model states", s.memory_bytes - acts - s.recompute_bytes, "states"),
               (f"activations ({s.in_flight} in flight)", acts, "acts"), ("recompute", s.recompute_bytes, "recomp")]
        share = f" = {100 * s.memory_bytes / budget:.3g}% of {_bytes(budget)}" if budget else ""
        rows.append([str(s.index),
                     _bar([(f"{k} {v:.3f} ms", v, c) for k, v, c in ms], t_scale * 1e3)
                     + f"<small>{' + '.join(f'{k} {v:.3f}' for k, v, _ in ms)} = {s.time * 1e3:.3f} ms</small>",
                     _bar([(f"{k} {_bytes(v)}", v, c) for k, v, c in mem], m_scale, budget)
                     + f"<small>{' + '.join(f'{k} {_bytes(v)}' for k, v, _ in mem if v)}{share}</small>"])
    legend = ('<p class="legend"><span class="seg fwd"></span>forward <span class="seg bwd"></span>backward '
              '<span class="seg comm"></span>communication (boundary + tensor-parallel collectives) &nbsp; '
              '<span class="seg states"></span>model states <span class="seg acts"></span>activations '
              '<span class="seg recomp"></span>recompute')
    legend += (f' &nbsp; <span class="budget-key"></span>budget: {e(profile.name)} memory {_bytes(budget)}</p>'
               if budget else " &nbsp; (no budget: the device profile is unknown here)</p>")
    return legend + _table(["stage", "predicted time per microbatch", "predicted memory"], rows, "bars")


def _schedule(plan, tl: dict, colours: dict[str, str]) -> str:
    keys = "".join(f'<span class="seg" style="background:{c}"></span>{e(k)} ' for k, c in colours.items())
    views = tl["views"]
    order = [v for v in ("time", "steps") if v in views]
    picks = "".join(f'<label><input type="radio" name="view" value="{v}"{" checked" if i == 0 else ""}> '
                    f'{"predicted time" if v == "time" else "simulator steps"}</label> ' for i, v in enumerate(order))
    why = f"<p class=note>Only the steps view: {e(tl['time_unavailable'])}.</p>" if "time" not in views else ""
    charts = "".join(f'<div class="gantt" data-view="{v}">{gantt_svg(views[v], plan.mesh.pp, colours)}</div>'
                     for v in order)
    note = (f"<p class=note>{e(plan.schedule)}, {plan.num_microbatches} microbatches, {plan.chunks_per_rank} "
            f"chunk(s) per rank. Each box is one compute, numbered by microbatch (chunk c &gt; 0 drawn lighter); "
            f"hatched gaps are bubbles. Predicted time: the simulator's order per rank, each compute waiting "
            f"for its inputs plus the point-to-point time of the boundary tensors; tensor-parallel collectives "
            f"are added to the compute that runs them.</p>")
    return f'<p class="legend">{keys}</p><p class="views">{picks}</p>{why}{note}{charts}'


def _tensor_parallel(tp: dict | None, rows: list[dict]) -> str:
    if tp is None:
        return "<p>tp = 1: no tensor parallelism, nothing sharded, no collectives.</p>"
    known = {"regions", "sharded", "notes", "partial_grads"}
    facts = "".join(f"<li>{e(k)}: {e(json.dumps(v))}</li>" for k, v in tp.items() if k not in known)
    out = [f"<ul>{facts}</ul>"]
    out += [f"<p class=note>note: {e(n)}</p>" for n in tp.get("notes", [])]
    out.append("<h3>Regions (column-parallel &rarr; row-parallel)</h3><ul class=cols>"
               + "".join(f"<li>{e(r)}</li>" for r in tp.get("regions", [])) + "</ul>")
    columns, blocks = per_block(rows)
    out.append("<h3>Collectives per block</h3>" + _table(
        ["block", "stages"] + columns + ["predicted ms / microbatch"],
        [[e(b["block"]), e(", ".join(map(str, b["stages"])))] + [str(b["counts"].get(c, "")) for c in columns]
         + [f"{b['ms']:.4f}" if b["timed"] else "-"] for b in blocks], "blocks"))
    out.append("<details><summary>every collective</summary>" + _table(
        ["node", "op", "module path", "stage", "axis", "group", "forward", "backward", "shape (tp rank 0)",
         "fwd ms", "bwd ms"],
        [[e(r["node"]), e(r["op"]), e(r["module_path"]), str(r["stage"]), e(str(r["axis"])), str(r["group_size"]),
          e(str(r["fwd_kind"] or "-")), e(str(r["bwd_kind"] or "-")), e(str(r["shape"])),
          "-" if r["fwd_ms"] is None else f"{r['fwd_ms']:.4f}", "-" if r["bwd_ms"] is None else f"{r['bwd_ms']:.4f}"]
         for r in rows], "collectives") + "</details>")
    sharded = tp.get("sharded", {})
    fields = list(dict.fromkeys(f for v in sharded.values() for f in v))   # whatever plan.json records
    out.append(f"<details><summary>{len(sharded)} split parameters; {len(tp.get('partial_grads', []))} "
               f"replicated with partial gradients</summary>" + _table(
                   ["parameter"] + [f.replace("_", " ") for f in fields],
                   [[e(k)] + [e(json.dumps(v.get(f))) for f in fields] for k, v in sharded.items()])
               + "".join(f"<div>{e(p)}</div>" for p in tp.get("partial_grads", [])) + "</details>")
    return "".join(out)


def _code(plan, codes: dict[tuple[int, int, int], str]) -> str:
    m = plan.mesh
    blocks = []
    for (r, t, s), text in sorted(codes.items()):
        ranks = ", ".join(str(m.rank_of(r, t, d)) for d in range(m.dp))
        lines = "".join(f'<span class="ln">{e(line)}\n</span>' for line in text.splitlines())
        blocks.append(f'<details class="code"><summary>pp{r}_tp{t}/stage{s}.py &mdash; global rank(s) {ranks}: '
                      f"{e(plan.stages[s].layers)}</summary><pre>{lines}</pre></details>")
    search = ('<p><input id="code-search" type="search" placeholder="search code, module paths, shapes" size="50">'
              ' <span id="code-hits"></span></p>')
    return search + "".join(blocks)
