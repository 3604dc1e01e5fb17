"""Tensor-parallel collectives as graph vocabulary: the op targets the tensor-parallel passes insert.

Terms:
  axis    -- a mesh axis name ("tp"); a graph names the axis, not a process group, so plans stay pure.
  copy    -- Megatron's "f": identity forward, all-reduce of the gradient backward.  Placed where a
             replicated activation feeds column-parallel layers.
  all_reduce -- Megatron's "g": sum of partial results forward, identity backward.
  all_reduce_start / wait -- the same all-reduce in two nodes: launched, and waited where its result
             is first read, so that compute placed between them overlaps it (passes/tp_overlap.py).
             ``wait`` takes the very tensor ``all_reduce_start`` returned.
  all_to_all -- one tensor dim split -> another split (tokens -> heads before attention, heads -> tokens
             after it: DeepSpeed-Ulysses), ``full`` as for all_gather; its backward is the reverse one.
  all_gather / reduce_scatter / local_slice -- along a tensor dim (the token dim in sequence
             parallelism, a grid's batch rows); each one's backward is another of them.  ``all_gather`` feeds
             column-parallel layers, whose input gradients are partial sums (so its backward
             reduce-scatters); ``gather`` feeds replicated ops, whose gradients are already whole (so
             its backward only slices).  ``full`` is the unsharded size of that dim: when it does not
             divide by n, shards are ceil(full / n) long and the last rank's is padded (see *padding*;
             the padding never reaches the unsharded tensor).  None: n shards of equal size, whatever
             it is (a grid's rows: the graph then holds no microbatch size).
  padding -- the rows a padded split appends.  An activation is padded with copies of its last real
             row, a gradient with zeros (``pad``'s ``fill``: why each, there).
  backend -- what runs an op on real tensors: the runtime binds one (autosplit/runtime/
             parallel/tp_collectives.py: process groups and autograd functions).  On meta tensors every op only
             computes its output's shape, which is all planning needs, so this module imports no
             runtime and no process group.  While torch.compile traces a stage, the ops go to a second
             backend (runtime/parallel/traceable_collectives.py: custom ops dynamo records without a graph break).
  comm_kind -- on each op, (forward, backward) collective kinds, read by the cost model.
  whole_keys -- identity on values; a marker for the sharding engine (passes/sharding/context.py): the
             operand whose tokens every query row reads (attention's keys and values) gets a class of
             its own at ``dim``, so the queries may stay split over cp while the keys arrive whole.

2D (SUMMA / Optimus) vocabulary, over the axes ``tp_row`` and ``tp_col`` of a q x q grid:
  linear_2d -- ``x @ w.T`` where x is sharded on its last dim over ``col_axis`` and w is this rank's
             (out/q, in/q) block: rows by the ``col_axis`` coordinate, columns by the ``row_axis`` one.
             ``form="allgather"`` gathers x over col_axis and w over row_axis and runs one GEMM
             (backward re-gathers them and reduce-scatters both gradients); ``form="summa"`` runs q
             steps of broadcasts (Colossal-AI's Matmul_AB forward, ABT / ATB backward).  Both save
             only the local blocks, so saved activations stay 1/q^2 of the layer's.
  sum_stats -- a sum over an axis that every rank then uses for its own part (layer-norm mean and
             variance over channels split across ranks): all-reduce forward AND backward, because
             each rank's gradient of the sum is a different partial.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

_BACKEND: list = [None]
_TRACEABLE: list = [None]


def bind(backend) -> None:
    """Install the runtime's implementation (called by autosplit/runtime/parallel/tp_collectives.py)."""
    _BACKEND[0] = backend


def bind_traceable(backend) -> None:
    """Install the implementation dynamo traces (autosplit/runtime/parallel/traceable_collectives.py)."""
    _TRACEABLE[0] = backend


def _backend():
    if torch.compiler.is_compiling():
        # a stage under torch.compile: collectives as custom ops with fake implementations (no graph break)
        if _TRACEABLE[0] is None:
            raise RuntimeError("a tensor-parallel stage is being compiled, but autosplit.runtime.parallel."
                               "traceable_collectives was not loaded: compile stages with parallelize(..., "
                               "compile_stages=True)")
        return _TRACEABLE[0]
    if _BACKEND[0] is None:
        raise RuntimeError("this stage runs tensor-parallel collectives, but no process group is bound to "
                           "its axis: run stage modules under autosplit.parallelize")
    return _BACKEND[0]


def _planning(x: torch.Tensor) -> bool:
    """A meta or fake tensor (shape and dtype propagation): compute the output's shape only.  Not while
    dynamo traces a stage: its tensors are fake there too, but the graph it records must communicate."""
    return not torch.compiler.is_compiling() and (x.device.type == "meta" or is_fake(x))


