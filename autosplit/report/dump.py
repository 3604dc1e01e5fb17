"""Write a Plan to a directory a person can read.

Layout of ``plan.dump(dir)``:
  summary.txt                     -- plan.summary()
  plan.json                       -- stages, nodes (shape, module path, stage, cost), balance
  schedule.txt                    -- the step x rank grid of the pipeline schedule
  pp{r}_tp{t}/stage{s}.py         -- the code rank (pp=r, tp=t) runs for stage s, with the original
                                     module path and the local shape beside each line
  stage{s}.dot (.svg)             -- a drawing of stage s (SVG too when Graphviz's `dot` is installed)
  report.html                     -- all of the above for a browser, in one self-contained file
                                     (report/html.py): mesh, stages, time and memory bars, the schedule's
                                     Gantt chart, tensor-parallel collectives, searchable stage code

We write Graphviz text ourselves instead of using torch.fx's FxGraphDrawer because that needs the
pydot package; the text format is a few lines and `dot` is optional.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import torch
import torch.fx as fx

from autosplit.report.html import render_report


def _shape(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return f"({', '.join(map(str, val.shape))}) {str(val.dtype).removeprefix('torch.')}"
    return type(val).__name__ if val is not None else ""


def annotated_code(module: fx.GraphModule) -> str:
    """``module.code`` with '# module.path  (shape) dtype' beside each node's line."""
    by_name = {n.name: n for n in module.graph.nodes}
    out = []
    for line in module.code.splitlines():
        name = line.strip().split(" = ", 1)[0] if " = " in line else None
        node = by_name.get(name)
        if node is not None and node.op != "placeholder":
            line = f"{line}  # {node.meta.get('module_path') or '<root>'}  {_shape(node)}"
        out.append(line)
    return "\n".join(out).strip() + "\n"


def stage_dot(module: fx.GraphModule, title: str) -> str:
    lines = [f'digraph "{title}" {{', "  rankdir=TB; node [shape=box, fontsize=10];"]
    for n in module.graph.nodes:
        label = f"{n.name}\\n{n.meta.get('module_path', '') or n.op}\\n{_shape(n)}".replace('"', "'")
        shape = "ellipse" if n.op in ("placeholder", "output") else "box"
        lines.append(f'  "{n.name}" [label="{label}", shape={shape}];')
        for a in n.all_input_nodes:
            lines.append(f'  "{a.name}" -> "{n.name}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _write(path: str, text: str, written: list[str]) -> None:
    with open(path, "w") as f:
        f.write(text)
    written.append(path)


def rank_codes(plan) -> dict[tuple[int, int, int], str]:
    """(pp rank, tp rank, stage) -> the annotated code that rank runs for that stage, with a header line."""
    codes = {}
    for r in range(plan.mesh.pp):
        for t in range(plan.mesh.block):
            stages = [plan.stages[s] for s in plan.placement.stages(r)]
            for module, stage in zip(plan.stage_modules(r, t), stages):
                header = f"# stage {stage.index} (pp rank {r}, chunk {stage.chunk}, tp rank {t}): {stage.layers}\n"
                codes[(r, t, stage.index)] = header + annotated_code(module)
    return codes


def dump_plan(plan, directory, profile=None) -> list[str]:
    """Write the layout above into ``directory``; returns the paths written (report.html last).

    Args:
        plan: the Plan to write.
        directory: created if missing; files already there are overwritten.
        profile: the DeviceProfile the plan was made with, for report.html's memory budget and
            communication times (default: ``plan.profile``, else the built-in profile ``plan.device`` names).
    """
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    written: list[str] = []
    _write(os.path.join(directory, "summary.txt"), plan.summary() + "\n", written)
    _write(os.path.join(directory, "plan.json"), plan.to_json() + "\n", written)
    _write(os.path.join(directory, "schedule.txt"), plan.schedule_grid + "\n", written)
    dot = shutil.which("dot")
    codes = rank_codes(plan)
    for (r, t, s), code in codes.items():
        rank_dir = os.path.join(directory, f"pp{r}_tp{t}")
        os.makedirs(rank_dir, exist_ok=True)
        _write(os.path.join(rank_dir, f"stage{s}.py"), code, written)
    for s, module in enumerate(plan.modules):
        path = os.path.join(directory, f"stage{s}.dot")
        _write(path, stage_dot(module, f"stage{s}"), written)
        if dot:
            subprocess.run([dot, "-Tsvg", path, "-o", path[:-4] + ".svg"], check=False, timeout=120)
            written.append(path[:-4] + ".svg")
    _write(os.path.join(directory, "report.html"), render_report(plan, codes, profile), written)
    return written
