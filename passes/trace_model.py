"""The first planning pass: the user's model becomes a torch.fx GraphModule.

Terms: see autosplit/trace.py (leaf module, concrete args, train and eval mode).  The pass takes the
``nn.Module`` itself and returns the traced GraphModule (PassManager carries the new module on), with
``node.meta["module_path"]`` on every node, traced with the example inputs' shapes (shape guards where
the model branches on one; ``node.meta["leaf"]`` on the modules kept whole, with why).
"""
from __future__ import annotations

from torch import nn
from torch.fx.passes.infra.pass_base import PassResult

from autosplit.passes.infra import MetaPass, PlanState
from autosplit.trace import trace


class TraceModel(MetaPass):
    """Requires: the model (``state.model``).  Ensures: a GraphModule with meta['module_path']."""

    ensures_meta = ("module_path",)

    def __init__(self, state: PlanState):
        self.state = state

    def call(self, graph_module: nn.Module) -> PassResult:
        s = self.state
        # with the example's shapes: a branch on a shape is decided, and kept as a guard (trace_concrete.py)
        gm = trace(graph_module, len(s.inputs), leaf_modules=s.leaves, concrete_args=s.options.concrete_args,
                   example_inputs=s.inputs)
        return PassResult(gm, True)