def axis_rank(axis: str) -> int:
    """This process's rank along ``axis`` (from the runtime's binding)."""
    return _backend().axis_rank(axis)


def _dim(x: torch.Tensor, dim: int) -> int:
    """``dim`` as an index 0 .. ndim-1 (the passes may write -1 for the last dim, as torch code does)."""
    if not -x.dim() <= dim < x.dim():
        raise IndexError(f"dim {dim} is out of range for a {x.dim()}-D tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def pad(x: torch.Tensor, dim: int, n: int, fill: str) -> torch.Tensor:
    """``x`` extended along ``dim`` to a multiple of n with ``fill``: "copy" (copies of its last row,
    detached; for activations) or "zero" (for gradients).

    Why copies for an activation: every op a padded split passes through is row-wise (the engine
    splits nothing else with padding), so a padding row computes what the real row it copies computes,
    and is finite wherever the model's own values are.  Zeros are not: ``x * rsqrt(mean(x**2))`` or
    ``x / x.norm()`` of a zero row is NaN, and the backward's 0 * inf puts NaN in the weight gradients
    that sum over every row (a mask would have to follow the padding through every op of the region).
    Every padded split copies the same row (the last), so an op of two padded operands (the residual
    add of a sliced input and a reduce-scattered sum) sees copies of one row in both, and a
    reduce-scatter summing each rank's copies of its partial last row gives copies of the summed one.
    Detached: a padding row reaches no output, and no gradient must flow back through the copy.
    Why zeros for a gradient: the padding rows reach no output, so their gradient is zero; a copy
    would add the last row's gradient again to every weight gradient.
    """
    if fill not in ("copy", "zero"):
        raise ValueError(f"pad: fill is 'copy' (an activation) or 'zero' (a gradient), not {fill!r}")
    dim = _dim(x, dim)
    extra = -x.shape[dim] % n
    if not extra:
        return x
    if fill == "zero":
        widths = [0, 0] * (x.dim() - 1 - dim) + [0, extra]
        return F.pad(x, widths)
    last = x.detach().narrow(dim, x.shape[dim] - 1, 1)                  # (..., 1, ...)
    sizes = list(x.shape)
    sizes[dim] = extra
    return torch.cat([x, last.expand(sizes)], dim=dim)


def shard(x: torch.Tensor, dim: int, n: int, rank: int, fill: str) -> torch.Tensor:
    """Rank ``rank``'s part of ``x`` split n ways along ``dim`` (padded first with ``fill``: see ``pad``)."""
    dim = _dim(x, dim)
    return pad(x, dim, n, fill).chunk(n, dim=dim)[rank].contiguous()


def copy_to_axis(x: torch.Tensor, axis: str, owned: bool = False) -> torch.Tensor:
    """Replicated activation entering column-parallel layers: identity forward, all-reduce backward;
    ``owned``: every reader makes a fresh input gradient (a GEMM), so the sum may be taken in place."""
    return x if _planning(x) else _backend().copy_to_axis(x, axis, owned)


def all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Partial sums -> replicated: all-reduce forward, identity backward."""
    return x.clone() if _planning(x) else _backend().all_reduce(x, axis)


def all_reduce_start(x: torch.Tensor, axis: str) -> torch.Tensor:
    """``all_reduce`` launched but not waited: read the result only through ``wait``."""
    return x.clone() if _planning(x) else _backend().all_reduce_start(x, axis)


def wait(x: torch.Tensor) -> torch.Tensor:
    """The result of the ``all_reduce_start`` that returned ``x``, once it has arrived."""
    return x if _planning(x) else _backend().wait(x)


def all_gather(x: torch.Tensor, dim: int, axis: str, n: int, full: int | None) -> torch.Tensor:
    """Shard(dim) over n ranks -> replicated, ``full`` long: all-gather forward, reduce-scatter backward."""
    dim = _dim(x, dim)
    if _planning(x):
        return torch.cat([x] * n, dim=dim).narrow(dim, 0, full or n * x.shape[dim]).clone()
    return _backend().all_gather(x, dim, axis, full)


def gather(x: torch.Tensor, dim: int, axis: str, n: int, full: int | None) -> torch.Tensor:
    """Shard(dim) -> replicated for replicated consumers (a classifier head): all-gather forward; the
    gradient is already whole on every rank, so the backward only keeps this rank's slice."""
    dim = _dim(x, dim)
    if _planning(x):
        return torch.cat([x] * n, dim=dim).narrow(dim, 0, full or n * x.shape[dim]).clone()
    return _backend().gather(x, dim, axis, full)


def reduce_scatter(x: torch.Tensor, dim: int, axis: str, n: int) -> torch.Tensor:
    """Partial sums -> Shard(dim) over n ranks: reduce-scatter forward, all-gather backward."""
    dim = _dim(x, dim)
    if _planning(x):
        return shard(x, dim, n, 0, "copy").clone()
    return _backend().reduce_scatter(x, dim, axis)


def all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, axis: str, n: int, full: int | None) -> torch.Tensor:
    """Shard(cat_dim) -> Shard(split_dim) over n ranks (Ulysses: tokens split -> heads split, and back):
    this rank's part of ``cat_dim`` whole, ``full`` long (its padding dropped), ``split_dim`` split n ways
    (padded where n does not divide it); the reverse exchange backward."""
    split_dim, cat_dim = _dim(x, split_dim), _dim(x, cat_dim)
    if _planning(x):
        whole = torch.cat([x] * n, dim=cat_dim).narrow(cat_dim, 0, full or n * x.shape[cat_dim])
        return shard(whole, split_dim, n, 0, "copy").clone()
    return _backend().all_to_all(x, split_dim, cat_dim, axis, full)


