"""Sharding strategies: for every node, the ways it can run over one mesh axis of n ranks, and what each costs.

Terms (factors, classes, layouts: factors.py; OpRule: rules.py):
  place     -- a tensor's placement on the axis: ``R`` (Replicate: every rank holds it whole), ``P``
               (Partial: every rank holds a summand) or ``("S", c)`` (Shard: every rank holds 1/n of
               the leaf of class c; torch's ``Shard(dim)`` when that leaf leads its dim, a strided
               shard inside it otherwise, as a fused qkv's heads).
  strategy  -- one way to run a node: the class it splits (None for R and P), its output's place,
               each tensor operand's place, each own parameter's split (a Linear's weight by rows or
               columns) and ``pending_bias`` (a Linear whose input features are split gives a Partial
               sum without its bias: the bias is added once, after the reduction).
  transition -- a producer's place -> the place its consumer needs: the collective inserted there
               (P -> R all-reduce, P -> S reduce-scatter, S -> R all-gather, R -> S this rank's
               slice, S of one class -> S of another an all-to-all where the axis allows it (cp:
               tokens -> heads, Ulysses); a Replicate operand of a node that runs split gets its gradient all-reduced
               backward: Megatron's copy), priced forward plus backward.  Impossible transitions
               (S of one class to S of another off such an axis, anything to P) are None.
  sharded   -- a strategy whose output is split or partial: its ranks compute different values.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autosplit.cost_model.comm import all_gather_time, all_reduce_time, all_to_all_time, group_nodes, \
    reduce_scatter_time
from autosplit.cost_model.flops import node_cost
from autosplit.cost_model.profiles import get_profile
from autosplit.cost_model.roofline import op_time, output_dtype
from autosplit.passes.op_names import inplace_base
from autosplit.passes.op_registry import op
from autosplit.passes.shape_prop import tensor_bytes
from autosplit.passes.sharding.factors import Factors
from autosplit.passes.sharding.rules import OpRule
from autosplit.passes.sharding.tp_plan import fetch
from autosplit.tp.ops import is_key_copy

R, P = "R", "P"


@dataclass(frozen=True)
class Strategy:
    cls: int | None
    out: object
    ins: tuple
    params: tuple = ()                  # (name, tensor dim split or None)
    pending_bias: bool = False

    @property
    def sharded(self) -> bool:
        return self.out != R


@dataclass
class NodeStrategies:
    node: fx.Node
    rule: OpRule
    options: list[Strategy] = field(default_factory=list)
    compute: list[float] = field(default_factory=list)      # seconds, forward + backward, per option
    memory: list[float] = field(default_factory=list)       # bytes a rank keeps, per option
    why_whole: str = ""                                      # why no split option exists


class Enumerator:
    """Strategies and transition costs over one axis of ``n`` ranks."""

    def __init__(self, gm: fx.GraphModule, f: Factors, rules: dict, n: int, profile, allowed=None, padded=(),
                 grid: bool = False, microbatches: int = 1, partial_linears: bool | None = None, stride: int = 1,
                 split_params: bool = True, all_to_all: bool = False):
        self.gm, self.f, self.rules, self.n, self.profile = gm, f, rules, n, profile
        self.microbatches = microbatches       # partial gradients are summed once per step: priced / m
        self.allowed = allowed                 # class roots that may be split (None: any)
        self.padded = set(padded)              # classes split even when n does not divide them (padded)
        # grid modes: layer norms over split features (partial statistics); modules holding parameters
        # run whole (their parameters are not graph values a collective can reach)
        self.grid = grid
        # whether a linear may give a Partial sum (split by input features): not on 2D's axes, where
        # every linear is linear_2d's; 3D's row-parallel axis gives one (reduce-scattered after)
        self.partial_linears = not grid if partial_linears is None else partial_linears
        # the nodes the axis's group spans: its ranks sit ``stride`` apart (an outer axis of a grid mode's
        # sub-mesh: autosplit/tp/axes.py), None: consecutive
        self.nodes = group_nodes(profile, n, stride) if stride > 1 else None
        self.split_params = split_params       # may a parameter be stored split over the axis
        self.all_to_all = all_to_all           # may a tensor move from one split dim to another (Ulysses)

    # -- classes and leaves ---------------------------------------------------------------------
    def classes(self, layout) -> dict[int, tuple[int, int]]:
        """class root -> (tensor dim, leaf) for every leaf of ``layout`` that divides by n."""
        out = {}
        for d, dim in enumerate(layout or []):
            for leaf in self.f.flat(dim):
                if self.f.size[leaf] % self.n == 0 or self.f.find(leaf) in self.padded:
                    out.setdefault(self.f.find(leaf), (d, leaf))
        return out

    def where(self, layout, cls: int):
        """(tensor dim, leaf, leads its dim) of class ``cls`` in ``layout``, or None."""
        for d, dim in enumerate(layout or []):
            flat = self.f.flat(dim)
            for k, leaf in enumerate(flat):
                if self.f.find(leaf) == cls:
                    return d, leaf, k == 0
        return None

    def _twice(self, layout, cls) -> bool:
        """Does class ``cls`` lie in more than one dim of ``layout`` (of any element of a tuple)?"""
        if isinstance(layout, tuple):
            return any(self._twice(x, cls) for x in layout if x is not None)
        return sum(1 for dim in layout or [] if any(self.f.find(leaf) == cls for leaf in self.f.flat(dim))) > 1

    def _has(self, layout, cls) -> bool:
        if isinstance(layout, tuple):
            return all(self._has(x, cls) for x in layout if x is not None)
        return self.where(layout, cls) is not None

    # -- strategies -----------------------------------------------------------------------------
    def strategies(self, n: fx.Node) -> NodeStrategies:
        r = self.rules[n]
        ns = NodeStrategies(n, r)
        ops = r.operands
        ns.options.append(Strategy(None, R, tuple(R for _ in ops)))
        if r.kind in ("input", "opaque"):
            ns.why_whole = r.why or "a model input"
            return self._priced(ns)
        if r.kind == "param":
            keep_whole = not self.split_params and _is_parameter(self.gm, n)   # replicated over the axis
            for c, (d, leaf) in self.classes(r.out).items():
                if self._ok(c) and not self.uneven(c) and not keep_whole:
                    ns.options.append(Strategy(c, ("S", c), ()))
            return self._priced(ns)
        if self.grid and n.op == "call_module" and any(True for _ in self.gm.get_submodule(n.target).parameters()):
            ns.why_whole = "a module holding parameters runs whole under 2D"
            return self._priced(ns)
        forbid = {self.f.find(x) for x in r.forbid - (r.stats if self.grid else set())}
        contract = {self.f.find(x) for x in r.contract}
        cands = set()
        for lay in [x for _, x in ops] + (list(r.out) if isinstance(r.out, tuple) else [r.out]):
            cands |= set(self.classes(lay) if not isinstance(lay, tuple) else {})
        cands |= {c for c in contract if self.f.size[next(x for x in r.contract if self.f.find(x) == c)] % self.n == 0}
        inplace = inplace_base(n, self.gm) is not None
        weighted = op(n, self.gm).weighted      # F.linear / F.conv: (input, weight, bias)
        for c in sorted(cands):
            if c in forbid or not self._ok(c):
                continue
            if any(self._twice(lay, c) for lay in [x for _, x in ops] + [r.out]):
                # a place ("S", c) splits the first dim holding c: where c is in two dims of one tensor
                # (w @ w, q @ k^T over one class of tokens or channels) the other dim stays whole on one
                # operand and split on another, and each rank would compute its diagonal block only
                continue
            if self._has(r.out, c):
                out = ("S", c)
            elif c in contract:
                out = P
            else:
                continue
            if self.uneven(c) and (out == P or not (r.rowwise or self._moves_whole(n, r, c))):
                continue                       # padding rows must never be summed nor reshaped in
            if not self.partial_linears and out == P and weighted:
                continue
            if c in {self.f.find(x) for x in r.stats} and not self._leads(r.out, c):
                continue                       # layer_norm_2d splits its features in contiguous blocks
            ins = tuple(("S", c) if self._has(lay, c) else R for _, lay in ops)
            params = tuple((k, self._param_dim(lay, c)) for k, lay in r.params.items())
            if out != P and all(i == R for i in ins) and r.kind != "view" and \
                    all(d is None for _, d in params):
                continue                       # computed whole from whole operands: not a shard
            bias_operand = weighted and len(ops) == 3 and out == P and ins[2] == R   # F.linear(x, w, b)
            pending = out == P and ("bias" in r.params or bias_operand)
            ns.options.append(Strategy(c, out, ins, params, pending))
        if r.linear and not isinstance(r.out, tuple) and not (not self.partial_linears and weighted):
            for i in ({"all": [None], "one": range(len(ops)), "first": [0]}[r.linear]):
                ins = tuple(P if (i is None or j == i) else R for j in range(len(ops)))
                if r.kind == "linear" and "bias" in r.params:
                    continue
                ns.options.append(Strategy(None, P, ins, tuple((k, None) for k in r.params)))
        if inplace:
            ns.options = [s for s in ns.options if s.ins[0] == s.out]
        dup = [[k for k, (a, _) in enumerate(ops) if a is b] for b in {a for a, _ in ops}]
        dup = [ks for ks in dup if len(ks) > 1]
        if dup:                                # y * y: one operand, one place (the lowering feeds it once)
            ns.options = [s for s in ns.options if all(len({s.ins[k] for k in ks}) == 1 for ks in dup)]
        if op(n, self.gm).kind == "conv":
            ns.options = [s for s in ns.options if s.out != P]   # a channel bias would broadcast wrongly
        if len(ns.options) == 1:
            ns.why_whole = self._why_whole(r, forbid)
        return self._priced(ns)

    def _moves_whole(self, n: fx.Node, r, c: int) -> bool:
        """Does view ``n`` carry class ``c`` as a dim of its own, in every tensor it reads and writes?
        Then a padded split of c passes through it as rows move (a permute, a reshape that keeps the
        tokens' dim and regroups only the others): no padding row is merged into another dim."""
        if op(n, self.gm).kind != "view":
            return False
        lays = [x for _, x in r.operands] + (list(r.out) if isinstance(r.out, tuple) else [r.out])
        for lay in lays:
            for dim in lay or []:
                flat = self.f.flat(dim)
                if any(self.f.find(leaf) == c for leaf in flat) and len(flat) != 1:
                    return False
        return True

    def uneven(self, c: int) -> bool:
        """Is class ``c`` split with padding (n does not divide it)?"""
        return c in self.padded and self.f.size[self.f.members(c)[0]] % self.n != 0

    def _ok(self, c: int) -> bool:
        return self.allowed is None or c in self.allowed

    def _param_dim(self, layout, c):
        w = self.where(layout, c)
        return None if w is None else w[0]

    def _why_whole(self, r: OpRule, forbid) -> str:
        sizes = [self.f.size[x] for x in r.forbid]
        if r.kind == "opaque":
            return r.why
        dims = {self.f.size[leaf] for _, lay in r.operands for d in (lay or []) if not isinstance(lay, tuple)
                for leaf in self.f.flat(d)}
        if dims and all(s % self.n for s in dims):
            return f"no dim of size {sorted(dims)} divides by {self.n}"
        return f"it needs whole the dims it reduces over ({sorted(set(sizes))})" if sizes else "no split pays"

    def _priced(self, ns: NodeStrategies) -> NodeStrategies:
        """Compute seconds and kept bytes per option: the op's forward + backward time (split ops 1/n of
        it) and its saved activation (split: 1/n), plus, for a parameter or a module holding some,
        4 x its bytes (value, gradient, two Adam moments; split: 1/n)."""
        n = ns.node
        base, saved, params = 0.0, 0.0, 0.0
        if ns.rule.kind not in ("input", "param") and isinstance(n.meta.get("val"), torch.Tensor):
            # a grid mode prices every node once per axis, from the same values: priced once per graph
            # while the node's value, its inputs' values and the profile are the very same objects
            known = self.gm.__dict__.setdefault("_engine_op_prices", {})
            seen = (n.meta["val"], *(a.meta.get("val") for a in n.all_input_nodes), self.profile)
            hit = known.get(n)
            if hit is None or len(hit[0]) != len(seen) or any(a is not b for a, b in zip(hit[0], seen)):
                cost = node_cost(n, self.gm)
                hit = known[n] = (seen, sum(op_time(cost, output_dtype(n), self.profile)), float(cost.saved_bytes))
            base, saved = hit[1], hit[2]
        if ns.rule.kind == "param" and _is_parameter(self.gm, n):
            params = 4.0 * operand_bytes(n)
        elif n.op == "call_module":
            params = 4.0 * sum(p.numel() * p.element_size() for p in self.gm.get_submodule(n.target).parameters())
        out_time = self._output_time(n) if base else 0.0
        ns.compute = [self._compute(base, out_time, s) for s in ns.options]
        # a split op on whole module weights: their gradient is summed once a step (on a replicated axis
        # the runtime sums it with dp's buckets, split or not: no charge)
        if n.op == "call_module" and params and self.split_params:
            whole = all_reduce_time(params / 4.0, self.n, self.profile, self.nodes) / self.microbatches
            ns.compute = [c + (whole if s.sharded and not any(d is not None for _, d in s.params) else 0.0)
                          for c, s in zip(ns.compute, ns.options)]
        ns.memory = [saved / (self.n if s.sharded and not (s.out == P and s.cls is None) else 1) +
                     params / (self.n if (isinstance(s.out, tuple) and ns.rule.kind == "param") or
                               any(d is not None for _, d in s.params) else 1)
                     for s in ns.options]
        return ns

    def _compute(self, base: float, out_time: float, s: Strategy) -> float:
        """One option's seconds: a Partial value is the whole tensor on every rank (each holds a summand),
        so an op on Partial operands (no class split) runs at full size, and a contraction over a split
        class, 1/n of the FLOPs, still writes (and reads back the gradient of) a whole output."""
        if not s.sharded:
            return base
        if s.out == P and s.cls is None:
            return base
        if s.out == P:
            return base / self.n + out_time * (1 - 1 / self.n)
        return base / self.n

    def _output_time(self, n: fx.Node) -> float:
        """Seconds to write ``n``'s whole output and read its gradient back at the achievable bandwidth."""
        p = get_profile(self.profile)
        return 2 * operand_bytes(n) / (p.mem_bandwidth * p.bandwidth_efficiency)

    # -- transitions ----------------------------------------------------------------------------
    def transition(self, producer: fx.Node, have, need, layout, nbytes: float, consumer_sharded: bool):
        """Seconds (forward + backward) to turn ``have`` into ``need`` for one consumer; None if impossible."""
        n, prof = self.n, self.profile
        if have == need:
            if need == R and consumer_sharded and is_key_copy(producer):
                return 0.0                  # a key copy's gradient parts are summed by the gather before it
            if need == R and consumer_sharded and producer.op == "get_attr":
                if not _is_parameter(self.gm, producer) or not self.split_params:
                    # a buffer: no gradient.  A replicated axis (cp): the runtime sums every parameter's
                    # gradient over it with dp's buckets, part or whole (lower.py *replicated axis*), so
                    # reading it whole into a split op adds no collective
                    return 0.0
                return all_reduce_time(nbytes, n, prof, self.nodes) / self.microbatches   # its partial gradient, once a step
            if need == R and consumer_sharded and producer.op != "placeholder":
                return all_reduce_time(nbytes, n, prof, self.nodes)        # copy: the gradient is partial
            return 0.0
        if need == P:
            return None
        if have == P:
            if need == R:
                return all_reduce_time(nbytes, n, prof, self.nodes) * (2 if consumer_sharded else 1)
            return reduce_scatter_time(nbytes, n, prof, self.nodes) + all_gather_time(nbytes, n, prof, self.nodes) \
                if self._leads(layout, need[1]) else None
        if have == R:                                          # this rank's slice; backward all-gathers
            if not self._leads(layout, need[1]):
                return None
            return all_gather_time(nbytes, n, prof, self.nodes)
        if need == R and self._leads(layout, have[1]):         # gather; backward slices or reduce-scatters
            return all_gather_time(nbytes, n, prof, self.nodes) + \
                (reduce_scatter_time(nbytes, n, prof, self.nodes) if consumer_sharded else 0.0)
        if isinstance(need, tuple) and self.all_to_all and self._leads(layout, have[1]) and \
                self._leads(layout, need[1]) and self.where(layout, have[1])[0] != self.where(layout, need[1])[0]:
            return 2 * all_to_all_time(nbytes, n, prof, self.nodes)     # one exchange each way
        return None

    def _leads(self, layout, cls) -> bool:
        w = self.where(layout, cls)
        return w is not None and w[2]


def _is_parameter(gm: fx.GraphModule, node: fx.Node) -> bool:
    return isinstance(fetch(gm, node.target), torch.nn.Parameter)


def operand_bytes(node: fx.Node) -> float:
    val = node.meta.get("val")
    return float(tensor_bytes(val)) if isinstance(val, torch.Tensor) else 0.0


def edge_bytes(producer: fx.Node, consumer: fx.Node) -> float:
    """The bytes an edge carries: the producer's tensor, or for a tuple (chunk, MultiheadAttention) the
    element its ``getitem`` consumer takes."""
    return operand_bytes(consumer if isinstance(producer.meta.get("val"), (tuple, list)) else producer)
