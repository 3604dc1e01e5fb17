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
"""
from __future__ import annotations

from autosplit.cost_model.profiles import get_profile
from autosplit.passes.shape_prop import tensor_bytes


def p2p_time(nbytes: float, profile) -> float:
    """Seconds to send ``nbytes`` to one peer: latency + nbytes / bandwidth (0 if nothing is sent)."""
    if nbytes <= 0:
        return 0.0
    p = get_profile(profile)
    return p.link_latency + nbytes / p.link_bandwidth


def _ring(phases: int, nbytes: float, n: int, profile) -> float:
    if n <= 1:
        return 0.0
    p = get_profile(profile)
    return phases * ((n - 1) * p.link_latency + (n - 1) / n * nbytes / p.link_bandwidth)


def all_reduce_time(nbytes: float, n: int, profile) -> float:
    """Ring all-reduce of an ``nbytes`` tensor over ``n`` ranks."""
    return _ring(2, nbytes, n, profile)


def all_gather_time(nbytes: float, n: int, profile) -> float:
    """Ring all-gather producing an ``nbytes`` tensor on each of ``n`` ranks."""
    return _ring(1, nbytes, n, profile)


def reduce_scatter_time(nbytes: float, n: int, profile) -> float:
    """Ring reduce-scatter of an ``nbytes`` tensor over ``n`` ranks (each keeps nbytes / n)."""
    return _ring(1, nbytes, n, profile)


def collective_time(node, n: int, profile) -> tuple[float, float]:
    """(forward s, backward s) of a collective graph node (one with ``target.comm_kind``) over n ranks."""
    kinds = getattr(node.target, "comm_kind", None)
    if not kinds:
        return 0.0, 0.0
    values = [node.meta.get("val")] + [a.meta.get("val") for a in node.all_input_nodes]
    nbytes = max(tensor_bytes(v) for v in values)          # the unsharded side of the collective
    return tuple(_COLLECTIVE_TIME[k](nbytes, n, profile) if k else 0.0 for k in kinds)


_COLLECTIVE_TIME = {"all_reduce": all_reduce_time, "all_gather": all_gather_time,
                    "reduce_scatter": reduce_scatter_time}
