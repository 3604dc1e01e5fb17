"""autosplit: turn an unchanged PyTorch model into a hybrid-parallel training program.

Public API (see README.md and the API contract):
  autosplit.compile(model, mesh=(pp, tp, dp), example_input=x, ...) -> Plan      (offline, pure)
  autosplit.parallelize(model, mesh=(pp, tp, dp), loss_fn=..., ...)              (inside torchrun)
"""
from autosplit.compiler import compile
from autosplit.errors import AutosplitError, PlanError, TraceError
from autosplit.mesh import MeshShape
from autosplit.parallelize import parallelize
from autosplit.plan import Plan

__all__ = ["compile", "parallelize", "Plan", "MeshShape", "AutosplitError", "PlanError", "TraceError"]
__version__ = "0.1.0"
