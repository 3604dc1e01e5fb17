"""The dims an op reads from its arguments, as torch reads them: the tensor-parallel rules' one source.

Terms:
  dim argument -- positional or keyword (``x.transpose(1, 2)``, ``x.transpose(dim0=1, dim1=2)``),
                  possibly negative (``-1``: the last dim).
  normalized   -- a dim as an index 0 .. ndim-1 (``d % ndim``); an out-of-range dim is refused as torch
                  refuses it (IndexError), never wrapped twice.
  implicit dim -- softmax, log_softmax and softmin called without ``dim`` (``F.softmax(x)``,
                  ``nn.Softmax()``): torch picks 0 for a 0-, 1- or 3-D input and 1 otherwise
                  (``torch.nn.functional._get_softmax_dim``).  Not -1: for a 4-D input it is dim 1.
  reduced dims -- the dims ``sum`` / ``mean`` / ``amax`` ... reduce: the ``dim`` argument (an int or a
                  sequence), every dim when it is absent, None or empty.
  named        -- where an op's forms put a dim at different positions (``x.norm(2, -1)``: p first, then
                  dim; ``F.normalize(x, 2, 1)``; ``x.max(1)`` beside ``torch.max(a, b)``), the dim is read
                  from the registry's normalised view (passes/op_registry.py ``arguments``: by name, the
                  overload resolved by torch's signatures), never by position; positions are the fallback
                  for a call torch gives no signature for.
  nth          -- the i-th argument in the signature's order, keyword or not (``nth``): the operands of
                  ops whose operand names differ between overloads (matmul's ``other``, mm's ``mat2``).
  shape read   -- ``x.shape`` / ``x.size()`` (the whole shape), then ``[i]`` with a constant int (one dim)
                  or a constant slice (several).
"""
from __future__ import annotations

import operator

import torch.fx as fx

from autosplit.passes.op_registry import arguments

_ABSENT = object()


def arg(node: fx.Node, i: int, name: str, default=None):
    """Argument ``i`` of ``node``, given positionally or as keyword ``name``."""
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def norm(d: int, ndim: int) -> int:
    """``d`` as an index 0 .. ndim-1 (a 0-D tensor takes 0 and -1, as torch does)."""
    size = max(ndim, 1)
    if not isinstance(d, int) or isinstance(d, bool) or not -size <= d < size:
        raise IndexError(f"dim {d!r} is out of range for a {ndim}-D tensor")
    return d % size


def dim(node: fx.Node, i: int, name: str, ndim: int, default: int = 0) -> int:
    """The normalized single dim of argument ``name`` (see *named*; ``default`` when it is absent)."""
    d = named(node, i, name, _ABSENT)
    return norm(default if d is _ABSENT or d is None else d, ndim)


def dims(value, ndim: int) -> list[int]:
    """A dim or a sequence of dims, normalized; None or an empty sequence: every dim (a reduction's)."""
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return list(range(ndim))
    return [norm(d, ndim) for d in (value if isinstance(value, (list, tuple)) else [value])]


def named(node: fx.Node, i: int, name: str, default=None):
    """Argument ``name`` of ``node`` from the normalised view (see *named*); argument ``i`` / ``name`` as
    given when torch has no signature for the call."""
    found = arguments(node)
    if found is None:
        return arg(node, i, name, default)
    return found.get(name, default)


def nth(node: fx.Node, i: int, default=None):
    """Argument ``i`` in the order of torch's signature for the call (whatever the caller spelled by
    keyword: ``torch.matmul(a, other=b)``, ``torch.pow(x, exponent=y)``); argument ``i`` as given when
    torch has no signature for it.  For operands whose name differs between overloads (``other``,
    ``mat2``, ``exponent``)."""
    found = arguments(node)
    if found is None:
        return node.args[i] if len(node.args) > i else default
    values = list(found.values())
    return values[i] if len(values) > i else default


def reduced_dims(node: fx.Node, ndim: int) -> list[int]:
    """The dims a ``sum`` / ``mean`` / ``max`` / ``norm`` ... node reduces, normalized (see *named*)."""
    return dims(named(node, 1, "dim"), ndim)


def keepdim(node: fx.Node) -> bool:
    return bool(named(node, 2, "keepdim", False))


def implicit_softmax_dim(ndim: int) -> int:
    """torch's dim for a softmax called without one (torch.nn.functional._get_softmax_dim)."""
    return 0 if ndim in (0, 1, 3) else 1


def softmax_dim(node: fx.Node, ndim: int, module=None) -> int:
    """The dim a softmax-like node normalizes over (``F.normalize``'s too: its ``dim``, 1 unless given):
    its ``dim`` (the module's for ``nn.Softmax``), or torch's implicit dim when none is given."""
    d = getattr(module, "dim", None) if module is not None else named(node, 1, "dim")
    return implicit_softmax_dim(ndim) if d is None else norm(d, ndim)


def transpose_dims(node: fx.Node, ndim: int) -> tuple[int, int]:
    """The two dims of ``transpose`` / ``swapaxes`` / ``swapdims`` (``dim0``/``dim1`` or ``axis0``/``axis1``)."""
    a = arg(node, 1, "dim0", arg(node, 1, "axis0"))
    b = arg(node, 2, "dim1", arg(node, 2, "axis1"))
    return norm(a, ndim), norm(b, ndim)


def permute_order(node: fx.Node, ndim: int) -> list[int]:
    """``permute``'s order, given as varargs, as one sequence, or as ``dims=``."""
    if len(node.args) > 2 or (len(node.args) == 2 and isinstance(node.args[1], int)):
        order = node.args[1:]
    else:
        order = arg(node, 1, "dims")
    return [norm(d, ndim) for d in order]


def unsqueeze_dim(node: fx.Node, ndim: int) -> int:
    """``unsqueeze``'s dim, an index of the output (ndim + 1 dims)."""
    return norm(arg(node, 1, "dim"), ndim + 1)


def squeeze_dims(node: fx.Node, shape) -> list[int]:
    """The dims ``squeeze`` removes: the given ones of size 1, or every dim of size 1."""
    d = arg(node, 1, "dim")
    given = range(len(shape)) if d is None else dims(d, len(shape))
    return [k for k in given if shape[k] == 1]


def whole_shape(u: fx.Node) -> bool:
    """Is ``u`` the whole shape of its first operand (``x.shape``, ``x.size()``)?"""
    if u.op == "call_function" and u.target is getattr:
        return u.args[1] == "shape"
    return u.op == "call_method" and u.target == "size" and arg(u, 1, "dim") is None


def shape_index(w: fx.Node, ndim: int):
    """For ``w`` = ``shape[i]`` with a constant int, the dim it reads (normalized); for a constant
    slice ``shape[a:b:c]``, the list of dims it reads; None for any other use of a shape."""
    if not (w.op == "call_function" and w.target is operator.getitem):
        return None
    i = w.args[1]
    if isinstance(i, int) and not isinstance(i, bool):
        return norm(i, ndim)
    if isinstance(i, slice) and all(f is None or isinstance(f, int) for f in (i.start, i.stop, i.step)):
        return list(range(ndim)[i])
    return None
