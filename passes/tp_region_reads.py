"""What a Megatron region may do with its tensors besides computing on them: read their sizes, hand
values out, write them in place.  passes/tp_regions.py calls these while it collects and analyses a
region; passes/tp_rewrite.py makes the admitted size reads global.

Terms:
  split tensor -- a region tensor (an entry's output or a region op's), which the rewrite holds as
                  one shard per tp rank: its size along the split dim is local (global / tp).
  size read    -- a non-tensor read of a split tensor.  Admitted: ``x.size(d)``, ``x.numel()`` (the
                  rewrite makes them global where they cover the split dim), ``x.shape[i]`` and
                  ``x.size()[i]`` with a constant int ``i`` (likewise), a constant slice of the shape
                  (``x.shape[:2]``) that misses the split dim (its sizes are global already), and the
                  rank, dtype and device (the same on every shard).  Refused: the whole shape handed on
                  (``x.new_zeros(x.shape)``), which would carry local sizes into code written for global
                  ones, and any other Python value read from a split tensor (``x.tolist()``).
  slice read   -- a constant slice of a split tensor's shape; which dims it reads is known now, the
                  split dim only once the shard is chosen, so it is recorded (``Region.slice_reads``)
                  and checked then (tp_regions.py ``_choose``).
  in-place write -- ``x.add_(y)``, ``x += y``, ``torch.relu_(x)``: the op writes its first operand, so
                  its result is that operand, with its layout; the operand must be a region tensor
                  (a replicated one would be written with one shard's worth of values).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autosplit.passes import op_dims as D
from autosplit.passes.op_names import op_name

_SIZE_READS = {"size", "numel", "dim", "ndimension"}     # size() without a dim is a whole-shape read
_SAME_ON_SHARDS = ("ndim", "dtype", "device")


class Unsupported(Exception):
    """Why a region stays replicated (the plan lists it as a note)."""


def is_tensorish(node) -> bool:
    """Does ``node`` compute a tensor (or a tuple holding tensors)?"""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(val, torch.Tensor):
        return True
    return isinstance(val, (tuple, list)) and not isinstance(val, torch.Size) and \
        any(isinstance(v, torch.Tensor) for v in val)


def only_feeds(u: fx.Node, members: set, seen: set) -> bool:
    """Is ``u`` a non-tensor value (a size, a number computed from sizes) whose every use ends in the
    region?  ``h.numel() / h.size(0)`` feeding a region op stays inside it."""
    if is_tensorish(u) or u.op == "output" or u in seen:
        return u in seen
    seen.add(u)
    return all(w in members or only_feeds(w, members, seen) for w in u.users)


def whole_shape(u: fx.Node) -> bool:
    """Is ``u`` the whole shape of its first operand (``x.shape``, ``x.size()``)?"""
    if u.op == "call_function" and u.target is getattr:
        return u.args[1] == "shape"
    return u.op == "call_method" and u.target == "size" and D.arg(u, 1, "dim") is None


def shape_index(w: fx.Node, ndim: int):
    """For ``w`` = ``shape[i]`` with a constant int, the dim it reads (normalized); for a constant
    slice ``shape[a:b:c]``, the list of dims it reads; None for any other use of a shape."""
    if not (w.op == "call_function" and w.target is operator.getitem):
        return None
    i = w.args[1]
    if isinstance(i, int) and not isinstance(i, bool):
        return D.norm(i, ndim)
    if isinstance(i, slice) and all(f is None or isinstance(f, int) for f in (i.start, i.stop, i.step)):
        return list(range(ndim)[i])
    return None


def check_reads(n: fx.Node, gm: fx.GraphModule, slice_reads: list) -> None:
    """Refuse a non-tensor read of the split tensor ``n`` that the rewrite cannot make global (see
    the module docstring); record each slice of its shape in ``slice_reads`` as (reader, n, dims)."""
    ndim = n.meta["val"].dim() if isinstance(n.meta.get("val"), torch.Tensor) else 0
    for u in n.users:
        if is_tensorish(u) or u.op == "output":
            continue
        name = op_name(u, gm)
        if whole_shape(u):
            for w in u.users:
                dims = shape_index(w, ndim)
                if dims is None:
                    raise Unsupported(f"'{w.name}' ({op_name(w, gm)}) uses the whole shape of the split tensor "
                                      f"'{n.name}' (read by '{u.name}'): its size along the split dim would "
                                      f"be the local one, 1/tp of what the model's code expects")
                if isinstance(dims, list):
                    slice_reads.append((w, n, dims))
        elif name not in _SIZE_READS and not (name == "getattr" and u.args[1] in _SAME_ON_SHARDS):
            raise Unsupported(f"'{u.name}' ({name}) reads a Python value from the split tensor '{n.name}'")


def inplace(analysis, n: fx.Node, base: str, out) -> list:
    """The layout of the in-place op ``n`` (computing ``base``): its written first operand's.
    ``out`` is what the op computes out of place (a callable: the rule of ``base``); where its
    layout does not line up with the written operand's, the write cannot stay on the operand's
    shards, and is refused."""
    x = analysis.lay(n.args[0]) if n.args else None
    if not isinstance(x, list):
        raise Unsupported(f"'{n.name}' ({op_name(n, analysis.gm)}) writes in place a tensor from outside the "
                          f"region")
    computed = out()
    if not isinstance(computed, list) or len(computed) != len(x) or \
            not all(analysis.f.align(a, b) for a, b in zip(computed, x)):
        raise Unsupported(f"'{n.name}' ({op_name(n, analysis.gm)}) writes in place with an operand whose dims do "
                          f"not line up with the written tensor's")
    return x
