"""Cost model against hand-computed numbers: FLOPs, bytes, roofline, comm, ViT-B/16 anchor, calibration."""
import dataclasses
import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autosplit.cost_model import (A100, H100, AnnotateCosts, DeviceProfile, NodeCost, all_gather_time,
                                  all_reduce_time, calibrate, get_profile, graph_time, op_time, p2p_time,
                                  reduce_scatter_time)
from autosplit.cost_model import profile_for_gpu
from autosplit.errors import AutosplitError
from autosplit.passes.shape_prop import MetaShapeProp
from autosplit.trace import trace

F32 = 4  # bytes per float32 element


def costs(model, *inputs):
    """Trace, shape-propagate on meta, annotate; return ({node name: NodeCost}, the pass)."""
    gm = trace(model, len(inputs))
    MetaShapeProp(inputs)(gm)
    annotate = AnnotateCosts()
    annotate(gm)
    return {n.name: n.meta["cost"] for n in gm.graph.nodes}, annotate


def one(model, *inputs):
    """The cost of the only node with FLOPs."""
    table, _ = costs(model, *inputs)
    nonzero = [c for c in table.values() if c.fwd_flops]
    assert len(nonzero) == 1, table
    return nonzero[0]


class Fn(nn.Module):
    """Wraps ``fn(self, x)``; Fn2 / Fn3 take 2 / 3 inputs (fx traces neither *args nor optional inputs)."""

    def __init__(self, fn, **params):
        super().__init__()
        self.fn = fn
        for k, v in params.items():
            setattr(self, k, nn.Parameter(v))

    def forward(self, a):
        return self.fn(self, a)


class Fn2(Fn):
    def forward(self, a, b):
        return self.fn(self, a, b)


class Fn3(Fn):
    def forward(self, a, b, c):
        return self.fn(self, a, b, c)


# ----------------------------------------------------------------------------- per-op rules

def test_linear():
    c = one(nn.Sequential(nn.Linear(64, 32)), torch.empty(8, 10, 64, device="meta"))
    n_out = 8 * 10 * 32                        # 2560 output elements
    macs = n_out * 64                          # 163840
    assert c.fwd_macs == macs + n_out / 2      # bias adds: 1 FLOP per output element
    assert c.fwd_flops == 2 * macs + n_out
    assert c.bwd_flops == 4 * macs + n_out     # grad input + grad weight, + bias grad reduction
    params = (64 * 32 + 32) * F32              # 8320
    x, out = 8 * 10 * 64 * F32, n_out * F32    # 20480, 10240
    assert c.param_bytes == params
    assert c.fwd_bytes == x + out + params     # 39040
    assert c.saved_bytes == x
    assert c.bwd_bytes == out + x + x + 2 * params   # grad_out + saved x + grad x + weight and its grad


def test_functional_linear_with_get_attr_weight():
    m = Fn(lambda s, x: F.linear(x, s.w), w=torch.empty(6, 3))
    table, _ = costs(m, torch.empty(5, 7, 3, device="meta"))
    assert table["linear"].fwd_flops == 2 * 5 * 7 * 6 * 3
    assert table["linear"].saved_bytes == 5 * 7 * 3 * F32     # the weight is not an activation
    assert table["linear"].param_bytes == 0 and table["w"].param_bytes == 6 * 3 * F32


def test_conv():
    c = one(nn.Sequential(nn.Conv2d(3, 16, kernel_size=4, stride=4)), torch.empty(2, 3, 32, 32, device="meta"))
    n_out = 2 * 16 * 8 * 8                     # 2048
    macs = n_out * 3 * 4 * 4                   # 98304: Cin * kh * kw per output element
    assert c.fwd_flops == 2 * macs + n_out
    assert c.bwd_flops == 4 * macs + n_out
    assert c.saved_bytes == 2 * 3 * 32 * 32 * F32
    dw = one(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)),
             torch.empty(1, 8, 10, 10, device="meta"))
    assert dw.fwd_macs == 8 * 10 * 10 * 1 * 3 * 3   # depthwise: Cin / groups = 1


