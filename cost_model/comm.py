"""Communication times from the alpha-beta model.

Terms:
  alpha (latency)  -- fixed seconds per message: ``profile.link_latency``.
  beta (1 / bw)    -- seconds per byte on one link direction: ``1 / profile.link_bandwidth``.
  nbytes           -- size of the FULL tensor a collective works on (the unsharded one), in bytes.
  n                -- number of ranks in the group (the size of one mesh axis).

Ring algorithms, each of the n - 1 steps moving nbytes / n per rank:
  all_gather, reduce_scatter: (n - 1) * alpha + (n - 1) / n * nbytes * beta
  all_reduce = reduce_scatter + all_gather: 2 (n - 1) * alpha + 2 (n - 1) / n * nbytes * beta
A group of one rank communicates nothing: 0 s.
Measured (``profile.comm``, measured.py): a collective kind measured on groups of n ranks is priced by
its own fit, alpha(kind, n) + beta(kind, n) * nbytes, which holds whatever the backend really does
(gloo has no reduce-scatter: the runtime all-reduces and slices, and that is what was timed); a kind
or group size not measured falls back to the formulas above.
"""
from __future__ import annotations

from autosplit.cost_model.measured import measured_comm_time
from autosplit.cost_model.profiles import get_profile
from autosplit.passes.shape_prop import tensor_bytes


def p2p_time(nbytes: float, profile) -> float:
    """Seconds to send ``nbytes`` to one peer: latency + nbytes / bandwidth (0 if nothing is sent)."""
    if nbytes <= 0:
        return 0.0
    p = get_profile(profile)
    measured = measured_comm_time(p, "send_recv", nbytes, 2)
    return measured if measured is not None else p.link_latency + nbytes / p.link_bandwidth


def _ring(phases: int, nbytes: float, n: int, profile, kind: str) -> float:
    if n <= 1:
        return 0.0
    p = get_profile(profile)
    measured = measured_comm_time(p, kind, nbytes, n)
    if measured is not None:
        return measured
    return phases * ((n - 1) * p.link_latency + (n - 1) / n * nbytes / p.link_bandwidth)


def all_reduce_time(nbytes: float, n: int, profile) -> float:
    """Ring all-reduce of an ``nbytes`` tensor over ``n`` ranks."""
    return _ring(2, nbytes, n, profile, "all_reduce")


def all_gather_time(nbytes: float, n: int, profile) -> float:
    """Ring all-gather producing an ``nbytes`` tensor on each of ``n`` ranks."""
    return _ring(1, nbytes, n, profile, "all_gather")


def reduce_scatter_time(nbytes: float, n: int, profile) -> float:
    """Ring reduce-scatter of an ``nbytes`` tensor over ``n`` ranks (each keeps nbytes / n)."""
    return _ring(1, nbytes, n, profile, "reduce_scatter")


def broadcast_time(nbytes: float, n: int, profile) -> float:
    """Binomial-tree broadcast (or reduce) of ``nbytes`` over ``n`` ranks, pipelined: latency per
    level, the bytes once."""
    if n <= 1:
        return 0.0
    p = get_profile(profile)
    measured = measured_comm_time(p, "broadcast", nbytes, n)
    if measured is not None:
        return measured
    return (n - 1).bit_length() * p.link_latency + nbytes / p.link_bandwidth


def linear_2d_time(x_bytes: float, w_bytes: float, q: int, form: str, profile) -> tuple[float, float]:
    """(forward s, backward s) of ``linear_2d`` with local blocks of ``x_bytes`` and ``w_bytes``.

    allgather: forward gathers x over a row and w over a column (each ring, (q-1) blocks per rank);
      backward re-gathers both and reduce-scatters both gradients.
    summa: q broadcasts of an x block and q of a w block forward; backward q broadcasts plus q
      reduces for each of dX and dW.
    """
    if q <= 1:
        return 0.0, 0.0
    if form == "summa":
        fwd = q * (broadcast_time(x_bytes, q, profile) + broadcast_time(w_bytes, q, profile))
        return fwd, 2 * fwd
    gx, gw = all_gather_time(q * x_bytes, q, profile), all_gather_time(q * w_bytes, q, profile)
    return gx + gw, 2 * (gx + gw)


def axis_size(axis: str, tp: int) -> int:
    """Ranks on a tensor-parallel axis: tp for "tp"; q = sqrt(tp) for a 2D grid's tp_row / tp_col."""
    return round(tp ** 0.5) if axis in ("tp_row", "tp_col") else tp


def collective_time(node, n: int, profile) -> tuple[float, float]:
    """(forward s, backward s) of a collective graph node (one with ``target.comm_kind``) over n ranks
    (``n`` is tp; a node on a 2D axis runs over sqrt(tp) of them)."""
    kinds = getattr(node.target, "comm_kind", None)
    if not kinds:
        return 0.0, 0.0
    if kinds[0] == "linear_2d":
        x, w = (a.meta.get("val") for a in node.args[:2])
        return linear_2d_time(tensor_bytes(x), tensor_bytes(w), node.args[4], node.args[5], profile)
    axis = next((a for a in node.args if isinstance(a, str)), "tp")
    n = axis_size(axis, n)
    if hasattr(node.target, "comm_bytes"):                 # an op that computes too (layer_norm_2d)
        nbytes = node.target.comm_bytes(node)
        return tuple(_COLLECTIVE_TIME[k](nbytes, n, profile) if k else 0.0 for k in kinds)
    values = [node.meta.get("val")] + [a.meta.get("val") for a in node.all_input_nodes]
    nbytes = max(tensor_bytes(v) for v in values)          # the unsharded side of the collective
    return tuple(_COLLECTIVE_TIME[k](nbytes, n, profile) if k else 0.0 for k in kinds)


_COLLECTIVE_TIME = {"all_reduce": all_reduce_time, "all_gather": all_gather_time,
                    "reduce_scatter": reduce_scatter_time}
