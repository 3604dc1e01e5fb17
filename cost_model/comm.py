"""Communication times: collectives priced by the nodes their group spans.

Terms:
  nbytes  -- size of the FULL tensor a collective works on (the unsharded one), in bytes.
  n       -- number of ranks in the group (the size of one mesh axis).
  span    -- the nodes a group's ranks sit on: ``nodes`` = k, ``r`` = n / k ranks on each.  Groups of
             consecutive ranks (tensor parallelism, mesh.py's layout) span ceil(n / gpus_per_node) nodes;
             a strided group (data parallelism: stride tp) ``group_nodes``.  ``gpus_per_node`` None: one node.
  bus time -- the seconds the bytes take on the slowest path, with the phases of NCCL's hierarchical
             algorithms pipelined against each other (chunks flow through one phase while the next chunk
             is in the other), so the slower phase decides:
               all_reduce:     max(2 (r-1)/r * nbytes / B_ar,  2 (k-1)/k * nbytes / (r * B_net))
               all_gather, reduce_scatter: max((n-1)/n * nbytes / B_link, (k-1)/k * nbytes / (r * B_net))
             B_ar: ``allreduce_bandwidth`` (NVLink SHARP reduces in the switch) or else ``link_bandwidth``;
             B_link: the intra-node ring bus bandwidth; B_net: ``network_bandwidth`` per GPU (each of the r
             GPUs of a node drives its own NIC with 1/r of the data: rail-optimized rings and trees).
  latency -- alpha = steps x per-step latency: 2 (r-1) link + 2 (k-1) network latencies for all_reduce,
             half that for all_gather / reduce_scatter.
  tree    -- an all-reduce over k > 2 nodes is priced as the faster of the ring above and NCCL's double
             binary tree (NCCL >= 2.4 picks between the two per message size; the other collectives stay
             priced as rings): the same node phase, a network phase of 2 nbytes / (r * B_net) (each GPU's
             share goes up the tree reduced and comes down broadcast: the ring's bytes without its
             (k-1)/k) and 2 ceil(log2 k) network latencies instead of 2 (k-1).  At k <= 2 the ring is
             never slower (the same steps, fewer bytes), so the one- and two-node fits to nccl-tests are
             unchanged; the many-node data-parallel rows of the published training runs (Megatron-LM on 48
             nodes, BERT on 32) are what the tree's logarithmic latency is checked against
             (docs/benchmarks.md, *Datacenter GPUs*).
  time    -- (sqrt(alpha) + sqrt(bus time))^2: a transfer cut into chunks that pipeline through the
             algorithm's steps, with the chunk size that minimizes alpha x chunks + bus time x (1 + 1 /
             chunks).  Between the alpha-beta sum (small messages) and the bus time (large ones), it follows
             the slow ramp of nccl-tests' bus bandwidth over 1 MiB-8 GiB (benchmarks/bench_nccl_tables.py:
             within 15 % of every published row there; a plain alpha + beta x nbytes misses by up to 36 %).
  p2p     -- one send to a peer: latency + nbytes / bandwidth of the link, or of the network where the
             peer is on another node.
A group of one rank communicates nothing: 0 s.
Measured (``profile.comm``, measured.py): a collective kind measured on groups of n ranks over k nodes is
priced by its own fit, alpha(kind, n, k) + beta(kind, n, k) * nbytes, which holds whatever the backend
really does (gloo has no reduce-scatter: the runtime all-reduces and slices, and that is what was timed);
a kind, size or span not measured falls back to the formulas above.
"""
from __future__ import annotations

import math

from autosplit.cost_model.measured import measured_comm_time
from autosplit.cost_model.profiles import get_profile
from autosplit.passes.shape_prop import tensor_bytes


def consecutive_nodes(profile, n: int) -> int:
    """Nodes a group of ``n`` consecutive ranks spans (a tensor-parallel group)."""
    gpn = get_profile(profile).gpus_per_node
    return 1 if not gpn else max(1, math.ceil(n / gpn))