@pytest.mark.parametrize("fn", [
    lambda s, a, b: a @ b.transpose(-2, -1),
    lambda s, a, b: torch.matmul(a, b.transpose(-2, -1)),
    lambda s, a, b: torch.einsum("bhnd,bhmd->bhnm", a, b),
    lambda s, a, b: torch.bmm(a.flatten(0, 1), b.flatten(0, 1).transpose(1, 2)),
])
def test_matmul_two_activations(fn):
    a, b = torch.empty(2, 4, 16, 8, device="meta"), torch.empty(2, 4, 16, 8, device="meta")
    c = one(Fn2(fn), a, b)
    macs = 2 * 4 * 16 * 16 * 8                 # out (2, 4, 16, 16) x contracted 8 = 16384
    assert c.fwd_flops == 2 * macs
    assert c.bwd_flops == 2 * c.fwd_flops      # grad of each operand is a matmul of the same size
    assert c.saved_bytes == 2 * (2 * 4 * 16 * 8 * F32)   # both operands: 8192


@pytest.mark.parametrize("fn", [lambda s, x: x @ s.w, lambda s, x: x @ s.w.t().t()])
def test_matmul_broadcast_with_parameter(fn):
    c = one(Fn(fn, w=torch.empty(3, 6)), torch.empty(5, 7, 3, device="meta"))
    assert c.fwd_macs == 5 * 7 * 6 * 3         # 630
    assert c.saved_bytes == 5 * 7 * 3 * F32    # x only: the weight (or a view of it) is no activation


def test_baddbmm():
    c = one(Fn3(lambda s, i, a, b: torch.baddbmm(i, a, b)), torch.empty(4, 5, 6, device="meta"),
            torch.empty(4, 5, 3, device="meta"), torch.empty(4, 3, 6, device="meta"))
    assert c.fwd_flops == 2 * (4 * 5 * 6 * 3) + 4 * 5 * 6   # matmul + the add


def test_sdpa():
    q = torch.empty(2, 4, 16, 8, device="meta")           # B=2, H=4, N=16, D=8
    c = one(Fn3(lambda s, q, k, v: F.scaled_dot_product_attention(q, k, v)), q, q.clone(), q.clone())
    bh, n, d = 2 * 4, 16, 8
    macs = 2 * bh * n * n * d                  # QK^T and PV: 2 x 8192
    softmax = 5 * bh * n * n                   # 10240
    assert c.fwd_flops == 2 * macs + softmax   # 75776
    # flash backward: 5 matmuls (QK^T recomputed, dV, dP, dQ, dK) to the forward's 2, the softmax twice
    assert c.bwd_flops == 5 * macs + 2 * softmax
    qkvo = 4 * bh * n * d * F32                # q, k, v, out: 16384
    assert c.saved_bytes == qkvo + bh * n * F32   # + fp32 logsumexp per row
    assert c.fwd_bytes == qkvo                 # flash style: the score matrix never hits memory


def test_layer_norm_function_and_module():
    x = torch.empty(4, 10, 32, device="meta")
    f = one(Fn(lambda s, x: F.layer_norm(x, (32,), s.w, s.b), w=torch.empty(32), b=torch.empty(32)), x)
    m = one(nn.Sequential(nn.LayerNorm(32)), x)
    elts = 4 * 10 * 32
    for c in (f, m):
        assert c.fwd_flops == 7 * elts         # 5 to normalise + 1 weight + 1 bias
        assert c.bwd_flops == 2 * 7 * elts
        assert c.saved_bytes == elts * F32 + 4 * 10 * 8   # input + fp32 mean and rstd per row
    assert m.param_bytes == 2 * 32 * F32 and f.param_bytes == 0


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention(batch_first):
    mha = nn.MultiheadAttention(32, 4, batch_first=batch_first)
    x = torch.empty(2, 10, 32, device="meta") if batch_first else torch.empty(10, 2, 32, device="meta")
    m = Fn(lambda s, x: s.mha(x, x, x, need_weights=False)[0])
    m.mha = mha
    table, _ = costs(m, x)
    c = table["mha"]
    N, L, E, H = 2, 10, 32, 4
    proj = N * L * E * (3 * E) + N * L * E * E            # in-proj (q, k, v) + out-proj: 81920
    attn = 2 * N * L * L * E                              # QK^T + PV over all heads: 12800
    bias = N * L * 4 * E                                  # 3 in-proj + 1 out-proj biases: 2560
    softmax = 5 * N * H * L * L                           # 4000
    assert c.fwd_flops == 2 * (proj + attn) + bias + softmax   # 196000
    assert c.param_bytes == (E * 3 * E + 3 * E + E * E + E) * F32