def local_slice(x: torch.Tensor, dim: int, axis: str, n: int) -> torch.Tensor:
    """Replicated -> Shard(dim) over n ranks: this rank's slice forward, all-gather backward."""
    dim = _dim(x, dim)
    if _planning(x):
        return shard(x, dim, n, 0, "copy").clone()
    return _backend().local_slice(x, dim, axis)


def whole_keys(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` itself: attention's keys (or values) read whole along ``dim`` by every query row (see
    *whole_keys*); the collective that makes them whole is inserted before it by the lowering."""
    return x


def is_key_copy(node) -> bool:
    """Is the graph node ``node`` a call of ``whole_keys`` (see *whole_keys*)?"""
    return getattr(node, "op", None) == "call_function" and node.target is whole_keys


def global_size(local: int, full: int) -> int:
    """A size read off a dim split with padding (sequence parallelism's 17 tokens on 2 ranks): the
    unsplit size the model's code was written for, fixed at planning (the shard's is ceil(full / n))."""
    return full


def local_size(full: int, n: int) -> int:
    """The rows a rank holds of a dim of ``full`` split n ways with padding: ceil(full / n)."""
    return -(-full // n)


def linear_2d(x: torch.Tensor, w: torch.Tensor, row_axis: str, col_axis: str, q: int,
              form: str = "allgather") -> torch.Tensor:
    """(..., in/q) sharded over col_axis, weight block (out/q, in/q) -> (..., out/q) sharded over col_axis."""
    if _planning(x):
        return F.linear(x, w)          # the local block's shape (..., out/q), in autocast's dtype
    return _backend().linear_2d(x, w, row_axis, col_axis, q, form)


def sum_stats(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Sum over ``axis`` forward; sum of the gradients over ``axis`` backward."""
    return x.clone() if _planning(x) else _backend().sum_stats(x, axis)


def layer_norm_2d(x: torch.Tensor, features: int, weight, bias, eps: float, axis: str) -> torch.Tensor:
    """Layer norm over the last dim, which is split over ``axis`` (``features`` in all): mean and
    variance from partial sums (two ``sum_stats``), then this rank's slice of weight and bias."""
    mean = sum_stats(x.sum(-1, keepdim=True), axis) / features          # (..., 1)
    centred = x - mean
    var = sum_stats((centred * centred).sum(-1, keepdim=True), axis) / features
    y = centred * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight
    return y + bias if bias is not None else y


# What each costs, forward and backward, for the cost model (which reads ``comm_kind``).
for _fn, _kind in ((copy_to_axis, (None, "all_reduce")), (all_reduce, ("all_reduce", None)),
                   (all_reduce_start, ("all_reduce", None)), (wait, (None, None)),
                   (all_gather, ("all_gather", "reduce_scatter")), (reduce_scatter, ("reduce_scatter", "all_gather")),
                   (local_slice, (None, "all_gather")), (gather, ("all_gather", None)),
                   (sum_stats, ("all_reduce", "all_reduce")), (all_to_all, ("all_to_all", "all_to_all"))):
    _fn.comm_kind = _kind
linear_2d.comm_kind = ("linear_2d", "linear_2d")       # priced by cost_model/comm.py's linear_2d_time
# layer_norm_2d's own collectives: two sum_stats of one value per row (mean, then variance), each
# all-reduced forward and backward.
layer_norm_2d.comm_kind = ("all_reduce", "all_reduce")
layer_norm_2d.comm_bytes = lambda node: 2 * node.meta["val"].numel() // node.meta["val"].shape[-1] * \
    node.meta["val"].element_size()
# On meta tensors each op's result depends only on its inputs' shapes and its plain arguments (no
# process group, no state): shape propagation may replay it from its memo (passes/shape_prop.py).
for _fn in (pad, shard, copy_to_axis, all_reduce, all_reduce_start, wait, all_gather, gather, reduce_scatter,
            local_slice, linear_2d, sum_stats, layer_norm_2d):
    _fn.meta_pure = True
