"""Emit one GraphModule per pipeline stage from a graph whose nodes carry ``meta['stage']``.

Terms:
  stage inputs  -- stage 0: the model's placeholders; stage s > 0: the values crossing cut s-1.
  stage outputs -- the values crossing cut s, in graph order (so stage s's outputs are exactly stage
                   s+1's inputs, passed through where a value skips a stage); the last stage returns
                   the model's output as a 1-tuple.
  get_attr      -- parameter and buffer reads are copied into every stage that uses them; a
                   parameter used by two stages was already refused by the cut search.

Each stage module holds only the submodules, parameters and buffers its nodes use, under their
original dotted names (``blocks.3.attn.qkv.weight``), shared with (not copied from) the source module.
"""
from __future__ import annotations

import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

from autosplit.passes.infra import MetaPass, PlanState


def stage_io(nodes: list[fx.Node], n_stages: int) -> tuple[list[list[fx.Node]], list[list[fx.Node]]]:
    """(inputs, outputs) per stage, from ``meta['stage']`` of each node."""
    inputs: list[list[fx.Node]] = [[] for _ in range(n_stages)]
    outputs: list[list[fx.Node]] = [[] for _ in range(n_stages)]
    for n in nodes:
        if n.op in ("get_attr", "output"):
            continue
        if n.op == "placeholder":
            inputs[0].append(n)
        last = max((u.meta["stage"] for u in n.users if u.op != "output"), default=n.meta["stage"])
        for s in range(n.meta["stage"], last):       # carried across every cut between def and last use
            outputs[s].append(n)
            inputs[s + 1].append(n)
    return inputs, outputs


def _stage_graph(gm: fx.GraphModule, s: int, ins: list[fx.Node], outs: list[fx.Node], last: bool) -> fx.Graph:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in ins:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in gm.graph.nodes:
        if n in env or n.op in ("placeholder", "output"):
            continue
        used_here = n.op == "get_attr" and any(u.meta.get("stage") == s for u in n.users)
        if n.meta.get("stage") == s and n.op != "get_attr" or used_here:
            env[n] = graph.node_copy(n, lambda a: env[a])
    if last:
        (result,) = [n for n in gm.graph.nodes if n.op == "output"]
        graph.output((fx.map_arg(result.args[0], lambda a: env[a]),))
    else:
        graph.output(tuple(env[n] for n in outs))
    graph.lint()
    return graph


class SplitStages(MetaPass):
    """Requires ``meta['stage']`` on every compute node.  Produces ``self.stages``: GraphModules, and
    ``self.inputs`` / ``self.outputs``: each stage's input and output node names; given a PlanState,
    it also ensures ``state.split`` (this pass, with those results)."""

    requires_meta = ("stage",)

    def __init__(self, n_stages: int, state: PlanState | None = None):
        self.n_stages, self.state = n_stages, state
        self.ensures_state = ("split",) if state is not None else ()
        self.stages: list[fx.GraphModule] = []
        self.inputs: list[list[str]] = []
        self.outputs: list[list[str]] = []

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        nodes = list(graph_module.graph.nodes)
        ins, outs = stage_io(nodes, self.n_stages)
        for s in range(self.n_stages):
            last = s == self.n_stages - 1
            graph = _stage_graph(graph_module, s, ins[s], outs[s], last)
            self.stages.append(fx.GraphModule(graph_module, graph, f"Stage{s}"))
            self.inputs.append([n.name for n in ins[s]])
            self.outputs.append([n.name for n in outs[s]] if not last else ["output"])
        if self.state is not None:
            self.state.put(split=self)
        return PassResult(graph_module, False)
