"""Context parallelism as the sharding engine over the ``cp`` axis: the tokens of every op split over
cp ranks, attention included (the seed's sequence parallelism, Li et al. 2021; "context parallelism"
in torch and torchtitan), optionally beside 1D tensor parallelism on an inner axis ``tp_1d``.

Terms (factors, classes: factors.py; strategies, transitions: strategies.py; the lowering: lower.py):
  key copy   -- ``whole_keys(k, dim)`` (autosplit/tp/ops.py): identity on values, whose rule gives ``dim``
                a class of its own and needs it whole.  Inserted where an op pairs the tokens of one
                operand with the tokens of another: ``q @ k^T`` (k's tokens), ``attn @ v`` (v's), SDPA's
                keys and values.  Without it both token dims are one class, the scores hold it twice,
                and the engine can split no query (strategies.py ``_twice``).  With it the queries stay
                split, and k reaches the copy whole: all-gathered over cp forward, its gradient
                reduce-scattered backward (the lowering's ``keys_partial``): torchtitan's K/V all-gather.
                Any additive bias, mask, rotary table or window arithmetic then runs on this rank's
                query rows against every key, as on one device.
  conflict   -- found from the graph alone, in graph order: a ``matmul``-rule op whose first operand's
                rows are the class of the second operand's columns (q @ k^T), or whose contracted dim of
                the second operand is a class the first already holds in another dim (attn @ v; the
                contraction would merge them); every ``sdpa``-rule op's keys and values (attention reads
                every key for each query, whatever classes its operands carry); an einsum whose later
                operand has a dim of a class another subscript letter already holds (``bhqd,bhkd->bhqk``).
                Each conflict gets one key copy of that operand's dim.
  tokens     -- the classes the key copies detach from (the query tokens), and the dims a Linear maps
                one by one other than the batch (megatron.py ``token_classes``: an attention over
                channels, xcit's, sums over the tokens instead and needs no copy).  The cp axis may split
                only these, must split them wherever an op can, and pads them where cp does not divide
                them (a class token: 197 tokens on 2 ranks); gathers drop the padding, so no padding row
                is ever a key.
  attention lowering -- per attention op (a key copy's reader), chosen by cost unless ``cp_attention``
                fixes it: "gather" (the queries split, the keys and values gathered: any mask, bias or
                window works) or "all_to_all" (DeepSpeed-Ulysses: q, k, v moved from tokens split to
                heads split by one all-to-all each, attention on whole sequences of cp-th of the heads,
                its output moved back; where cp divides the heads).  The engine may move any tensor of
                the cp axis from one split dim to another (strategies.py *transition*); the heads are
                the classes of the attention's first operand's dim -3 (B, H, N, d).  Beside tp the heads
                are tp_1d's already (split with the weights): the all-to-all splits each tp rank's heads
                again over cp, where cp x tp divides them, and the lowering nests that dim tp_1d outermost.
  parameters -- whole on every cp rank (the engine never stores one split over cp), their gradients
                summed over cp by the runtime's dp x cp buckets (lower.py *replicated axis*).

Requires meta['val'] (global shapes).  Nothing is decided from names: only from the ops the registry
declares (``shard``) and the classes of their operands.
"""
from __future__ import annotations

import math

import torch.fx as fx

from autosplit.errors import PlanError, rule_failure
from autosplit.passes import op_dims as D
from autosplit.passes.op_names import keeps_effect
from autosplit.passes.op_registry import op
from autosplit.passes.sharding.describe import layer_lines, opaque_notes
from autosplit.passes.sharding.engine import Sharding, analyse
from autosplit.passes.sharding.factors import Factors
from autosplit.passes.sharding.functional import functionalize
from autosplit.passes.sharding.grid import batch_classes
from autosplit.passes.sharding.lower import Lowering
from autosplit.passes.sharding.megatron import feature_classes, token_classes
from autosplit.passes.sharding.rules import Rules, einsum_terms
from autosplit.passes.sharding.tp_plan import TensorParallelPlan
from autosplit.tp import ops as C
from autosplit.tp.axes import coords

AXIS = "cp"
TP_AXIS = "tp_1d"        # 1D beside cp ("tp" names the whole block: autosplit/tp/axes.py block_axes)


def insert_key_copies(gm: fx.GraphModule) -> list[fx.Node]:
    """Insert a key copy at every *conflict* of ``gm`` (requires meta['val']); the copies, in graph order."""
    f = Factors()
    rules = Rules(gm, f)
    made = []
    for node in list(gm.graph.nodes):
        shard = op(node, gm).shard if node.op in ("call_function", "call_method") else ""
        if shard in ("matmul", "sdpa", "einsum"):
            for operand, dim in _conflicts(rules, node, shard):
                made.append(_copy(gm, rules, node, operand, dim))
        try:
            r = rules.rule(node)
        except Exception as exc:        # noqa: BLE001  (a rule of ours failed: name the op it was reading)
            raise rule_failure("the context-parallel key copies", node, exc) from exc
        if r.out is not None:
            rules.layouts[node] = r.out
    return made


def _classes(f: Factors, dims) -> set[int]:
    return {f.find(leaf) for d in dims for leaf in f.flat(d)}


