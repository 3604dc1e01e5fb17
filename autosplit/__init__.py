"""autosplit: turn an unchanged PyTorch model into a hybrid-parallel training program.

Public API (see README.md and the API contract):
  autosplit.compile(model, mesh=(pp, tp, dp), example_input=x, ...) -> Plan      (offline, pure)
  autosplit.parallelize(model, mesh=(pp, tp, dp), loss_fn=..., ...)              (inside torchrun)
  autosplit.materialize(meta_model, seed=0, init_fn=None)   (a meta model's initial values, one device)
  autosplit.latest_checkpoint(directory) -> the committed checkpoint's path, or None
  autosplit.measure_profile(path=None)  (in a job: this job's devices and network measured, every rank)

The public names load on first use (PEP 562): ``import autosplit.cost_model`` or
``import autosplit.passes`` must not pull in the compiler, let alone the runtime and its process
groups (``tests/test_layering.py`` checks each layer alone).
"""
from __future__ import annotations

import importlib

_PUBLIC = {
    "search": "autosplit.strategy",          # a package not named search: its module would replace the function
    "compile": "autosplit.compiler",
    "parallelize": "autosplit.runtime.parallelize",
    "materialize": "autosplit.meta_init",      # not autosplit/materialize.py: a submodule of that name
                                               # would replace the function once imported
    "latest_checkpoint": "autosplit.runtime.state.checkpoint_files",
    "measure_profile": "autosplit.profiling.job",   # not autosplit.profiling.measure_profile: that module's
                                                   # own function measures inside an existing World
    "Plan": "autosplit.plan",
    "PlanOptions": "autosplit.options",
    "MeshShape": "autosplit.mesh",
    "AutosplitError": "autosplit.errors",
    "PlanError": "autosplit.errors",
    "TraceError": "autosplit.errors",
}

__all__ = list(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'autosplit' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value            # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