def group_nodes(profile, n: int, stride: int) -> int:
    """Nodes the group {0, stride, ..., (n-1) stride} spans (a data-parallel group: stride tp)."""
    gpn = get_profile(profile).gpus_per_node
    return 1 if not gpn else len({(i * stride) // gpn for i in range(n)})


def pipeline_crosses_nodes(profile, pp: int, ranks_per_stage: int) -> bool:
    """Whether pipeline transfers go over the network: the pp ranks of a pipeline sit ``ranks_per_stage``
    (tp * dp) apart, so once pp * ranks_per_stage exceeds a node, boundaries cross it.  Every boundary is
    then priced over the network: exact where ranks_per_stage is a multiple of the node size, an upper
    bound for the boundaries that stay inside a node otherwise."""
    gpn = get_profile(profile).gpus_per_node
    return bool(gpn) and pp > 1 and pp * ranks_per_stage > gpn


def _pipelined(alpha: float, bus: float) -> float:
    return (math.sqrt(alpha) + math.sqrt(bus)) ** 2


def p2p_time(nbytes: float, profile, cross_node: bool = False) -> float:
    """Seconds to send ``nbytes`` to one peer (0 if nothing is sent); over the network when
    ``cross_node`` and the profile states one."""
    if nbytes <= 0:
        return 0.0
    p = get_profile(profile)
    measured = measured_comm_time(p, "send_recv", nbytes, 2, 2 if cross_node else 1)
    if measured is None and cross_node:
        measured = measured_comm_time(p, "send_recv", nbytes, 2)
    if measured is not None:
        return measured
    if cross_node and p.network_bandwidth > 0:
        return p.network_latency + nbytes / p.network_bandwidth
    return p.link_latency + nbytes / p.link_bandwidth


def _collective(kind: str, nbytes: float, n: int, profile, nodes: int | None) -> float:
    if n <= 1:
        return 0.0
    p = get_profile(profile)
    k = consecutive_nodes(p, n) if nodes is None else max(1, min(nodes, n))
    measured = measured_comm_time(p, kind, nbytes, n, k)
    if measured is not None:
        return measured
    phases = 2 if kind == "all_reduce" else 1
    r = n / k
    intra_bw = (p.allreduce_bandwidth or p.link_bandwidth) if kind == "all_reduce" else p.link_bandwidth
    if k == 1:
        bus = phases * (n - 1) / n * nbytes / intra_bw
        alpha = phases * (n - 1) * p.link_latency
    else:
        net_bw = p.network_bandwidth or p.link_bandwidth
        intra = phases * (r - 1) / r * nbytes / intra_bw if kind == "all_reduce" else (n - 1) / n * nbytes / intra_bw
        net_lat = p.network_latency or p.link_latency
        bus = max(intra, phases * (k - 1) / k * nbytes / (r * net_bw))
        alpha = phases * ((r - 1) * p.link_latency + (k - 1) * net_lat)
        if kind == "all_reduce" and k > 2:       # *tree*: NCCL's faster of ring and double binary tree
            tree_bus = max(intra, 2 * nbytes / (r * net_bw))
            tree_alpha = 2 * ((r - 1) * p.link_latency + math.ceil(math.log2(k)) * net_lat)
            return min(_pipelined(alpha, bus), _pipelined(tree_alpha, tree_bus))
    return _pipelined(alpha, bus)


def all_reduce_time(nbytes: float, n: int, profile, nodes: int | None = None) -> float:
    """All-reduce of an ``nbytes`` tensor over ``n`` ranks on ``nodes`` nodes (None: consecutive ranks)."""
    return _collective("all_reduce", nbytes, n, profile, nodes)


def all_gather_time(nbytes: float, n: int, profile, nodes: int | None = None) -> float:
    """All-gather producing an ``nbytes`` tensor on each of ``n`` ranks (``nodes`` as all_reduce_time)."""
    return _collective("all_gather", nbytes, n, profile, nodes)


def reduce_scatter_time(nbytes: float, n: int, profile, nodes: int | None = None) -> float:
    """Reduce-scatter of an ``nbytes`` tensor over ``n`` ranks, each keeping nbytes / n (``nodes`` as
    all_reduce_time)."""
    return _collective("reduce_scatter", nbytes, n, profile, nodes)


def all_to_all_time(nbytes: float, n: int, profile, nodes: int | None = None) -> float:
    """All-to-all of a tensor of ``nbytes`` whole (each of ``n`` ranks holds nbytes / n and sends all but
    1/n of it, a piece to each peer): the bytes of a reduce-scatter of nbytes / n, in n - 1 messages."""
    return _collective("all_gather", nbytes / n, n, profile, nodes)


def broadcast_time(nbytes: float, n: int, profile) -> float:
    """Binomial-tree broadcast (or reduce) of ``nbytes`` over ``n`` consecutive ranks, pipelined:
    latency per level, the bytes once (over the network when the group spans nodes)."""
    if n <= 1:
        return 0.0
    p = get_profile(profile)
    measured = measured_comm_time(p, "broadcast", nbytes, n)
    if measured is not None:
        return measured
    bw = p.network_bandwidth if consecutive_nodes(p, n) > 1 and p.network_bandwidth else p.link_bandwidth
    return _pipelined((n - 1).bit_length() * p.link_latency, nbytes / bw)


def linear_2d_time(x_bytes: float, w_bytes: float, q: int, form: str, profile,
                   nodes: tuple = (None, None)) -> tuple[float, float]:
    """(forward s, backward s) of ``linear_2d`` with local blocks of ``x_bytes`` and ``w_bytes``;
    ``nodes``: the nodes the x gather's group (tp_col) and the w gather's (tp_row) span (None:
    consecutive ranks).

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
    gx, gw = all_gather_time(q * x_bytes, q, profile, nodes[0]), all_gather_time(q * w_bytes, q, profile, nodes[1])
    return gx + gw, 2 * (gx + gw)


def axis_size(axis: str, tp: int) -> int:
    """Ranks on a tensor-parallel axis: tp for "tp"; q = sqrt(tp) for a 2D grid's tp_row / tp_col."""
    return round(tp ** 0.5) if axis in ("tp_row", "tp_col") else tp


def collective_time(node, n: int, profile) -> tuple[float, float]:
    """(forward s, backward s) of a collective graph node (one with ``target.comm_kind``) over n ranks
    (``n`` is tp; a node on a grid's axis runs over its ``meta["axis_size"]``, which the sharding
    engine's lowering records: 2D's tp_row and tp_col sqrt(tp), 2.5D's tp_dep d, 3D's q each; an outer
    axis's ranks sit ``meta["axis_stride"]`` apart, so its group spans the nodes ``group_nodes`` says)."""
    kinds = getattr(node.target, "comm_kind", None)
    if not kinds:
        return 0.0, 0.0
    if kinds[0] == "linear_2d":
        x, w = (a.meta.get("val") for a in node.args[:2])
        q = node.args[4]
        spans = tuple(group_nodes(profile, q, st) if st > 1 else None for st in node.meta.get("axis_strides", (1, 1)))
        return linear_2d_time(tensor_bytes(x), tensor_bytes(w), q, node.args[5], profile, spans)
    axis = next((a for a in node.args if isinstance(a, str)), "tp")
    n = node.meta.get("axis_size") or axis_size(axis, n)
    stride = node.meta.get("axis_stride", 1)
    nodes = group_nodes(profile, n, stride) if stride > 1 else None      # an outer axis of a grid: strided
    if hasattr(node.target, "comm_bytes"):                 # an op that computes too (layer_norm_2d)
        nbytes = node.target.comm_bytes(node)
        return tuple(_COLLECTIVE_TIME[k](nbytes, n, profile, nodes) if k else 0.0 for k in kinds)
    values = [node.meta.get("val")] + [a.meta.get("val") for a in node.all_input_nodes]
    nbytes = max(tensor_bytes(v) for v in values)          # the unsharded side of the collective
    return tuple(_COLLECTIVE_TIME[k](nbytes, n, profile, nodes) if k else 0.0 for k in kinds)


_COLLECTIVE_TIME = {"all_reduce": all_reduce_time, "all_gather": all_gather_time,
                    "reduce_scatter": reduce_scatter_time, "all_to_all": all_to_all_time}
