"""The measured profile: fits, pricing by op class and collective kind, the disk cache, live agreement."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from autosplit.cost_model import H100, all_gather_time, all_reduce_time, p2p_time, profile_cache
from autosplit.cost_model.measured import fit_alpha_beta, fit_alpha_rate
from autosplit.cost_model.roofline import graph_time
from tests import checks_profile

CPU = dataclasses.replace(H100, name="cpu (test)", device_type="cpu", compute={
    "matmul": ((10e-6, 50e9), (20e-6, 40e9)), "attention": ((12e-6, 30e9), (25e-6, 20e9)),
    "norm": ((8e-6, 10e9), (11e-6, 12e9)), "softmax": ((3e-6, 9e9), (5e-6, 30e9)),
    "pointwise": ((4e-6, 20e9), (10e-6, 15e9)), "view": ((1e-6, math.inf), (3e-6, math.inf))},
    comm={"all_reduce/2": (1e-3, 1e-9), "send_recv/2": (2e-4, 5e-10)})


def test_fits_recover_alpha_and_rate():
    samples = [(k, x, k * 7e-6 + x / 3e10) for k, x in ((1, 1e5), (2, 4e6), (4, 8e8), (1, 3e9))]
    alpha, rate = fit_alpha_rate(samples)
    assert alpha == pytest.approx(7e-6, rel=1e-6) and rate == pytest.approx(3e10, rel=1e-6)
    assert fit_alpha_beta([(b, 5e-5 + b * 2e-9) for b in (4096, 65536, 1 << 22)]) == pytest.approx((5e-5, 2e-9))
    assert fit_alpha_rate([(8, 0.0, 8e-6), (8, 0.0, 1.2e-5)])[0] == pytest.approx(1.0e-6 * 1.2, rel=0.2)


def test_measured_profile_prices_ops_by_class():
    from autosplit.cost_model import AnnotateCosts
    from autosplit.passes.shape_prop import MetaShapeProp
    from autosplit.trace import trace
    gm = trace(nn.Sequential(nn.Linear(64, 128), nn.GELU()), 1)
    MetaShapeProp((torch.randn(32, 64),))(gm)
    AnnotateCosts()(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    lin = nodes["_0"].meta["cost"]
    fwd, bwd = graph_time([nodes["_0"]], CPU)
    assert fwd == pytest.approx(10e-6 + lin.fwd_flops / 50e9)
    assert bwd == pytest.approx(20e-6 + lin.bwd_flops / 40e9)
    gelu = nodes["_1"].meta["cost"]
    assert graph_time([nodes["_1"]], CPU)[0] == pytest.approx(4e-6 + gelu.fwd_bytes / 20e9)
    # the same nodes without fits: the roofline (H100 has none)
    assert graph_time([nodes["_0"]], H100)[0] != pytest.approx(fwd)


def test_measured_comm_by_kind_and_group_size():
    assert all_reduce_time(1e6, 2, CPU) == pytest.approx(1e-3 + 1e6 * 1e-9)
    assert p2p_time(1e6, CPU) == pytest.approx(2e-4 + 1e6 * 5e-10)
    assert all_reduce_time(1e6, 4, CPU) == all_reduce_time(1e6, 4, H100)     # not measured: the ring formula
    assert all_gather_time(1e6, 2, CPU) == all_gather_time(1e6, 2, H100)
    assert all_reduce_time(1e6, 1, CPU) == 0.0


def test_cache_round_trip_key_and_switch(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSPLIT_PROFILE_DIR", str(tmp_path))
    key = profile_cache.machine_key("cpu", 2)
    assert profile_cache.load(key) is None
    path = profile_cache.save(key, CPU)
    assert path.parent == tmp_path and path.name.startswith(profile_cache.key_name(key))
    assert profile_cache.load(key) == CPU
    assert profile_cache.load({**key, "torch": "0.0"}) is None            # another torch: not this profile
    assert profile_cache.load({**key, "local_ranks": 4}) is None
    monkeypatch.setenv("AUTOSPLIT_PROFILE_CACHE", "0")
    assert profile_cache.load(key) is None and profile_cache.save(key, CPU) is None


def test_in_step_cost_is_one_constant_per_group_size_added_to_collectives_only():
    """What a collective costs after a compute burst beyond back to back (comm_bench.py *in step*): the
    mean difference over kinds and sizes per group size, never below 0, on every collective kind's
    alpha of that size and not on send_recv."""
    from types import SimpleNamespace
    from autosplit.profiling.measure_profile import _build, in_step_extra
    times = {("all_reduce", 2, 1, 4096): 1.0e-3, ("in_step/all_reduce", 2, 1, 4096): 1.7e-3,
             ("all_reduce", 2, 1, 1 << 20): 2.0e-3, ("in_step/all_reduce", 2, 1, 1 << 20): 2.5e-3,
             ("all_gather", 2, 1, 4096): 1.0e-3, ("in_step/all_gather", 2, 1, 4096): 1.3e-3,
             ("all_gather", 2, 1, 1 << 20): 2.0e-3, ("in_step/all_gather", 2, 1, 1 << 20): 2.3e-3,
             ("all_reduce", 4, 1, 4096): 3.0e-3, ("in_step/all_reduce", 4, 1, 4096): 1.0e-3,
             ("all_reduce", 4, 1, 1 << 20): 4.0e-3, ("in_step/all_reduce", 4, 1, 1 << 20): 3.0e-3,
             ("send_recv", 2, 1, 4096): 1.0e-4, ("send_recv", 2, 1, 1 << 20): 6.0e-4}
    extra = in_step_extra(times)
    assert extra[2] == pytest.approx(0.45e-3) and extra[4] == 0.0        # (0.7 + 0.5 + 0.3 + 0.3) / 4; never < 0
    profile = _build(SimpleNamespace(device=torch.device("cpu"), size=4), CPU, CPU.compute, dict(times), (1.0,) * 4)
    plain = {k: fit_alpha_beta([(b, t) for (kind, n, _, b), t in times.items() if f"{kind}/{n}" == k])
             for k in ("all_reduce/2", "all_gather/2", "all_reduce/4", "send_recv/2")}
    assert profile.comm["all_reduce/2"] == pytest.approx((plain["all_reduce/2"][0] + 0.45e-3, plain["all_reduce/2"][1]))
    assert profile.comm["all_gather/2"][0] == pytest.approx(plain["all_gather/2"][0] + 0.45e-3)
    assert profile.comm["all_reduce/4"] == pytest.approx(plain["all_reduce/4"])
    assert profile.comm["send_recv/2"] == pytest.approx(plain["send_recv/2"])
    assert not any(k.startswith("in_step") for k in profile.comm)


def test_a_shared_host_prices_every_kind_by_one_fit_to_all_kinds_in_step_times():
    """More ranks than cores (*shared host*): every collective kind on n ranks gets the one alpha-beta fit of
    all kinds' in-step times on n ranks (not its own back-to-back fit, nor the in-step constant on it);
    send_recv keeps its own."""
    from types import SimpleNamespace
    from autosplit.profiling.measure_profile import _build, shared_host_fits
    times = {("all_reduce", 2, 1, 4096): 1.0e-3, ("in_step/all_reduce", 2, 1, 4096): 2.6e-3,
             ("all_reduce", 2, 1, 1 << 20): 2.0e-3, ("in_step/all_reduce", 2, 1, 1 << 20): 3.8e-3,
             ("reduce_scatter", 2, 1, 4096): 2.5e-3, ("in_step/reduce_scatter", 2, 1, 4096): 2.8e-3,
             ("reduce_scatter", 2, 1, 1 << 20): 3.5e-3, ("in_step/reduce_scatter", 2, 1, 1 << 20): 3.6e-3,
             ("send_recv", 2, 1, 4096): 1.0e-4, ("send_recv", 2, 1, 1 << 20): 6.0e-4}
    pooled = fit_alpha_beta([(b, t) for (kind, n, _, b), t in times.items() if kind.startswith("in_step/")])
    assert shared_host_fits(times) == {2: pytest.approx(pooled)}
    assert pooled[0] == pytest.approx(2.7e-3, rel=0.01) and pooled[1] > 0   # midway between the kinds
    world = SimpleNamespace(device=torch.device("cpu"), size=4)
    profile = _build(world, CPU, CPU.compute, dict(times), (1.0,) * 4, shared=True)
    assert profile.comm["all_reduce/2"] == pytest.approx(pooled) == profile.comm["reduce_scatter/2"]
    assert profile.comm["send_recv/2"] == pytest.approx(fit_alpha_beta([(4096, 1.0e-4), (1 << 20, 6.0e-4)]))
    unshared = _build(world, CPU, CPU.compute, dict(times), (1.0,) * 4)   # each kind its own fit + the constant
    assert unshared.comm["all_reduce/2"][0] != pytest.approx(unshared.comm["reduce_scatter/2"][0])


def test_posting_is_priced_under_load_where_the_host_has_more_ranks():
    """p2p_post: comm_bench *post* (after compute, where each rank has a core) on a host of 2 ranks; the relay's
    posting while the others compute (sharing_bench *loaded post*) where it was measured (3+ ranks)."""
    from types import SimpleNamespace
    from autosplit.profiling.comm_bench import POST_BYTES
    from autosplit.profiling.measure_profile import _build
    times = {("all_reduce", 2, 1, 4096): 1e-3, ("all_reduce", 2, 1, 1 << 20): 2e-3, ("post", 2, 1, POST_BYTES): 1e-4}
    world = SimpleNamespace(device=torch.device("cpu"), size=4)
    assert _build(world, CPU, CPU.compute, dict(times), (1.0,) * 4).p2p_post == 1e-4
    assert _build(world, CPU, CPU.compute, dict(times), (1.0,) * 4, 3e-4, 1.5e-3).p2p_post == 1.5e-3


def test_posting_after_compute_is_priced_by_its_mean_with_groups_overlapping(monkeypatch):
    """comm_bench *post*: with a burst (a host with a core per rank) each post follows the burst, the group
    posted one repetition before is waited only after it (two in flight, told apart by tag), and the
    time is the mean, stalls included (a step pays each post); idle, the median of posts waited at once."""
    from types import SimpleNamespace
    from autosplit.profiling import comm_bench
    clock, log = [0.0], []
    stalls = iter([1e-4] * 11 + [5e-3] + [1e-4] * 100)     # the warm-up and ten posts, a stall of 5 ms, the rest

    class Posted:
        def __init__(self, tag):
            self.tag = tag

        def wait(self, watchdog):
            log.append(("wait", self.tag))

    class Transport:
        def post(self, ops, what):
            clock[0] += next(stalls)
            tags = {tag for _, _, _, tag in ops}
            assert len(tags) == 1
            log.append(("post", tags.pop()))
            return Posted(log[-1][1])

        def close(self):
            pass

    monkeypatch.setattr(comm_bench, "make_transport", lambda backend, group: Transport())
    monkeypatch.setattr(comm_bench.time, "perf_counter", lambda: clock[0])
    world = SimpleNamespace(rank=0, size=2, backend="gloo", device=torch.device("cpu"))
    bursts = []
    mean = comm_bench.measure_post(world, None, reps=20, burst=lambda: bursts.append(len(log)))
    assert mean == pytest.approx((19 * 1e-4 + 5e-3) / 20)                 # the stall counts
    assert len(bursts) == 21 and log[:4] == [("post", 0), ("post", 1), ("wait", 0), ("post", 2)]
    assert log[-2:] == [("wait", 19), ("wait", 20)] and len({t for k, t in log if k == "post"}) == 21
    log.clear()
    stalls = iter([1e-4] * 12 + [5e-3] + [1e-4] * 100)
    assert comm_bench.measure_post(world, None, reps=21) == pytest.approx(1e-4)   # idle: the median
    assert log[:2] == [("post", 0), ("wait", 0)]


def test_resume_factor_is_the_median_round_and_never_below_one():
    from autosplit.profiling.resume_bench import factors
    plain = [(0.010, 0.020)] * 3
    rounds = [(plain, [(0.011, 0.021)] * 3), (plain, [(0.012, 0.019)] * 3), (plain, [(0.030, 0.018)] * 3)]
    # forward: the median of 1.1, 1.2, 3.0; backward: of 1.05, 0.95, 0.9, raised to 1
    assert factors(rounds) == pytest.approx((1.2, 1.0))


def test_plan_and_prediction_use_the_measured_profile():
    import autosplit
    from autosplit.cost_model.step_time import predict_plan
    from tests.models import VARIANTS
    x = torch.randn(2, 3, 32, 32)
    plan = autosplit.compile(VARIANTS["timm_cls"](), mesh=(2, 1, 1), example_input=x, device=CPU)
    quick = dataclasses.replace(CPU, compute=None, comm=None, op_overhead=4e-6, gemm_efficiency=1.0,   # the roofline
                                gemm_half_dim=0.0, bandwidth_efficiency=1.0)
    other = autosplit.compile(VARIANTS["timm_cls"](), mesh=(2, 1, 1), example_input=x, device=quick)
    total = sum(s.fwd_time + s.bwd_time for s in plan.stages)
    assert total > 1.5 * sum(s.fwd_time + s.bwd_time for s in other.stages)   # alphas dominate tiny ops
    pred = predict_plan(plan, device=CPU)
    assert pred.total >= pred.compute > 0


@pytest.mark.slow
def test_wake_is_measured_with_more_than_two_ranks_per_host(pool4):
    """4 ranks: two relay while two compute; every rank returns the host's figures (seconds, small): the
    wake, and the sender's posting time under that load (the profile's p2p_post on such a host)."""
    values = pool4.run(checks_profile.wake_measured)
    assert len(set(values)) == 1, values
    wake, loaded_post = values[0]
    assert 0.0 <= wake < 0.05 and 0.0 < loaded_post < 0.05, values


@pytest.mark.slow
def test_reference_pipeline_runs_on_every_rank_of_the_host(pool4):
    """4 ranks as a 1F1B pipeline of 8 microbatches (posting and waiting as the executor does, under the
    strict transport): every rank gets rank 0's rounds; each rank runs 8 forwards and backwards in turn,
    so a step lasts at least about 8 x (F + B) of the stage alone (half of it: the alone time is noisy)."""
    from autosplit.profiling.pipeline_bench import MICROBATCHES, ROUNDS
    values = pool4.run(checks_profile.pipeline_measured)
    assert all(v == values[0] for v in values) and len(values[0]) == ROUNDS
    for fwd, bwd, measured, nbytes in values[0]:
        assert 0 < fwd and 0 < bwd and measured > 0.5 * MICROBATCHES * (fwd + bwd)
        assert nbytes == 4 * 65 * 192 * 4                     # one (4, 65, 192) fp32 activation


@pytest.mark.slow
def test_profile_measured_in_a_live_world_is_agreed_and_cached(pool2, tmp_path):
    a, b = pool2.run(checks_profile.measured_then_cached, str(tmp_path))
    assert a["profile"] == b["profile"]                                     # one profile on every rank
    p = a["profile"]
    assert {"all_reduce/2", "all_gather/2", "reduce_scatter/2", "broadcast/2", "send_recv/2"} <= set(p["comm"])
    assert all(alpha >= 0 and beta >= 0 for alpha, beta in p["comm"].values())
    assert set(p["compute"]) == {"matmul", "attention", "norm", "softmax", "pointwise", "view"}
    assert len(p["sharing"]) == 2 and p["sharing"][0] == 1.0 <= p["sharing"][1]   # 2 ranks on this host
    assert 0 < p["p2p_post"] < 0.05           # host seconds to post a transfer group: measured, and small
    assert "post/2" not in p["comm"]
    assert p["p2p_wake"] == 0.0               # 2 ranks: no other rank to compute while they relay
    assert len(p["resume"]) == 2 and all(1.0 <= f < 2.0 for f in p["resume"])   # measured, at least 1
    assert 0.0 <= p["pass_overhead"] < 0.05   # fitted to the reference pipeline: seconds a pass, small
    assert a["planned_with"] == b["planned_with"] == p["name"]             # parallelize found the cached one
    assert a["fwd"] == b["fwd"] and a["same_stream"] and b["same_stream"]
    assert list(tmp_path.glob("*-2r-*.json"))


def test_sharing_is_the_median_round_not_one_noisy_pass():
    """Two ranks on a host whose workload takes 20 ms alone and 22 ms in pairs (slowdown 1.10), in three
    rounds.  One round's lone pass ran 14.3 ms (a quiet moment) or one round's pair 40 ms (a stranger on
    the host): as a single pass, each would be the profile's figure (1.54, what a real profile once
    recorded, or 2.0); the median round gives 1.10 either way.  A level never falls below the one before."""
    from autosplit.profiling.sharing_bench import slowdowns

    def rounds(lone=0.020, pair=0.022):
        return [{**{(rnd, 1): lone for rnd in range(3)}, **{(rnd, 2): pair for rnd in range(3)}},
                {(rnd, 2): pair for rnd in range(3)}]
    assert slowdowns(rounds(), 2, 3) == pytest.approx((1.0, 1.1))
    quiet = rounds()
    quiet[0][0, 1] = 0.0143                            # round 0: what one pass would have kept
    assert slowdowns(quiet, 2, 1)[1] == pytest.approx(1.54, abs=0.01)
    assert slowdowns(quiet, 2, 3) == pytest.approx((1.0, 1.1))
    stranger = rounds()
    stranger[0][0, 2] = stranger[1][0, 2] = 0.040
    assert slowdowns(stranger, 2, 1)[1] == pytest.approx(2.0)
    assert slowdowns(stranger, 2, 3) == pytest.approx((1.0, 1.1))
    assert slowdowns([{(0, 1): 0.02, (0, 2): 0.019}, {(0, 2): 0.019}], 2, 1) == (1.0, 1.0)


def test_measurement_workloads_leave_the_callers_random_streams_alone():
    """The op chains and the encoder-stack workload draw from a seeded private stream: a profile measured
    between a user's torch.manual_seed and their model's creation does not change that model."""
    from autosplit.cost_model.op_bench import measure_compute
    from autosplit.profiling.cpu_workload import encoder_stack
    torch.manual_seed(5)
    state = torch.get_rng_state()
    measure_compute(budget=0.05)
    encoder_stack("cpu", 1)
    assert torch.equal(torch.get_rng_state(), state)
