"""What every autosplit graph pass shares: the metadata keys passes require and ensure.

We build on ``torch.fx.passes.infra.pass_base.PassBase`` (its ``__call__`` runs ``requires``, ``call``,
``ensures``).  ``MetaPass`` adds the one convention our passes use: each states which ``node.meta``
keys must be present on every node before it runs (``requires_meta``) and which it guarantees after
(``ensures_meta``), and the base class checks both, naming the first node that breaks the contract.

Node metadata keys used across passes:
  module_path -- dotted module name the node came from ("" for the root)        (set by tracing)
  val         -- a meta tensor (or tuple / Python value) with the node's shape and dtype  (shape_prop)
  cost        -- cost_model.NodeCost of the node                                  (cost annotation)
  spec        -- autosplit.sharding.ShardingSpec: placement per mesh axis         (sharding specs)
  stage       -- index of the global pipeline stage the node runs in              (partition)
"""
from __future__ import annotations

import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase


class MetaPass(PassBase):
    requires_meta: tuple[str, ...] = ()
    ensures_meta: tuple[str, ...] = ()

    def _check(self, gm: fx.GraphModule, keys: tuple[str, ...], when: str) -> None:
        for node in gm.graph.nodes:
            for key in keys:
                if key not in node.meta:
                    raise RuntimeError(
                        f"{type(self).__name__} {when}: node '{node.name}' ({node.op} {node.target}) "
                        f"has no meta['{key}']; run the pass that sets it first")

    def requires(self, graph_module: fx.GraphModule) -> None:
        self._check(graph_module, self.requires_meta, "requires")

    def ensures(self, graph_module: fx.GraphModule) -> None:
        self._check(graph_module, self.ensures_meta, "ensures")
