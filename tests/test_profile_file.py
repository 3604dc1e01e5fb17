"""Profile files (cost_model/profile_file.py), ``device="x.json"``, the device's kernel model measured and fitted
(autosplit/profiling/device_bench.py, kernel_fit.py), collectives per node span, ``autosplit.measure_profile``
in a job and ``python -m autosplit profile`` alone."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import autosplit
from autosplit.cost_model import H100, get_profile, profile_cache, profile_file
from autosplit.errors import AutosplitError
from autosplit.profiling import kernel_fit
from tests import checks_profile_file

ROOT = pathlib.Path(__file__).resolve().parents[1]

# every field away from its default, with what JSON cannot say plainly: dtypes, tuples, an unbounded rate
FULL = dataclasses.replace(
    H100, name="h100 (test: every field set)", op_overhead=5e-6, device_type="cuda",
    compute={"matmul": ((1e-5, 5e11), (2e-5, 4e11)), "view": ((1e-6, math.inf), (3e-6, math.inf))},
    comm={"all_reduce/8": (2e-5, 1e-12), "all_reduce/16@2": (4e-5, 3e-11), "send_recv/2@2": (8e-6, 4e-11)},
    sharing=(1.0, 1.07), p2p_post=1e-4, p2p_wake=2e-4, resume=(1.1, 1.05), pass_overhead=3e-4,
    gemm_efficiency=0.72, gemm_half_dim=96.0, attention_efficiency=0.61, bandwidth_efficiency=0.86,
    gpus_per_node=8, allreduce_bandwidth=480e9, network_bandwidth=25e9, network_latency=5e-6)


def _tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 4))


def test_a_profile_file_reads_back_equal(tmp_path):
    path = profile_file.write(tmp_path / "p.json", FULL, source="test host")
    assert profile_file.read(path) == FULL
    assert profile_file.read_with_source(str(path))[1] == "test host"
    data = json.loads(path.read_text())
    assert data["format"] == profile_file.FORMAT and data["peak_flops"]["bfloat16"] == 989e12
    assert {f.name for f in dataclasses.fields(FULL)} | {"format", "source"} == set(data)
    # a hand-written file states only the required fields; the rest take DeviceProfile's defaults
    short = {"format": profile_file.FORMAT, "name": "mine", "peak_flops": {"float32": 1e12}, "mem_bandwidth": 1e11,
             "link_bandwidth": 1e10, "link_latency": 1e-5, "memory_bytes": 1 << 30}
    (tmp_path / "short.json").write_text(json.dumps(short))
    assert profile_file.read(tmp_path / "short.json") == autosplit.cost_model.DeviceProfile(
        name="mine", peak_flops={torch.float32: 1e12}, mem_bandwidth=1e11, link_bandwidth=1e10, link_latency=1e-5,
        memory_bytes=1 << 30)


def test_the_cache_stores_a_profile_file_with_its_key(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSPLIT_PROFILE_DIR", str(tmp_path))
    key = profile_cache.machine_key("cpu", 3)
    path = profile_cache.save(key, FULL)
    assert profile_cache.load(key) == FULL
    data = json.loads(path.read_text())
    assert data["key"] == key and data["cache_format"] == profile_cache.FORMAT
    data["cache_format"] = profile_cache.FORMAT - 1                 # another measurement method: ignored
    path.write_text(json.dumps(data))
    assert profile_cache.load(key) is None


def test_get_profile_reads_a_path_once_per_version_and_names_it(tmp_path, caplog):
    path = profile_file.write(tmp_path / "cluster.json", FULL, source="node-3, NVIDIA H100, torch x")
    with caplog.at_level(logging.INFO, logger="autosplit"):
        assert get_profile(str(path)) == FULL == get_profile(path) == get_profile(str(path))
    reads = [r.getMessage() for r in caplog.records if "cost-model profile from" in r.getMessage()]
    assert len(reads) == 1 and str(path) in reads[0] and "node-3" in reads[0] and FULL.name in reads[0]
    changed = dataclasses.replace(FULL, gemm_efficiency=0.5)
    profile_file.write(path, changed, source="remeasured, a longer source line")   # another size: read again
    assert get_profile(path) == changed


def test_compile_parallelize_options_and_search_take_a_profile_file(tmp_path):
    path = str(profile_file.write(tmp_path / "p.json", FULL))
    x = torch.randn(4, 16)
    plan = autosplit.compile(_tiny_model(), mesh=(2, 1, 1), example_input=x, device=path)
    assert plan.profile == FULL and plan.device == FULL.name
    assert f"device model {FULL.name}" in plan.summary()
    opts = autosplit.PlanOptions(device=pathlib.Path(path))
    assert autosplit.compile(_tiny_model(), (2, 1, 1), x, options=opts).profile == FULL
    ranked = autosplit.search(_tiny_model(), 2, torch.randn(1, 16), global_batch=8, device=path, top=2)
    assert len(ranked) > 0


@pytest.mark.parametrize("case, text, field", [
    ("bad_json", '{"format": 1, "name": ', "not JSON"),
    ("unknown_field", None, "unknown field 'gemm_speed'"),
    ("wrong_format", None, "field 'format' is 99"),
    ("no_format", None, "field 'format' is missing"),
    ("bad_dtype", None, "field 'peak_flops' names dtype 'float17'"),
    ("bad_comm_key", None, "field 'comm' has key 'all_reduce'"),
    ("bad_number", None, "field 'mem_bandwidth' is 'fast'"),
    ("missing_required", None, "missing field 'memory_bytes'"),
])
def test_a_bad_profile_file_is_refused_naming_the_path_and_the_field(tmp_path, case, text, field):
    data = profile_file.to_json(FULL, source="t")
    edits = {"unknown_field": lambda d: d.update(gemm_speed=1.0), "wrong_format": lambda d: d.update(format=99),
             "no_format": lambda d: d.pop("format"), "bad_dtype": lambda d: d["peak_flops"].update(float17=1.0),
             "bad_comm_key": lambda d: d["comm"].update(all_reduce=[1e-5, 1e-12]),
             "bad_number": lambda d: d.update(mem_bandwidth="fast"),
             "missing_required": lambda d: d.pop("memory_bytes")}
    if case in edits:
        edits[case](data)
        text = json.dumps(data)
    path = tmp_path / f"{case}.json"
    path.write_text(text)
    for device in (str(path), path):
        with pytest.raises(AutosplitError, match="profile file") as info:
            get_profile(device)
        assert str(path) in str(info.value) and field in str(info.value), str(info.value)


def test_a_missing_profile_file_is_named_with_where_it_was_looked_for(tmp_path):
    missing = tmp_path / "nowhere" / "profile.json"
    with pytest.raises(AutosplitError, match=r"profile file '.*profile\.json': no such file") as info:
        autosplit.compile(_tiny_model(), mesh=(1, 1, 1), example_input=torch.randn(2, 16), device=str(missing))
    assert str(missing) in str(info.value)
    with pytest.raises(AutosplitError, match="profile file"):
        get_profile(missing)                       # an os.PathLike, whatever its suffix
    with pytest.raises(AutosplitError, match="unknown device profile.*a profile file"):
        get_profile("h100.yaml")


def test_the_kernel_fit_recovers_the_parameters_it_was_generated_with():
    """Times generated from the kernel model's formula (kernel_fit.gemm_seconds: max of compute and memory
    time, plus the launch) give back gemm_efficiency, gemm_half_dim and attention_efficiency."""
    peak, bandwidth, overhead = 989e12, 3.35e12 * 0.86, 4.5e-6
    from autosplit.profiling.device_bench import CUDA_ATTENTION, CUDA_GEMMS
    gemms = [(s, kernel_fit.gemm_seconds(s, peak, 0.72, 96.0, bandwidth, overhead, 2)) for s in CUDA_GEMMS]
    eff, half = kernel_fit.fit_gemm(gemms, peak, bandwidth, overhead, 2)
    assert eff == pytest.approx(0.72, rel=1e-4) and half == pytest.approx(96.0, rel=1e-3)
    shapes = [(b * h, length, length, d) for b, h, length, d in CUDA_ATTENTION]
    attention = [(s, kernel_fit.attention_seconds(s, peak, 0.72, 96.0, 0.61, bandwidth, overhead, 2)) for s in shapes]
    fitted = kernel_fit.fit_attention(attention, peak, 0.72, 96.0, bandwidth, overhead, 2)
    assert fitted == pytest.approx(0.61, rel=1e-4)
    # a measured peak (no datasheet): the asymptote is peak * efficiency, above the largest rate timed
    largest = max(kernel_fit.gemm_flops(s) / t for s, t in gemms)
    eff2, half2 = kernel_fit.fit_gemm(gemms, largest, bandwidth, overhead, 2, max_efficiency=1e3)
    assert largest * eff2 == pytest.approx(peak * 0.72, rel=1e-4) and half2 == pytest.approx(96.0, rel=1e-3)
    # noisy times (+-10 %): still close
    noisy = [(s, t * (1.1 if i % 2 else 0.9)) for i, (s, t) in enumerate(gemms)]
    eff3, half3 = kernel_fit.fit_gemm(noisy, peak, bandwidth, overhead, 2)
    assert 0.6 < eff3 < 0.85 and 50 < half3 < 180


def test_the_fit_prices_a_gemm_as_the_cost_model_does():
    """kernel_fit's rate is cost_model/kernels.py's: the same efficiency for a shape."""
    from autosplit.cost_model import kernels
    profile = dataclasses.replace(H100, gemm_efficiency=0.7, gemm_half_dim=128.0)
    for shape in ((1, 64, 4096, 4096), (96, 197, 197, 64), (1, 8192, 8192, 8192)):
        assert kernels.gemm_efficiency(profile, shape) == pytest.approx(0.7 * kernel_fit.shape_factor(shape, 128.0))


def test_the_device_sweep_on_cpu_gives_sane_numbers_in_a_small_budget():
    from autosplit.profiling.device_bench import measure_device
    state = torch.get_rng_state()
    m = measure_device("cpu", seconds=0.5)
    assert torch.equal(state, torch.get_rng_state())              # the caller's random stream untouched
    assert m.dtype == torch.float32 and not m.datasheet and m.wall_s < 20
    assert 0 < m.gemm_efficiency <= 1.5 and m.gemm_half_dim >= 0 and m.peak_flops > 1e8
    assert 0 < m.attention_efficiency and 0 < m.bandwidth_efficiency <= 1.5 and m.mem_bandwidth > 1e8
    assert 0 < m.op_overhead < 1e-3 and len(m.gemm) >= 10 and all(t > 0 for _, t in m.gemm)
    profile = m.apply(get_profile("cpu"))
    assert profile.peak_flops[torch.float32] == m.peak_flops and profile.gemm_half_dim == m.gemm_half_dim
    assert "GEMM" in m.summary()
    with pytest.raises(AutosplitError, match="seconds=0"):
        measure_device("cpu", seconds=0)
    with pytest.raises(AutosplitError, match="device='tpu'"):
        measure_device("tpu")


def test_spans_and_their_groups():
    from autosplit.profiling.comm_bench import ping_pong_peer, span_groups, spans
    assert spans(4, 4) == [(2, 1), (4, 1)]                                  # one node
    assert spans(16, 8) == [(2, 1), (2, 2), (4, 1), (4, 2), (8, 1), (8, 2), (16, 2)]
    assert span_groups(16, 8, 4, 2) == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    assert span_groups(4, 4, 2, 1) == [[0, 1], [2, 3]]
    assert [ping_pong_peer(r, 16, 8, across=True) for r in (0, 7, 8)] == [8, 15, 0]
    assert [ping_pong_peer(r, 6, 3, across=False) for r in (0, 1, 2)] == [1, 0, None]


def test_collectives_are_measured_per_node_span_in_a_live_world(pool2):
    """2 ranks as one node: kind/2 keys and an intra-node send_recv; as two nodes of one rank: kind/2@2, a
    send_recv between the nodes, and the profile states gpus_per_node and the network."""
    from autosplit.profiling.measure_profile import _build, slowest_times
    world = SimpleNamespace(device=torch.device("cpu"), size=2)
    one_node = _build(world, FULL, None, slowest_times(pool2.run(checks_profile_file.comm_records, 2)), None, local=2)
    kinds = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
    assert {f"{k}/2" for k in kinds} | {"send_recv/2"} == set(one_node.comm)
    assert one_node.gpus_per_node is None and one_node.network_bandwidth == FULL.network_bandwidth
    two_nodes = _build(world, FULL, None, slowest_times(pool2.run(checks_profile_file.comm_records, 1)), None, local=1)
    assert {f"{k}/2@2" for k in kinds} | {"send_recv/2@2"} == set(two_nodes.comm)
    assert all(a >= 0 and b >= 0 for a, b in two_nodes.comm.values())
    alpha, beta = two_nodes.comm["send_recv/2@2"]
    assert two_nodes.gpus_per_node == 1 and two_nodes.network_latency == alpha
    assert beta == 0 or two_nodes.network_bandwidth == pytest.approx(1 / beta)


def test_a_gpu_jobs_topology_comes_from_its_collective_fits():
    """On GPUs (device type cuda; only the arithmetic here): the link is the all-gather's ring bus bandwidth
    over a whole node, allreduce_bandwidth the all-reduce's where it beats that by more than 10 % (NVLS),
    the network the send_recv between nodes; gpus_per_node the ranks per node."""
    from autosplit.profiling.measure_profile import _topology
    world = SimpleNamespace(device=torch.device("cuda"), size=16)
    comm = {"all_gather/8": (2e-5, 7 / 8 / 360e9), "all_reduce/8": (3e-5, 2 * 7 / 8 / 480e9),
            "send_recv/2": (6e-6, 1 / 380e9), "send_recv/2@2": (9e-6, 1 / 24e9)}
    topo = _topology(world, comm, 8)
    assert topo["gpus_per_node"] == 8 and topo["link_latency"] == 6e-6
    assert topo["link_bandwidth"] == pytest.approx(360e9) and topo["allreduce_bandwidth"] == pytest.approx(480e9)
    assert topo["network_bandwidth"] == pytest.approx(24e9) and topo["network_latency"] == 9e-6
    ring = dict(comm, **{"all_reduce/8": (3e-5, 2 * 7 / 8 / 370e9)})          # no faster than the ring
    assert _topology(world, ring, 8)["allreduce_bandwidth"] == 0.0
    single = _topology(SimpleNamespace(device=torch.device("cpu"), size=2), {"send_recv/2": (1e-4, 1e-9)}, 2)
    assert single == {"gpus_per_node": None, "link_latency": 1e-4, "link_bandwidth": pytest.approx(1e9)}


def test_an_error_deciding_the_jobs_profile_reaches_every_rank(monkeypatch):
    """runtime/profile.py: where rank 0 has no profile to give (an unknown GPU), the other ranks raise its
    error instead of waiting out the deadline."""
    from autosplit.runtime import profile as runtime_profile
    store = {}
    fake = SimpleNamespace(set=store.__setitem__, get=store.__getitem__,
                           check=lambda keys: all(k in store for k in keys))
    watchdog = SimpleNamespace(until=lambda done, doing: done() or pytest.fail(f"would wait: {doing}"))

    def unknown_gpu(world):
        raise AutosplitError("GPU 'NVIDIA L4' has no built-in cost-model profile")
    monkeypatch.setattr(runtime_profile, "_rank0_profile", unknown_gpu)
    start = next(runtime_profile._CALLS)
    monkeypatch.setattr(runtime_profile, "_CALLS", iter([start, start]))
    for rank in (0, 1):
        with pytest.raises(AutosplitError, match="NVIDIA L4"):
            runtime_profile.agreed_profile(SimpleNamespace(rank=rank, store=fake), watchdog)


@pytest.mark.slow
def test_measure_profile_in_a_job_gives_every_rank_the_profile_and_writes_the_file(pool2, tmp_path):
    path = tmp_path / "job.json"
    a, b = pool2.run(checks_profile_file.public_measure, str(path), 0.3)
    assert a == b and a["groups_left"] == 0 == b["groups_left"]    # one profile; the measurement's groups gone
    written = profile_file.read(path)
    assert profile_file.to_dict(written) == a["profile"]
    assert {"all_reduce/2", "all_gather/2", "reduce_scatter/2", "broadcast/2", "send_recv/2"} <= set(written.comm)
    assert written.compute is not None and 0 < written.gemm_efficiency <= 1.5 and written.op_overhead > 0
    assert "2 ranks" in profile_file.read_with_source(path)[1]


def test_parallelize_plans_with_a_profile_file_and_says_so(pool2, tmp_path):
    path = profile_file.write(tmp_path / "for_parallelize.json", dataclasses.replace(FULL, device_type="cpu"))
    a, b = pool2.run(checks_profile_file.parallelize_with_file, str(path))
    assert a == b == {"planned_with": FULL.name, "named": True}


def test_measure_profile_refuses_bad_arguments():
    with pytest.raises(AutosplitError, match="path=3"):
        autosplit.measure_profile(3)
    with pytest.raises(AutosplitError, match="seconds=-1"):
        autosplit.measure_profile(seconds=-1)


@pytest.mark.e2e
def test_the_profile_command_alone_writes_a_file_compile_accepts(tmp_path):
    """``python -m autosplit profile --out`` on this CPU, no torchrun: the single-process measurement."""
    out = tmp_path / "cpu.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    # one thread, as torchrun's ranks run (two threads on this 2-core host slow 5-10x when other processes load it)
    env.update(AUTOSPLIT_PROFILE_CACHE="0", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "autosplit", "profile", "--out", str(out), "--seconds", "0.3"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    assert f"wrote {out}" in run.stdout and "GEMM efficiency" in run.stdout
    profile = profile_file.read(out)
    assert profile.device_type == "cpu" and profile.compute is not None and profile.comm is None
    assert profile.gpus_per_node is None and 0 < profile.gemm_efficiency <= 1.5
    plan = autosplit.compile(_tiny_model(), mesh=(2, 1, 1), example_input=torch.randn(4, 16), device=str(out))
    assert plan.profile == profile
    bad = subprocess.run([sys.executable, "-m", "autosplit", "plan", "x", "--device", "tpu"], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=120)
    assert bad.returncode == 2 and "profile file ending in .json" in bad.stderr
