"""Where a split tensor dim goes through an op: the per-op rules of 2D tensor parallelism.

Terms:
  split dim -- a tensor dim divided into q contiguous blocks across one mesh axis (the batch dim over
               ``tp_row``, the channel dim over ``tp_col``).  Each rule maps the input's split dim to
               the output's, or raises ``Refuse`` with why the op cannot run on blocks.
  leading   -- a reshape keeps a block split only when the split dim is the outermost factor of the
               output dim it lands in: (B, N, C) -> (B, N, H, D) keeps channel blocks as head blocks
               when H divides by q; (B, C, h, w) -> (B, C, h*w) keeps them as they are.

Rules read shapes only (``node.meta['val']``), never module names.
"""
from __future__ import annotations

import math


class Refuse(Exception):
    """An op that cannot run on blocks of a split dim (the message says which and why)."""


def reshape_dim(in_shape, out_shape, d: int, q: int) -> int:
    """The output dim that dim ``d`` of ``in_shape`` lands in, with its blocks intact."""
    before = math.prod(in_shape[:d])
    a = in_shape[d]
    for e, b in enumerate(out_shape):
        if math.prod(out_shape[:e]) == before and b > 1:
            if (b >= a and b % a == 0) or (b < a and a % b == 0 and b % q == 0):
                return e
            break
    raise Refuse(f"reshape {list(in_shape)} -> {list(out_shape)} regroups dim {d} (size {a}) so that its "
                 f"{q} blocks are not blocks of one output dim")


def permute_dim(order, d: int) -> int:
    return list(order).index(d)


def transpose_dim(a: int, b: int, d: int) -> int:
    return b if d == a else a if d == b else d


def unsqueeze_dim(k: int, d: int) -> int:
    return d + 1 if d >= k else d


def squeeze_dim(dims: list[int], d: int) -> int:
    if d in dims:
        raise Refuse(f"squeeze removes the split dim {d}")
    return d - sum(1 for k in dims if k < d)


def reduce_dim(dims: list[int], keepdim: bool, d: int, what: str) -> int:
    if d in dims:
        raise Refuse(f"{what} reduces over the split dim {d}")
    return d if keepdim else d - sum(1 for k in dims if k < d)


def index_dim(index, ndim: int, d: int) -> int | None:
    """Dim ``d`` after ``tensor[index]``; None when an integer index removes it (refused)."""
    index = index if isinstance(index, tuple) else (index,)
    n_real = sum(1 for i in index if i is not None and i is not Ellipsis)
    out, src = 0, 0
    for i in index:
        if i is Ellipsis:
            skip = ndim - n_real
            if src <= d < src + skip:
                return out + d - src
            out, src = out + skip, src + skip
        elif i is None:
            out += 1
        elif isinstance(i, int):
            if src == d:
                raise Refuse(f"indexing picks one element of the split dim {d}")
            src += 1
        elif isinstance(i, slice):
            if src == d:
                if i != slice(None):
                    raise Refuse(f"slicing {i} of the split dim {d}")
                return out
            out, src = out + 1, src + 1
        else:
            raise Refuse(f"indexing with {type(i).__name__}")
    return out + d - src