def _conflicts(rules: Rules, node: fx.Node, shard: str) -> list[tuple[fx.Node, int]]:
    """(operand, dim) pairs that need a key copy before ``node`` runs its rule (see *conflict*)."""
    f = rules.f
    if shard == "matmul":
        a, b = D.nth(node, 0), D.nth(node, 1)
        la, lb = rules.lay(a), rules.lay(b)
        if la is None or lb is None or len(la) < 2 or len(lb) < 2 or a is b:
            return []
        if _classes(f, [la[-2]]) & _classes(f, [lb[-1]]):
            return [(b, len(lb) - 1)]                     # q @ k^T: k's tokens
        if _classes(f, [lb[-2]]) & _classes(f, la[:-1]):
            return [(b, len(lb) - 2)]                     # attn @ v: v's tokens
        return []
    if shard == "einsum":
        return _einsum_conflicts(rules, node)
    # attention reads every key for each query, whatever classes its operands' tokens have (a rotary
    # table applied to the tokens after the prefix and concatenated back gives q and k classes of
    # their own: eva02): its keys and values are always copied
    out = []
    for x in (D.nth(node, 1), D.nth(node, 2)):
        lx = rules.lay(x)
        if lx is not None and len(lx) >= 2 and not C.is_key_copy(x):
            out.append((x, len(lx) - 2))
    return out


def _einsum_conflicts(rules: Rules, node: fx.Node) -> list[tuple[fx.Node, int]]:
    """An einsum's conflicts: a dim of a later operand whose classes another subscript letter already holds
    (``bhqd,bhkd->bhqk``: k's tokens are q's class; ``...qk,...kd->...qd``: v's tokens are the query's).
    One copy per operand, none for an operand that is also an earlier one (the copy would replace both)."""
    try:
        ops, letters, _ = einsum_terms(node)
    except Exception:                                       # noqa: BLE001  (no rule: opaque, nothing to copy)
        return []
    held: dict[str, set[int]] = {}
    out = []
    for i, (a, term) in enumerate(zip(ops, letters)):
        lay, shape = rules.lay(a), a.meta["val"].shape
        for j, c in enumerate(term):
            if shape[j] == 1:
                continue
            cls = _classes(rules.f, [lay[j]])
            others = set().union(*(v for k, v in held.items() if k != c))
            if i > 0 and cls & others and not any(a is b for b in ops[:i]) and all(x is not a for x, _ in out):
                out.append((a, j))                  # its copy gives the dim a class of its own
                continue
            held.setdefault(c, set()).update(cls)
    return out


def _copy(gm: fx.GraphModule, rules: Rules, node: fx.Node, operand: fx.Node, dim: int) -> fx.Node:
    """``whole_keys(operand, dim)`` before ``node``, read by ``node`` alone; its rule applied."""
    with gm.graph.inserting_before(node):
        copy = gm.graph.call_function(C.whole_keys, (operand, dim))
    copy.meta.update({k: v for k, v in operand.meta.items() if k in ("val", "module_path", "stack_trace")})
    copy.meta["key_copy_of"] = operand.name
    node.replace_input_with(operand, copy)
    r = rules.rule(copy)
    rules.layouts[copy] = r.out
    return copy


def cp_tokens(sh: Sharding, table: dict) -> set[int]:
    """See *tokens*."""
    return query_tokens(sh, table) | token_classes(sh, table)


def readers(table: dict) -> list[fx.Node]:
    """The attention ops: every reader of a key copy, in graph order."""
    out = []
    for node in table:
        if C.is_key_copy(node):
            out += [u for u in node.users if u not in out]
    return out


def heads(sh: Sharding, table: dict, ways: int = 1) -> set[int]:
    """The classes of dim -3 of each attention's first operand (B, H, N, d): see *attention lowering*;
    those whose size ``ways`` divides (beside tp: cp x tp, as the heads are split over both)."""
    f, out = sh.factors, set()
    for u in readers(table):
        q = table[u].operands[0][1] if u in table and table[u].operands else None
        if q is not None and len(q) >= 3:
            out |= {f.find(leaf) for leaf in f.flat(q[-3]) if f.size[leaf] % ways == 0}
    return out


def query_tokens(sh: Sharding, table: dict) -> set[int]:
    """The classes the key copies detach from."""
    f, out = sh.factors, set()
    for node, rule in table.items():
        if C.is_key_copy(node):
            out |= {f.find(leaf) for leaf in rule.forbid}
    return out


