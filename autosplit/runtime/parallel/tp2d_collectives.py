"""The runtime half of 2D tensor parallelism: ``linear_2d`` in its two forms, and ``sum_stats``.

Terms: see autosplit/tp/ops.py (linear_2d, sum_stats).  On a q x q grid, rank (i, j) has row i (its
``tp_row`` coordinate) and column j (its ``tp_col`` coordinate).  An activation block X[i, j] holds
batch rows i and features j; a weight block W[j, i] (torch's (out, in) layout) holds output features
j and input features i.  The group "over tp_col" is the q ranks (i, *) that share row i.

  allgather -- X[i, :] = all-gather of X[i, *] over tp_col; W[j, :] = all-gather of W[j, *] over
               tp_row; Y[i, j] = X[i, :] @ W[j, :]^T.  Backward re-gathers both (only local blocks are
               saved), then dX = reduce-scatter over tp_col of dY @ W[j, :], dW = reduce-scatter over
               tp_row of dY^T @ X[i, :].
  summa     -- q steps k: broadcast X[i, k] over tp_col from (i, k) and W[j, k] over tp_row from
               (k, j), accumulate.  Backward, per k: dX[i, k] = reduce over tp_col to (i, k) of
               dY[i, j] @ W[j, k]; dW[j, k] = reduce over tp_row to (k, j) of dY[i, j]^T @ X[i, k].

Ordering (NCCL's rule: every rank of a group issues the group's collectives in the same order): every
rank runs the same loop over k and the same sequence of groups, so each group sees one order.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autosplit.runtime.parallel import tp_collectives as T


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])                       # (rows, features)


def _gather_x(x, col):          # (..., in/q) -> (..., in)
    return T._all_gather(x, x.dim() - 1, col, x.shape[-1] * dist.get_world_size(T._group(col)))


def _gather_w(w, row):          # (out/q, in/q) -> (out/q, in)
    return T._all_gather(w, 1, row, w.shape[1] * dist.get_world_size(T._group(row)))


def _linear_2d(x, w, row: str, col: str, form: str) -> torch.Tensor:
    """The forward of either form (tp_functions.py ``Linear2D``): (..., in/q) x (out/q, in/q) -> (..., out/q)."""
    T.COUNTS[("linear_2d", "fwd")] += 1
    if form == "summa":
        return _summa_forward(x, w, row, col)
    return _gather_x(x, col) @ _gather_w(w, row).t()


def _linear_2d_backward(x, w, dy, row: str, col: str, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of either form, from the local blocks x, w and dy."""
    T.COUNTS[("linear_2d", "bwd")] += 1
    return (_summa_backward if form == "summa" else _gather_backward)(x, w, dy, row, col)


def _gather_backward(x, w, dy, row, col):
    xg, wg = _gather_x(x, col), _gather_w(w, row)           # re-gathered: only blocks were saved
    dx = T._reduce_scatter(dy @ wg, x.dim() - 1, col)        # partial over the row's features
    dw = T._reduce_scatter(_flat(dy).t() @ _flat(xg), 1, row)   # partial over the column's rows
    return dx, dw


def _rank(axis: str) -> int:
    return dist.get_rank(T._group(axis))


def _peer(axis: str, k: int) -> int:
    return dist.get_global_rank(T._group(axis), k)


def _broadcast(t: torch.Tensor, axis: str, k: int, what: str) -> torch.Tensor:
    # a dense, row-major buffer on every rank: empty_like would keep a non-contiguous input's strides,
    # and the bytes the source sends are in row-major order
    buf = t.contiguous() if _rank(axis) == k else t.new_empty(t.shape)
    T._wait(dist.broadcast(buf, src=_peer(axis, k), group=T._group(axis), async_op=True), what)
    return buf


def _reduce(t: torch.Tensor, axis: str, k: int, what: str) -> torch.Tensor:
    t = t.contiguous()
    T._wait(dist.reduce(t, dst=_peer(axis, k), group=T._group(axis), async_op=True), what)
    return t


def _summa_forward(x, w, row, col):
    q = dist.get_world_size(T._group(col))
    y = x.new_zeros(*x.shape[:-1], w.shape[0])
    for k in range(q):                                       # AB: Y[i, j] += X[i, k] W[j, k]^T
        xk = _broadcast(x, col, k, f"SUMMA broadcast of X[:, {k}] over {col}")
        wk = _broadcast(w, row, k, f"SUMMA broadcast of W[:, {k}] over {row}")
        y += xk @ wk.t()
    return y


def _summa_backward(x, w, dy, row, col):
    q, me_col, me_row = dist.get_world_size(T._group(col)), _rank(col), _rank(row)
    dy = dy.contiguous()
    dx = dw = None
    for k in range(q):                                       # ABT: dX[i, k] = sum_j dY[i, j] W[j, k]
        wk = _broadcast(w, row, k, f"SUMMA broadcast of W[:, {k}] over {row}")
        part = _reduce(dy @ wk, col, k, f"SUMMA reduce of dX[:, {k}] over {col}")
        dx = part if k == me_col else dx
    for k in range(q):                                       # ATB: dW[j, k] = sum_i dY[i, j]^T X[i, k]
        xk = _broadcast(x, col, k, f"SUMMA broadcast of X[:, {k}] over {col}")
        part = _reduce(_flat(dy).t() @ _flat(xk), row, k, f"SUMMA reduce of dW[:, {k}] over {row}")
        dw = part if k == me_row else dw
    return dx, dw


# The 2D ops join the eager transport (this module builds on tp_collectives' helpers, so the
# registration goes this way round and the import graph stays acyclic).
T.Eager.linear_2d = staticmethod(_linear_2d)
T.Eager.linear_2d_backward = staticmethod(_linear_2d_backward)
