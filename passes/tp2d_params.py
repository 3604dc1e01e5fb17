"""Parameters under 2D tensor parallelism: which block each tp rank stores, and how uses get them back.

Terms (see tp2d_rewrite.py for the axes):
  use slice -- the channel dim (and indices) a use needs split over tp_col: a norm's weight follows the
               channels of the activation it scales; a position embedding (1, N, C) its C.
  row split -- one more dim split over tp_row, so that every parameter is split q^2 ways; the use
               gathers it back (``all_gather``: its backward reduce-scatters, summing the gradient
               over the rows' samples).  A parameter with no dim that divides stays whole over
               tp_row and its use gets ``copy_to_axis`` (all-reduce of the gradient) instead.
  partial   -- the gradient of a whole-over-an-axis use is a partial sum over that axis' ranks.
  linear weight -- (out, in) blocks: rows by the tp_col coordinate (heads order for attention),
               columns by the tp_row coordinate in the order the input's channel blocks are gathered;
               ``linear_2d`` takes the block as it is.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from autosplit.errors import AutosplitError
from autosplit.tp import ops as C
from autosplit.tp.shards import ShardedParam

ROW, COL = "tp_row", "tp_col"


@dataclass
class _Use:
    dim: int | None = None
    idx: list | None = None                 # per tp_col coordinate (None: contiguous blocks)
    partial: set = field(default_factory=set)
    linear: tuple | None = None             # (rows per col coordinate or None, input order)


def _blocks(n: int, q: int) -> list[torch.Tensor]:
    return list(torch.arange(n).chunk(q))


class ParamUses:
    def __init__(self, gm: fx.GraphModule, q: int):
        self.gm, self.q = gm, q
        self.uses: dict[str, _Use] = {}

    def _use(self, target: str) -> _Use:
        return self.uses.setdefault(target, _Use())

    def slice(self, node: fx.Node, dim: int, idx, user: fx.Node) -> None:
        use = self._use(node.target)
        if use.dim is not None and (use.dim != dim or (use.idx is None) != (idx is None)):
            raise AutosplitError(f"tp_mode='2d': parameter '{node.target}' is used with its channels split two "
                                 f"ways (dim {use.dim} and dim {dim}, at '{user.name}'); 2D cannot store it once")
        use.dim, use.idx = dim, idx

    def partial(self, node: fx.Node, axis: str) -> None:
        self._use(node.target).partial.add(axis)

    def linear_weight(self, target: str, rows, perm: torch.Tensor) -> None:
        use = self._use(target)
        if use.linear is not None or use.dim is not None:
            raise AutosplitError(f"tp_mode='2d': weight '{target}' is used by more than one layer (tied "
                                 f"weights); 2D does not split shared weights")
        use.linear = (rows, perm)

    # ---- the blocks ------------------------------------------------------------------------------
    def sharded(self, target: str, shape: tuple, is_param: bool) -> tuple[ShardedParam | None, int | None]:
        """The q^2 slices of one tensor, and the dim split over tp_row (None: whole over tp_row)."""
        q, use = self.q, self.uses[target]
        if use.linear is not None:
            rows, perm = use.linear
            rows = rows or _blocks(shape[0], q)
            cols = list(perm.chunk(q))
            return ShardedParam(target, shape, [{0: rows[t % q], 1: cols[t // q]} for t in range(q * q)]), 1
        base = [{} for _ in range(q)]
        if use.dim is not None:
            idx = use.idx or _blocks(shape[use.dim], q)
            base = [{use.dim: idx[j]} for j in range(q)]
        local = [len(base[0].get(d, range(n))) for d, n in enumerate(shape)]
        order = ([use.dim] if use.dim is not None else []) + list(range(len(shape)))
        row_dim = next((d for d in order if local[d] > 1 and local[d] % q == 0), None) if is_param else None
        if row_dim is None and use.dim is None:
            return None, None
        slices = []
        for t in range(q * q):
            i, j = divmod(t, q)
            s = dict(base[j])
            if row_dim is not None:
                full = s.get(row_dim, torch.arange(shape[row_dim]))
                s[row_dim] = full.chunk(q)[i]
            slices.append(s)
        return ShardedParam(target, shape, slices), row_dim


def apply_param_uses(uses: ParamUses, gm: fx.GraphModule, plan) -> None:
    """Record every tensor's slices in ``plan`` and give each get_attr use its gather chain."""
    q = uses.q
    params = dict(gm.named_parameters())
    for target, use in uses.uses.items():
        tensor = params.get(target)
        is_param = tensor is not None
        if tensor is None:
            tensor = _fetch(gm, target)
        sp, row_dim = uses.sharded(target, tuple(tensor.shape), is_param)
        if sp is not None:
            plan.sharded[target] = sp
            plan.makers[target] = (lambda r, sp=sp, t=tensor, p=is_param:
                                   nn.Parameter(sp.select(t.detach(), r), requires_grad=t.requires_grad)
                                   if p else sp.select(t, r))
        if use.linear is not None:
            continue
        for node in [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == target]:
            _chain(gm, node, use, row_dim, sp, q)


def _chain(gm, node: fx.Node, use: _Use, row_dim, sp, q: int) -> None:
    users = list(node.users)
    cur = node
    with gm.graph.inserting_after(node):
        if row_dim is not None:
            full = sp.local_shape(0)[row_dim] * q
            fn = C.all_gather if ROW in use.partial else C.gather      # partial: reduce-scatter back
            cur = gm.graph.call_function(fn, (cur, row_dim, ROW, q, full))
        elif ROW in use.partial:
            cur = gm.graph.call_function(C.copy_to_axis, (cur, ROW))
    if COL in use.partial:
        with gm.graph.inserting_after(cur):
            cur = gm.graph.call_function(C.copy_to_axis, (cur, COL))
    for u in users:
        u.args = fx.node.map_arg(u.args, lambda a: cur if a is node else a)
        u.kwargs = fx.node.map_arg(u.kwargs, lambda a: cur if a is node else a)
    walk = cur
    while walk is not node:
        walk.meta["module_path"] = node.meta.get("module_path", "")
        walk = walk.args[0]


def _fetch(root, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