def test_pointwise_softmax_dropout_views():
    x = torch.empty(4, 8, device="meta")
    t, _ = costs(Fn(lambda s, x: F.dropout(F.gelu(x).softmax(-1) + x, 0.1).transpose(0, 1).reshape(32)), x)
    elts = 32
    assert (t["gelu"].fwd_flops, t["gelu"].saved_bytes) == (8 * elts, elts * F32)
    assert (t["softmax"].fwd_flops, t["softmax"].saved_bytes) == (5 * elts, elts * F32)   # saves its output
    assert (t["add"].fwd_flops, t["add"].saved_bytes, t["add"].fwd_bytes) == (elts, 0, 3 * elts * F32)
    assert (t["dropout"].fwd_flops, t["dropout"].saved_bytes) == (2 * elts, elts)        # 1-byte mask
    assert t["transpose"] == NodeCost()                   # a view
    assert t["reshape"].fwd_bytes == 2 * elts * F32       # reshape of a transposed tensor copies
    t0, _ = costs(Fn(lambda s, x: F.dropout(x, 0.0).reshape(32)), x)
    assert t0["dropout"] == NodeCost() and t0["reshape"] == NodeCost()   # p=0 is a no-op; contiguous view


def test_unknown_op_is_reported_and_memory_bound():
    table, annotate = costs(Fn(lambda s, x: torch.cumsum(x, 0)), torch.empty(4, 8, device="meta"))
    assert annotate.unknown_ops == ["torch.cumsum"]
    assert table["cumsum"].fwd_flops == 0 and table["cumsum"].fwd_bytes == 2 * 32 * F32


