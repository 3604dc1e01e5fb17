"""Presenters: the plan as text, files and HTML.

  summary.py    the per-stage table (``plan.summary()``) and plan.json's dict
  dump.py       ``plan.dump(directory)``: per-rank readable code, graph drawings, plan.json, report.html
  html.py       report.html, self-contained (html.css and html.js inlined)
  timeline.py   the schedule's per-rank timeline in it
  gantt.py      its Gantt chart
  tp_tables.py  its tensor-parallel tables: per block, per collective

The Plan's ``summary()``, ``dump()`` and ``to_dict()`` call these with itself: a presenter formats the
plan it is given and imports nothing above the plan's data (stage_info, the cost model, the schedule,
the passes): never ``autosplit.plan``, the compiler, the strategy search or the runtime, so the arrow
runs one way (``tests/test_layering.py``).
"""
