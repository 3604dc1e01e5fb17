"""report.html: written by plan.dump, self-contained, data-driven, and loading cleanly in a real browser.

The browser test runs Debian's ``chromium`` headless (``.ci/run`` installs it, and sets
AUTOSPLIT_REQUIRE_BROWSER=1 so that CI fails instead of skipping when it is missing).  Console output
comes from ``--enable-logging=stderr``: every ``console.*`` call, uncaught exception and blocked
(Content-Security-Policy) load is a ``CONSOLE`` line, and the page's own script never logs, so any
such line fails the test.  The screenshot goes to $AUTOSPLIT_SCREENSHOT_DIR (default: pytest's tmp dir).
"""
import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.fx as fx

import autosplit
from autosplit.cost_model.device import H100
from autosplit.report.html import _page, kind_colour, render_report
from autosplit.report.timeline import step_bars, parse_grid, time_bars, timeline
from autosplit.report.tp_tables import collectives
from tests.models import tp_timm

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def plan():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = tp_timm()
    return autosplit.compile(model, mesh=(2, 2, 1), example_input=torch.empty(4, 3, 32, 32, device="meta"),
                             schedule="interleaved", chunks_per_rank=2, num_microbatches=4, device="h100")


@pytest.fixture(scope="module")
def dumped(plan, tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    files = plan.dump(out)
    assert files[-1] == str(out / "report.html")
    return out / "report.html"


def test_report_is_self_contained_and_holds_the_plan(plan, dumped):
    page = dumped.read_text()
    # nothing to fetch: no external src/href/url(), and a CSP that would block it anyway
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//)|url\(\s*["']?(https?:|//)|@import""", page)
    assert "default-src 'none'" in page
    data = json.loads(re.search(r'<script type="application/json" id="plan-data">(.*?)</script>', page, re.S).group(1))
    expected = plan.to_dict()
    expected.pop("nodes")
    assert data == json.loads(json.dumps(expected, default=str))
    assert page.count('<table class="stages">') == 1 and page.count("pp1.c1") >= 1
    # one box per compute in each view: F and B of every (stage, microbatch)
    computes = 2 * plan.n_stages * plan.num_microbatches
    assert page.count('<g class="box"') == 2 * computes
    # every rank's code, with module paths beside the lines
    for r in range(2):
        for t in range(2):
            assert f"pp{r}_tp{t}/stage{r}.py" in page and f"pp{r}_tp{t}/stage{r + 2}.py" in page
    assert "# blocks.0.attn.qkv" in page
    # tensor parallelism: every collective of the graph listed, with the axis and a predicted time
    n_coll = sum(1 for n in plan.graph.graph.nodes if getattr(n.target, "comm_kind", None))
    listed = sum(page.count(f"<tr><td>{op}") for op in ("copy_to_axis", "all_reduce", "gather"))
    assert n_coll > 0 and listed == n_coll            # Megatron's copies and all-reduces, the head's gather


def test_cli_prints_the_report_path(tmp_path, capsys):
    from autosplit.__main__ import main
    assert main(["plan", "tests.models:tp_timm", "--mesh", "2,1,1", "--batch", "2", "--out", str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"report: {tmp_path / 'report.html'}" and (tmp_path / "report.html").is_file()


def test_time_view_follows_dependencies_and_predicted_durations():
    """1F1B on 2 ranks, 2 microbatches: forward f and backward b on both stages (stage 1's forward also
    runs 0.5 of collectives), a hop of h between ranks; the bars worked out by hand."""
    f, b, h = 1.0, 2.0, 0.25
    grid = parse_grid("step rank0 rank1\n0 0F0 .\n1 0F1 1F0\n2 . 1B0\n3 0B0 1F1\n4 . 1B1\n5 0B1 .")
    stages = [SimpleNamespace(index=s, pp_rank=s, fwd_time=f, bwd_time=b) for s in range(2)]
    bars, why = time_bars(step_bars(grid, 2), stages, lambda lower: h, {(1, "F"): 0.5})
    assert why == ""
    got = {f"{x.stage}{x.kind}{x.microbatch}": (x.start, x.end) for x in bars}
    assert got == {
        "0F0": (0, 1), "0F1": (1, 2),                 # rank 0 back to back
        "1F0": (1.25, 2.75),                         # waits for 0F0 + hop; 1.5 = f + the 0.5 added to stage 1's F
        "1B0": (2.75, 4.75),
        "1F1": (4.75, 6.25),                         # its input (2 + hop) was there long before: the rank was busy
        "1B1": (6.25, 8.25),
        "0B0": (5.0, 7.0),                           # 1B0 ends 4.75, + hop
        "0B1": (8.5, 10.5)}                          # 1B1 ends 8.25, + hop


def test_new_action_kinds_and_axes_appear_without_code_changes(plan):
    # a schedule with a kind the report has never heard of: drawn in the steps view with its own colour
    other = copy.copy(plan)
    other.schedule_grid = plan.schedule_grid.replace("0B0", "0W0", 1)
    tl = timeline(other, lambda s: 0.0, {})
    assert "W" in tl["kinds"] and "time" not in tl["views"] and "W" in tl["time_unavailable"]
    assert any(bar["kind"] == "W" for bar in tl["views"]["steps"]["bars"])
    assert kind_colour("W") not in (kind_colour("F"), kind_colour("B"))
    page = render_report(other, {}, None)
    assert 'data-kind="W"' in page and "Only the steps view" in page

    # a collective over an axis the mesh has no field for, sized by its own ``n`` argument
    def row_all_reduce(x, axis, n):
        return x
    row_all_reduce.comm_kind = ("all_reduce", "all_gather")
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(row_all_reduce, (x,), {"axis": "tp_row", "n": 2})
    graph.output(y)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    x.meta["val"] = y.meta["val"] = torch.empty(4, 8, 16, device="meta")
    y.meta.update(module_path="layers.3.mix", stage=1)
    fake = SimpleNamespace(graph=gm, mesh=plan.mesh, tp_plan=None)
    (row,) = collectives(fake, H100)
    assert (row["axis"], row["group_size"], row["block"], row["fwd_kind"], row["bwd_kind"]) == \
        ("tp_row", 2, "layers.3", "all_reduce", "all_gather")
    assert row["fwd_ms"] > row["bwd_ms"] > 0          # an all-reduce moves twice an all-gather's bytes


def _chromium(*args, timeout=90):
    if BROWSER is None:
        if os.environ.get("AUTOSPLIT_REQUIRE_BROWSER") == "1":
            pytest.fail("AUTOSPLIT_REQUIRE_BROWSER=1 but no chromium on PATH (apt-get install chromium)")
        pytest.skip("no headless browser: Debian's `chromium` package is not installed (.ci/run installs it)")
    cmd = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           "--enable-logging=stderr", "--v=0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _console(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


@pytest.mark.browser
def test_console_check_catches_a_broken_page(tmp_path):
    """The check below can fail: a script error and a blocked CDN load both show up."""
    page = tmp_path / "bad.html"
    page.write_text(_page(['<script src="https://cdn.example.org/d3.js"></script>'])
                    .replace("<main>", "<main><script>undefinedFunction()</script>"))
    lines = _console(_chromium("--dump-dom", page.as_uri()).stderr)
    assert any("undefinedFunction" in x for x in lines) and any("Content Security Policy" in x for x in lines)


@pytest.mark.browser
def test_report_loads_in_headless_chromium(dumped, plan, tmp_path):
    url = dumped.as_uri() + "#search=blocks.1.mlp.fc2"
    proc = _chromium("--dump-dom", url)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _console(proc.stderr) == [], _console(proc.stderr)
    dom = proc.stdout
    stage_rows = re.search(r'<table class="stages">.*?<tbody>(.*?)</tbody>', dom, re.S).group(1)
    assert stage_rows.count("<tr>") == plan.n_stages
    assert dom.count('class="gantt-svg"') == 2 and dom.count("<rect") > 2 * plan.n_stages * plan.num_microbatches
    # the script ran: one Gantt view hidden, the search from the URL found the module path's lines
    assert re.search(r'class="gantt hidden" data-view="steps"', dom)
    hits = re.search(r'<span id="code-hits">(\d+) matching lines in (\d+) of 8 stage files</span>', dom)
    assert hits and int(hits.group(1)) > 0 and 'class="ln hit"' in dom
    shots = Path(os.environ.get("AUTOSPLIT_SCREENSHOT_DIR", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    shot = shots / "report.png"
    proc = _chromium("--window-size=1400,1800", f"--screenshot={shot}", dumped.as_uri())
    assert proc.returncode == 0 and _console(proc.stderr) == [], proc.stderr[-3000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