def test_annotate_requires_val():
    gm = trace(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(RuntimeError, match="meta\\['val'\\]"):
        AnnotateCosts()(gm)


# ----------------------------------------------------------------------------- ViT-B/16 anchor

VIT_B16_MACS = (12 * (197 * 768 * 2304 + 197 * 768 * 768 + 2 * 197 * 768 * 3072 + 2 * 197 * 197 * 768)
                + 196 * 768 * 768 + 768 * 1000)   # = 17,563,809,792


def vit_macs(make):
    with torch.device("meta"):
        model = make()
    table, annotate = costs(model, torch.empty(1, 3, 224, 224, device="meta"))
    assert annotate.unknown_ops == []
    return sum(c.fwd_macs for c in table.values())


def test_vit_b16_macs_timm():
    timm = pytest.importorskip("timm")
    macs = vit_macs(lambda: timm.create_model("vit_base_patch16_224"))
    assert macs == pytest.approx(17.6e9, rel=0.02)
    assert macs == pytest.approx(VIT_B16_MACS, rel=0.02)


def test_vit_b16_macs_torchvision():
    tv = pytest.importorskip("torchvision")
    macs = vit_macs(tv.models.vit_b_16)
    assert macs == pytest.approx(17.6e9, rel=0.02)
    assert macs == pytest.approx(VIT_B16_MACS, rel=0.02)


# ----------------------------------------------------------------------------- roofline and comm

ROOFLINE = dataclasses.replace(H100, gemm_efficiency=1.0, gemm_half_dim=0.0, attention_efficiency=1.0,
                               bandwidth_efficiency=1.0, op_overhead=4e-6)    # the plain roofline of an H100


def test_roofline_takes_the_max():
    compute = NodeCost(fwd_flops=int(2e12), bwd_flops=int(4e12), fwd_bytes=int(1e6), bwd_bytes=int(2e6))
    launch = ROOFLINE.op_overhead                                      # per kernel that does work
    f, b = op_time(compute, torch.bfloat16, ROOFLINE)
    assert f == pytest.approx(2e12 / 989e12 + launch) and b == pytest.approx(4e12 / 989e12 + launch)
    a100 = dataclasses.replace(ROOFLINE, peak_flops=get_profile("a100").peak_flops)
    assert op_time(compute, torch.float32, a100)[0] == pytest.approx(2e12 / 19.5e12 + launch)
    memory = NodeCost(fwd_flops=int(1e6), bwd_flops=int(2e6), fwd_bytes=int(3.35e9), bwd_bytes=int(6.7e9))
    f, b = op_time(memory, torch.bfloat16, ROOFLINE)
    assert f == pytest.approx(1e-3 + launch) and b == pytest.approx(2e-3 + launch)  # 3.35 GB at 3.35 TB/s
    assert op_time(NodeCost(0, 0, 0, 0), torch.float32, ROOFLINE) == (0.0, 0.0)  # views launch nothing
    # the built-in H100 prices what kernels reach: the same GEMM at its large-GEMM efficiency, bytes at
    # its achievable bandwidth
    f, _ = op_time(compute, torch.bfloat16, H100)
    assert f == pytest.approx(2e12 / (989e12 * H100.gemm_efficiency) + H100.op_overhead)
    f, _ = op_time(memory, torch.bfloat16, H100, "pointwise")
    assert f == pytest.approx(1e-3 / H100.bandwidth_efficiency + H100.op_overhead)


def test_graph_time_sums_op_times():
    m = nn.Sequential(nn.Linear(1024, 1024, bias=False))
    gm = trace(m)
    MetaShapeProp((torch.empty(4096, 1024, device="meta"),))(gm)
    AnnotateCosts()(gm)
    f, b = graph_time(gm.graph.nodes, ROOFLINE)
    f_math = 2 * 4096 * 1024 * 1024 / 67e12                         # fp32, compute-bound
    assert f == pytest.approx(f_math + ROOFLINE.op_overhead)
    assert b == pytest.approx(2 * f_math + 2 * ROOFLINE.op_overhead)      # dX and dW: two launches


LINK = DeviceProfile("test", {torch.float32: 1e12}, mem_bandwidth=1e12, link_bandwidth=100e9,
                     link_latency=1e-5, memory_bytes=1 << 30)


def _pipelined(alpha, bus):
    return (alpha ** 0.5 + bus ** 0.5) ** 2


def test_comm_formulas():
    assert p2p_time(1e9, LINK) == pytest.approx(1e-5 + 1e9 / 100e9)                    # 0.01001
    assert all_reduce_time(1e9, 4, LINK) == pytest.approx(_pipelined(2 * 3 * 1e-5, 2 * 3 / 4 * 0.01))
    assert all_gather_time(1e9, 4, LINK) == pytest.approx(_pipelined(3 * 1e-5, 3 / 4 * 0.01))
    assert reduce_scatter_time(1e9, 4, LINK) == all_gather_time(1e9, 4, LINK)
    for fn in (all_reduce_time, all_gather_time, reduce_scatter_time):
        assert fn(1e9, 1, LINK) == 0.0
    assert p2p_time(0, LINK) == 0.0
    # the pipelined form lies between the bus time and the alpha-beta sum
    assert 2 * 3 / 4 * 0.01 < all_reduce_time(1e9, 4, LINK) < 2 * 3 * 1e-5 + 2 * 3 / 4 * 0.01 + 2 * (6e-5 * 0.015) ** 0.5 + 1e-12


NODES = dataclasses.replace(LINK, gpus_per_node=8, allreduce_bandwidth=200e9, network_bandwidth=10e9,
                            network_latency=5e-5)


def test_collectives_priced_by_the_nodes_they_span():
    """A group inside a node rides the links (all-reduce at the switch's bandwidth); one over k nodes
    with r ranks each is bound by the slower of its node phase and the network phase, each GPU sending
    1/r of the bytes over its own NIC."""
    from autosplit.cost_model.comm import consecutive_nodes, group_nodes, pipeline_crosses_nodes
    assert all_reduce_time(1e9, 8, NODES) == pytest.approx(_pipelined(2 * 7 * 1e-5, 2 * 7 / 8 * 1e9 / 200e9))
    intra, inter = 2 * 7 / 8 * 1e9 / 200e9, 2 * 1 / 2 * 1e9 / (8 * 10e9)
    alpha = 2 * (7 * 1e-5 + 1 * 5e-5)
    assert all_reduce_time(1e9, 16, NODES) == pytest.approx(_pipelined(alpha, max(intra, inter)))
    # dp=4 with stride tp=8: one rank per node, all of it over the network
    assert group_nodes(NODES, 4, 8) == 4 and group_nodes(NODES, 4, 2) == 1 and consecutive_nodes(NODES, 16) == 2
    assert all_reduce_time(1e9, 4, NODES, nodes=4) == pytest.approx(_pipelined(2 * 3 * 5e-5, 2 * 3 / 4 * 1e9 / 10e9))
    assert all_reduce_time(1e9, 4, NODES, nodes=4) > 10 * all_reduce_time(1e9, 4, NODES, nodes=1)
    assert all_gather_time(1e9, 16, NODES) == pytest.approx(
        _pipelined(7 * 1e-5 + 5e-5, max(15 / 16 * 1e9 / 100e9, 1 / 2 * 1e9 / (8 * 10e9))))
    assert p2p_time(1e9, NODES, cross_node=True) == pytest.approx(5e-5 + 1e9 / 10e9)
    assert pipeline_crosses_nodes(NODES, 2, 8) and not pipeline_crosses_nodes(NODES, 2, 4)
    assert not pipeline_crosses_nodes(LINK, 64, 8)           # no node size: one node


def test_many_node_all_reduce_takes_the_faster_of_ring_and_tree():
    """Over k > 2 nodes an all-reduce is NCCL's faster of the ring and the double binary tree (comm.py
    *tree*): 2 ceil(log2 k) network latencies at the full bytes, against the ring's 2 (k - 1) at (k-1)/k
    of them.  Two nodes are the ring's (the nccl-tests fits); other collectives stay rings."""
    ring = lambda nbytes, k: _pipelined(2 * (k - 1) * 5e-5, 2 * (k - 1) / k * nbytes / 10e9)   # noqa: E731
    tree = lambda nbytes, k: _pipelined(2 * math.ceil(math.log2(k)) * 5e-5, 2 * nbytes / 10e9)  # noqa: E731
    for k in (2, 3, 4, 48, 128):
        for nbytes in (1e3, 1e6, 26e6, 1e9):
            want = ring(nbytes, k) if k <= 2 else min(ring(nbytes, k), tree(nbytes, k))
            assert all_reduce_time(nbytes, k, NODES, nodes=k) == pytest.approx(want), (k, nbytes)
    assert all_reduce_time(1e9, 4, NODES, nodes=4) == pytest.approx(ring(1e9, 4))    # large: the ring's bytes
    assert all_reduce_time(1e6, 4, NODES, nodes=4) == pytest.approx(tree(1e6, 4))    # small: the tree's steps
    # a 25 MiB bucket over 48 nodes: 12 latencies, not 94 (the ring's 4.7 ms before any byte moved)
    assert all_reduce_time(26e6, 48, NODES, nodes=48) == pytest.approx(tree(26e6, 48))
    assert all_reduce_time(26e6, 48, NODES, nodes=48) < 0.5 * ring(26e6, 48)
    # gathers and reduce-scatters stay rings
    assert all_gather_time(1e6, 48, NODES, nodes=48) == pytest.approx(_pipelined(47 * 5e-5, 47 / 48 * 1e6 / 10e9))


# ----------------------------------------------------------------------------- profiles and calibration

def test_profiles():
    assert get_profile("H100") is H100 and get_profile(A100) is A100
    assert H100.flops_for(torch.float64) == 67e12 / 2
    assert LINK.flops_for(torch.bfloat16) == 1e12            # no 16-bit entry: float32
    with pytest.raises(AutosplitError, match="device='tpu': unknown device profile; valid names: h100, h200, a100, "
                                             "rtx3090, rtx4090, rtx5090, rtx_pro6000_maxq, cpu"):
        get_profile("tpu")


@pytest.mark.parametrize("gpu,expected", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-80GB", "a100"),
                                          ("NVIDIA H200", "h200"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
                                          ("NVIDIA GeForce RTX 3090", "rtx3090"), ("NVIDIA GeForce RTX 5090", "rtx5090"),
                                          ("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition",
                                           "rtx_pro6000_maxq")])
def test_known_gpu_names_get_their_profile(gpu, expected):
    assert profile_for_gpu(gpu).name == expected


@pytest.mark.parametrize("gpu", ["NVIDIA L4", "NVIDIA GeForce RTX 4090 D", "NVIDIA H100 PCIe", "NVIDIA B200",
                                 "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "NVIDIA GeForce RTX 3090 Ti"])
def test_unknown_gpu_is_an_error_not_the_h100_profile(gpu):
    with pytest.raises(AutosplitError, match=rf"GPU '{gpu}' has no built-in cost-model profile.*pass device="):
        profile_for_gpu(gpu)


def _finite_positive(p: DeviceProfile):
    values = [*p.peak_flops.values(), p.mem_bandwidth, p.link_bandwidth, p.link_latency, p.memory_bytes]
    assert all(math.isfinite(v) and v > 0 for v in values), p
    assert set(p.peak_flops) == {torch.float32, torch.bfloat16, torch.float16}


def test_calibrate_with_two_processes():
    """Includes the 2-process gloo link (about 2-3 s; gives up after link_timeout and falls back)."""
    p = calibrate(seconds=0.3, link_timeout=8.0)
    _finite_positive(p)
    assert p.link_latency < 1.0 and p.link_bandwidth > 1e6


def test_calibrate_link_fallback(monkeypatch):
    cal = importlib.import_module("autosplit.cost_model.calibrate")   # the module; the package exports the function
    def broken(timeout):
        raise RuntimeError("no processes here")
    monkeypatch.setattr(cal, "measure_link", broken)
    p = cal.calibrate(seconds=0.1)
    _finite_positive(p)
    assert "link not measured" in p.name and p.link_latency == 50e-6 and p.link_bandwidth == p.mem_bandwidth
