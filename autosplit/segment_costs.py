"""Per-segment time and per-stage memory, as the partitioner and the Plan see them.

Terms: see passes/cut_points.py (segment, cut) and plan.py (memory).
  kept       -- activation bytes one in-flight microbatch holds on a stage between its forward and its
                backward.  Without checkpointing: everything its ops save (``NodeCost.saved_bytes``).
  recompute bytes -- bytes alive only while one microbatch's backward recomputes its forward (0 without
                recomputation), and the forward time spent again in backward.
  recompute  -- the option (``PlanOptions.recompute``): None; "stage": a stage keeps only its inputs per
                microbatch, and one microbatch's full activations while recomputing; "block": the tensors entering each layer (and what ops
                outside the layers save), plus one layer's activations while recomputing.  Layers are
                autosplit.model_layers.layer_paths, as in runtime/stage/checkpointing.py, so the model matches the run.

memory(stage) = 4 x parameter bytes + in_flight x kept + recompute bytes.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from autosplit.cost_model import collective_time, graph_time, p2p_time
from autosplit.model_layers import layer_of
from autosplit.passes.shape_prop import tensor_bytes

OPTIMIZER_FACTOR = 4   # parameter + gradient + two Adam moments, all in the parameter's dtype
RECOMPUTE = (None, "stage", "block")


def comm_time(nodes: Sequence[fx.Node], tp: int, profile) -> float:
    """Tensor-parallel communication of ``nodes``, forward plus backward."""
    return sum(sum(collective_time(n, tp, profile)) for n in nodes)


class SegmentCosts:
    """Per segment: time (fwd + bwd + recompute, tp communication), boundary transfer, memory."""

    def __init__(self, segments, cuts, tp: int, profile, in_flight: list[int], *,
                 recompute: str | None = None, layers: Sequence[str] = (), input_bytes: int = 0,
                 cross_node: bool = False, node_parts=None):
        """``node_parts``: per node of the segments in order, (fwd, bwd, W, tp fwd, tp bwd) seconds as
        the strategy search prices them (strategy/costing.py ``_node_parts``): the segment times are
        then summed from them in the same order, to the same floats, instead of pricing every node again."""
        self.segments, self.cuts, self.tp, self.profile, self.in_flight = segments, cuts, tp, profile, in_flight
        self.cross_node = cross_node        # pipeline transfers go over the network (comm.pipeline_crosses_nodes)
        self.recompute, self.layers, self.input_bytes = recompute, list(layers), input_bytes
        if node_parts is None:
            self.time = [sum(graph_time(s, profile)) + comm_time(s, tp, profile) + self.recompute_time(s) +
                         self.recompute_comm(s) for s in segments]
        else:
            self.time = self._summed(node_parts)
        self.out_time = [self.boundary_time(k) for k in range(len(segments))]
        self.params = [sum(n.meta["cost"].param_bytes for n in s) for s in segments]
        self.saved = [sum(n.meta["cost"].saved_bytes for n in s) for s in segments]
        self._activations: dict[tuple[int, int], tuple[int, int]] = {}

    def boundary_time(self, k: int) -> float:
        """Sending segment k's outputs forward and their gradients back (0 after the last)."""
        return 2 * p2p_time(self.cuts[k].nbytes, self.profile, self.cross_node) if k < len(self.cuts) else 0.0

    def recompute_time(self, nodes: Sequence[fx.Node]) -> float:
        """Forward time spent again in backward: all of a stage's nodes, or those inside layers."""
        if self.recompute is None:
            return 0.0
        return graph_time([n for n in nodes if self.recomputed(n)], self.profile)[0]

    def recompute_comm(self, nodes: Sequence[fx.Node]) -> float:
        """The forward tp collectives among the recomputed nodes: backward's recomputation runs them again."""
        if self.recompute is None:
            return 0.0
        return sum(collective_time(n, self.tp, self.profile)[0] for n in nodes if self.recomputed(n))

    def _summed(self, node_parts) -> list[float]:
        """The segment times of ``__init__`` from per-node parts, summed as graph_time, comm_time and
        recompute_time sum them (left to right; a node without tensors adds 0.0, which changes no sum)."""
        rows, times, at = node_parts.tolist(), [], 0
        for seg in self.segments:
            part = rows[at:at + len(seg)]
            fwd = sum(r[0] for r in part)
            bwd = sum(r[1] for r in part)
            comm = sum(r[3] + r[4] for r in part)
            again = sum(r[0] for r, n in zip(part, seg) if self.recomputed(n)) if self.recompute else 0.0
            again_comm = sum(r[3] for r, n in zip(part, seg) if self.recomputed(n)) if self.recompute else 0.0
            times.append(fwd + bwd + comm + again + again_comm)
            at += len(seg)
        return times

    def recomputed(self, node: fx.Node) -> bool:
        """Whether backward runs ``node``'s forward again (``recompute_time`` sums the forward of these)."""
        return self.recompute is not None and (self.recompute != "block" or layer_of(node, self.layers) is not None)

    def activations(self, first: int, last: int) -> tuple[int, int]:
        """(kept per microbatch, recompute) bytes of a stage holding segments first..last."""
        key = (first, last)
        if key not in self._activations:
            self._activations[key] = self._measure(first, last)
        return self._activations[key]

    def _measure(self, first: int, last: int) -> tuple[int, int]:
        saved = sum(self.saved[first:last + 1])
        if self.recompute is None:
            return saved, 0
        if self.recompute == "stage":
            inputs = self.cuts[first - 1].nbytes if first > 0 else self.input_bytes
            return inputs, saved
        nodes = [n for seg in self.segments[first:last + 1] for n in seg]
        if not hasattr(self, "_layer"):        # each node's layer, looked up once (stages ask thousands of ranges)
            self._layer = {n: layer_of(n, self.layers) for seg in self.segments for n in seg}
        return _block_activations(nodes, self.layers, self._layer)

    def memory(self, stage: int, first: int, last: int) -> float:
        kept, recompute = self.activations(first, last)
        return OPTIMIZER_FACTOR * sum(self.params[first:last + 1]) + self.in_flight[stage] * kept + recompute


def _block_activations(nodes: list[fx.Node], layers: Sequence[str], layers_of: dict | None = None
                       ) -> tuple[int, int]:
    """Runs of consecutive nodes of one layer are recomputed (runtime/stage/checkpointing.py splits the same
    way): each keeps only the tensors entering it; nodes outside layers keep what they save.
    ``layers_of``: node -> its layer, where already looked up."""
    kept, recompute = 0, 0
    runs: list[tuple[str | None, list[fx.Node]]] = []
    for n in nodes:
        if n.op == "get_attr" and runs:
            layer = runs[-1][0]
        else:
            layer = layers_of[n] if layers_of is not None else layer_of(n, layers)
        if not runs or runs[-1][0] != layer:
            runs.append((layer, []))
        runs[-1][1].append(n)
    for layer, run in runs:
        saved = sum(n.meta["cost"].saved_bytes for n in run)
        if layer is None:
            kept += saved
            continue
        inside = set(run)
        entering = {a for n in run for a in n.all_input_nodes if a not in inside and a.op != "get_attr"}
        kept += sum(tensor_bytes(a.meta.get("val")) for a in entering
                    if isinstance(a.meta.get("val"), torch.Tensor))
        recompute = max(recompute, saved)
    return kept, recompute
