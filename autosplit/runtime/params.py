"""Parameters of stage modules: their graph order, and keeping the objects an optimizer holds.

Terms:
  graph order -- the order in which a stage graph first reads its parameters; the same on every rank
                 that runs the same graph, whatever order its module registered them in (tensor-parallel
                 ranks build theirs differently), so collectives over flattened gradients line up.
  adopt       -- a re-plan builds new stage modules; the optimizer was given the old Parameter objects,
                 so the new modules take those objects over (same names, same shapes).
"""
from __future__ import annotations

import torch


def adopt_parameters(old: torch.nn.Module, new: torch.nn.Module) -> None:
    """Put ``old``'s Parameter objects into ``new`` under the same names (shapes are the same)."""
    for name, param in old.named_parameters():
        owner, _, leaf = name.rpartition(".")
        setattr(new.get_submodule(owner) if owner else new, leaf, param)


def graph_order_params(module: torch.fx.GraphModule) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) in the order the graph first uses them: the same on every rank that runs
    the same graph, whatever order its module registered them in (tp ranks build theirs differently)."""
    params, seen = dict(module.named_parameters()), set()
    out = []
    for node in module.graph.nodes:
        if node.op == "get_attr":
            names = [node.target]
        elif node.op == "call_module":
            names = [f"{node.target}.{n}" for n, _ in module.get_submodule(node.target).named_parameters()]
        else:
            continue
        for name in names:
            if name in params and name not in seen:
                seen.add(name)
                out.append((name, params[name]))
    return out
