"""Identical layers rewritten once: the search rewrites four of a model's R layers and copies the rest.

Why: the search rewrites one graph per tensor-parallel layout (the sharding engine's programs, the
lowering, two shape propagations).  A ViT's blocks are one computation R times over, so the rewrite of
a graph holding four of them says what every other block becomes (ViT-22B: 48 blocks, 49 layouts).

Terms:
  layer      -- one of ``model_layers.layer_paths`` (children of the model's largest container of
                same-typed modules: found from the module tree's structure, not from names).
  span       -- a layer's nodes in graph order: from the first node whose ``module_path`` lies in the
                layer to the node before the next layer's first (nodes a rewrite inserts there with no
                path go with the layer before); every node of the layer must lie in its span.
  signature  -- per node of a span: op; target (one inside the layer with the layer's path cut off; a
                tensor read from outside it that is no parameter, e.g. a constant fx lifted out of the
                layer's forward, by its value alone); arguments, each node in them as ("own", i) (the
                span's i-th), ("prev", i) (the previous span's i-th) or the node itself (outside both:
                the same node for every layer), strings without fx's "Proxy(name)"; and the value's
                leaves (shape, stride, dtype).  Two consecutive spans with equal signatures compute the
                same thing, each on its predecessor's outputs.
  reduced    -- the traced graph with layers 0, 1, R-2 and R-1 only: layers 2..R-3 removed, R-2 reading
                layer 1 where it read R-3.  Valid where layers 1..R-2 have equal signatures and nothing
                reads a layer but itself and the next one.
  expanded   -- the reduced graph's rewrite with layers 2..R-3 put back as copies of layer 1's rewritten
                span: targets and module paths renamed to the layer's own (its parameters distinct
                meta tensors; a tensor only layer 1 reads, distinct per copy), each copy reading the copy
                before it where layer 1 read layer 0.  It is the graph the whole rewrite gives where
                the rewrite treats identical layers alike; ``expand`` checks that it treated layers 1
                and R-2 alike (equal signatures at both sizes, nothing else reading layer 1), and
                returns None otherwise (the caller then rewrites the whole graph).
  ``tests/test_repeats.py`` compares expanded graphs with whole rewrites, node by node.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import map_arg
from torch.utils._pytree import tree_leaves, tree_map

from autosplit.model_layers import path_layer
from autosplit.passes.sharding.tp_plan import fetch

# Fewest layers worth reducing: four are kept, so five saves one rewrite of a layer.
MIN_LAYERS = 5


@dataclass
class Repeats:
    """A traced graph reduced to four of its layers (``reduce``), and what ``expand`` needs."""

    graph: fx.GraphModule            # the reduced graph (meta['val'] and module paths as traced)
    layers: list[str]                # all R layer paths, in graph order

    @property
    def kept(self) -> list[str]:
        return [self.layers[0], self.layers[1], self.layers[-2], self.layers[-1]]


def spans(nodes: list[fx.Node], layers: list[str]) -> list[list[fx.Node]] | None:
    """Each layer's span (see Terms), or None where the layers' nodes are not contiguous and in order."""
    index = {layer: k for k, layer in enumerate(layers)}
    owner = [index.get(path_layer(n.meta.get("module_path", ""), layers), -1) for n in nodes]
    starts, last = [None] * len(layers), -1
    for i, k in enumerate(owner):
        if k >= 0:
            if starts[k] is None:
                starts[k] = i
            last = i if k == len(layers) - 1 else last
    if any(s is None for s in starts) or any(a >= b for a, b in zip(starts, starts[1:])):
        return None
    ends = [*starts[1:], last + 1]
    if any(not (starts[k] <= i < ends[k]) for i, k in enumerate(owner) if k >= 0):
        return None
    return [nodes[a:b] for a, b in zip(starts, ends)]


def _leaves(val) -> tuple:
    return tuple((tuple(x.shape), tuple(x.stride()), x.dtype) if isinstance(x, torch.Tensor) else x
                 for x in tree_leaves(val))


def _inside(target, layer: str) -> bool:
    return isinstance(target, str) and (target == layer or target.startswith(layer + "."))


def _text(x):
    """A string argument without the names of traced values in it: fx writes a Proxy into a message
    as "Proxy(node name)" (an assert's text), which differs from layer to layer."""
    return _PROXY.sub("Proxy()", x) if isinstance(x, str) else x


_PROXY = re.compile(r"Proxy\(\w+\)")


def signature(span: list[fx.Node], prev: list[fx.Node], layer: str, params: set[str], vals=None) -> list:
    """The span's signature (see Terms); ``params``: the graph's parameter targets (a tensor read from
    outside the layer that is not one, e.g. a constant fx lifted out of the layer's forward, is
    compared by its value's shape alone); ``vals``: node -> value to read instead of meta['val']."""
    own = {n: i for i, n in enumerate(span)}
    before = {n: i for i, n in enumerate(prev)}

    def ref(a):
        return ("own", own[a]) if a in own else ("prev", before[a]) if a in before else a

    out = []
    for n in span:
        if _inside(n.target, layer):
            target = ("layer", n.target[len(layer):])
        elif n.op == "get_attr" and n.target not in params:
            target = ("tensor",)
        else:
            target = n.target
        args = tree_map(_text, map_arg((n.args, n.kwargs), ref))
        val = vals[n] if vals is not None else n.meta.get("val")
        out.append((n.op, target, args, _leaves(val)))
    return out


def _read_only_by_next(span: list[fx.Node], after: list[fx.Node]) -> bool:
    """Nothing outside ``span`` and the span ``after`` it reads a node of ``span``."""
    allowed = set(span) | set(after)
    return all(u in allowed for n in span for u in n.users)


def reduce(traced: fx.GraphModule, layers: list[str]) -> Repeats | None:
    """``traced`` (meta['val'], module paths) reduced to layers 0, 1, R-2, R-1 (see Terms), or None where
    the model has fewer than MIN_LAYERS layers or they are not identical computations."""
    if len(layers) < MIN_LAYERS:
        return None
    graph = copy.deepcopy(traced.graph)
    parts = spans(list(graph.nodes), layers)
    if parts is None:
        return None
    params = {name for name, _ in traced.named_parameters()}
    first = signature(parts[1], parts[0], layers[1], params)
    if any(len(parts[k]) != len(parts[1]) or signature(parts[k], parts[k - 1], layers[k], params) != first
           for k in range(2, len(layers) - 1)):
        return None
    if not all(_read_only_by_next(parts[k], parts[k + 1]) for k in range(1, len(layers) - 1)):
        return None
    where = {n: i for i, n in enumerate(parts[-3])}          # layer R-3, whose outputs R-2 reads
    one = parts[1]
    for n in parts[-2]:
        n.args = map_arg(n.args, lambda a: one[where[a]] if a in where else a)
        n.kwargs = map_arg(n.kwargs, lambda a: one[where[a]] if a in where else a)
    for part in reversed(parts[2:-2]):
        for n in reversed(part):
            graph.erase_node(n)
    graph.lint()
    return Repeats(fx.GraphModule(traced, graph, type(traced).__name__), list(layers))


def _fresh(obj):
    """A distinct object of the same kind, shape and dtype as a layer 1 target (a copied layer's own:
    parameters of two layers must not alias, ``named_parameters`` would count them once).  Tensors
    on the meta device: the search reads shapes, never values."""
    if isinstance(obj, nn.Parameter):
        return nn.Parameter(torch.empty(obj.shape, dtype=obj.dtype, device="meta"), requires_grad=obj.requires_grad)
    if isinstance(obj, torch.Tensor):
        return torch.empty(obj.shape, dtype=obj.dtype, device="meta")
    if isinstance(obj, nn.Module):          # a shallow copy with its own parameters, buffers and children
        clone = copy.copy(obj)
        for field in ("_parameters", "_buffers", "_modules"):
            clone.__dict__[field] = {k: None if v is None else _fresh(v) for k, v in obj.__dict__[field].items()}
        return clone
    return obj


def expand(gm: fx.GraphModule, repeats: Repeats, earlier: dict[fx.Node, object]
           ) -> tuple[fx.Graph, dict[str, object], dict[fx.Node, fx.Node]] | None:
    """The rewrite ``gm`` of ``repeats.graph`` with the removed layers put back (see Terms), or None where
    the rewrite did not treat layers 1 and R-2 alike.

    Args:
        gm: the rewritten reduced graph (meta['val'] at one microbatch size, module paths).
        repeats: what ``reduce`` returned.
        earlier: node -> its value at another microbatch size (checked equal between the layers too).
    Returns:
        (graph, root, origin): the expanded graph (``gm.graph``, changed in place), its targets' objects,
        and each copied node's source node in layer 1's span.
    """
    graph, layers = gm.graph, repeats.layers
    parts = spans(list(graph.nodes), repeats.kept)
    if parts is None:
        return None
    s0, s1, s2, _ = parts
    params = {name for name, _ in gm.named_parameters()}
    if (len(s1) != len(s2) or not _read_only_by_next(s1, s2)
            or signature(s1, s0, layers[1], params) != signature(s2, s1, layers[-2], params)
            or signature(s1, s0, layers[1], params, earlier) != signature(s2, s1, layers[-2], params, earlier)):
        return None
    root = {n.target: fetch(gm, n.target) for n in graph.nodes if n.op in ("get_attr", "call_module")}
    # a tensor outside layer 1's path that only layer 1 reads (a constant fx lifted out of its forward,
    # one per layer): each copy gets its own, as a tensor read on both sides of a cut ties them together
    inside = set(s1)
    shared = {n.target for n in graph.nodes if n.op == "get_attr" and n not in inside}
    private = {n.target for n in s1 if n.op == "get_attr" and not _inside(n.target, layers[1])} - shared
    at0 = {n: i for i, n in enumerate(s0)}
    origin, prev = {}, s1
    with graph.inserting_before(s2[0]):
        for layer in layers[2:-2]:
            made: dict[fx.Node, fx.Node] = {}
            for n in s1:
                # layer 1 read layer 0 where this copy reads the copy before it (``prev``)
                c = graph.node_copy(n, lambda a: made[a] if a in made else prev[at0[a]] if a in at0 else a)
                if _inside(n.target, layers[1]):
                    c.target = layer + n.target[len(layers[1]):]
                    root[c.target] = _fresh(root[n.target])
                elif n.op == "get_attr" and n.target in private:
                    c.target = f"{n.target}_{layer.replace('.', '_')}"
                    root[c.target] = _fresh(root[n.target])
                if _inside(n.meta.get("module_path", ""), layers[1]):
                    c.meta["module_path"] = layer + n.meta["module_path"][len(layers[1]):]
                made[n], origin[c] = c, n
            prev = [made[n] for n in s1]
    at1 = {n: i for i, n in enumerate(s1)}
    for n in s2:                                  # layer R-2 reads the last copy where it read layer 1
        n.args = map_arg(n.args, lambda a: prev[at1[a]] if a in at1 else a)
        n.kwargs = map_arg(n.kwargs, lambda a: prev[at1[a]] if a in at1 else a)
    return graph, root, origin