def keys_split(sh: Sharding, copies: list[fx.Node], tokens: set[int], ways: int, forced: bool) -> None:
    """Record on each key copy how the cp axis splits it (see *attention lowering*), for the summary:
    "gather" (whole: gathered), "heads" (moved to a class of neither the tokens nor the batch: Ulysses),
    "tokens" (an outer factor of the tokens: windows merged into the batch, each rank's whole) or "batch";
    and where an all-to-all was asked for (``forced``) but the keys are gathered, why (``cp_why``).
    ``tokens``: cp_tokens of ``sh``."""
    table, f = sh.table, sh.factors
    batch = batch_classes(sh, table)
    for copy in copies:
        s = sh.chosen.get(copy)
        c = s.cls if s is not None and s.out != "R" else None
        copy.meta["cp_keys"] = ("gather" if c is None else "tokens" if c in tokens else "batch" if c in batch
                                else "heads")
        q = next((table[u].operands[0][1] for u in copy.users if u in table and table[u].operands), None)
        if forced and c is None and q is not None and len(q) >= 3:
            sizes = [f.size[leaf] for leaf in f.flat(q[-3])]
            copy.meta["cp_why"] = (f"cp_attention='all_to_all', but cp x tp = {ways} divides none of the head "
                                   f"counts of its dim -3 ({' x '.join(map(str, sizes))})")


def shard_context(gm: fx.GraphModule, cp: int, tp: int, profile, price_vals: dict | None = None,
                  attention: str = "auto") -> TensorParallelPlan:
    """Rewrite ``gm`` (requires meta['val'], global shapes) for the cp x tp block of ranks.

    Args:
        gm: the traced graph, shape-propagated; rewritten in place.
        cp: ranks on the ``cp`` axis (tokens split); >= 2.
        tp: ranks on the ``tp`` axis inside it (1D tensor parallelism, Megatron's layouts); 1 for none.
        profile: the DeviceProfile that prices the candidates.
        price_vals: the values to price candidates with (engine.py ``priced_at``); default gm's own.
        attention: "auto", "gather" or "all_to_all" (see *attention lowering*).
    """
    copies = insert_key_copies(gm)
    axes = ((AXIS, cp),) + (((TP_AXIS, tp),) if tp > 1 else ())      # autosplit/tp/axes.py block_axes
    size = dict(axes)
    # every weight a graph value: its own place on each axis, and on cp a gradient the lowering can tell
    # whole or a part (lower.py *replicated axis*); a module still holding parameters runs whole
    functionalize(gm)
    if price_vals:
        price_vals = {**price_vals, **{v.name: price_vals[v.meta["functional_of"]] for v in gm.graph.nodes
                                       if v.meta.get("functional_of") in price_vals}}
    shardings: dict[str, Sharding] = {}
    # Ulysses beside tp: tp_1d splits the heads first (with the weights), cp each tp rank's heads again,
    # so only heads that cp x tp divides may move (an attention with fewer gathers)
    ways = cp * tp
    allowed = cp_tokens if attention == "gather" else lambda sh, table: cp_tokens(sh, table) | heads(sh, table, ways)
    forced = None
    if attention == "all_to_all":          # each attention runs on heads where any option splits them
        forced = lambda sh, table: {u: (lambda s, h=heads(sh, table, ways): s.cls in h) for u in readers(table)}  # noqa: E731
    shardings[AXIS] = first = analyse(gm, cp, profile, allowed_fn=allowed, must_split_fn=cp_tokens,
                                      padded_fn=cp_tokens, price_vals=price_vals,
                                      grid=True, partial_linears=True, stride=tp, split_params=False,
                                      all_to_all=attention != "gather", must_options_fn=forced)
    tokens = cp_tokens(first, first.table)
    if not tokens:
        raise PlanError(f"cp={cp}: the graph has no token dim (no attention pairing the tokens of two operands, "
                        f"no linear over a (B, N, C) activation), so nothing can be split over cp; use dp or tp")
    keys_split(first, copies, tokens, ways, attention == "all_to_all")
    # No microbatch count on either axis, so the program is the same at every count: on cp the runtime
    # sums the gradients with dp's buckets whatever the choice (no once-a-step charge), and tp inside it
    # is priced at one microbatch, as compile prices the fixed 1D layouts (tensor_parallel.py)
    if tp > 1:
        shardings[TP_AXIS] = analyse(gm, tp, profile, allowed_fn=feature_classes, must_split_fn=feature_classes,
                                     must_split_weights=True, price_vals=price_vals, base=first,
                                     partial_linears=True)
    main = shardings.get(TP_AXIS, first)
    plan = TensorParallelPlan(tp=math.prod(size.values()), root=gm, sharding=main)
    plan.axes = axes
    plan.regions = layer_lines(main) if tp > 1 else []
    plan.notes = [*first.notes, *opaque_notes(shardings)]
    plan.notes.insert(0, f"cp={cp}: {len(copies)} key copies ({', '.join(sorted({c.meta['key_copy_of'] for c in copies})[:6])}"
                         f"{', ...' if len(copies) > 6 else ''}) mark the keys and values each attention reads whole; the "
                         f"query tokens split")
    # the lowering's nesting order, tp_1d outermost: beside tp the all-to-all splits each tp rank's heads
    # further over cp, so a heads dim split over both holds tp's parts outermost (nesting.py).  No other dim
    # is split over both (tokens are cp's, features tp's).  The ranks keep their order (``axes``: cp outer)
    order = dict(reversed(list(shardings.items())))
    Lowering(order, plan, coords=lambda t: coords(axes, t), replicated=(AXIS,)).run()
    gm.graph.eliminate_dead_code(is_impure_node=keeps_effect)   # fx calls x.add_(y) pure
    gm.graph.lint()
    return plan
