"""A real two-node launch on one machine (issue 12): two network namespaces joined by a veth pair, each
with its own address, one torchrun agent per namespace (2 local ranks each), c10d rendezvous.

Found by hand, and what the README tells multi-node users: each agent needs ``--local-addr`` with its own
address, and the rendezvous host is named with ``--rdzv-conf is_host=1`` (``is_host=0`` on the other):
the namespaces share one hostname, so neither the agents nor gloo can find each other from it.  Gloo is
told which interface to use (``GLOO_SOCKET_IFNAME``), as NCCL is with ``NCCL_SOCKET_IFNAME``.

Needs root (``ip netns``); skips with the reason otherwise.  Whatever happens, the agents' process
groups are killed and both namespaces (and with them the veth pair) are deleted.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
LIMIT_S = 240


def _ip(*args, ns: str | None = None) -> None:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@pytest.fixture
def two_nodes():
    """(namespace, address, interface) for two 'nodes' on 10.<a>.<b>.1 / .2, this process's own names."""
    tag = os.getpid() % 100000
    nodes = [(f"as{tag}n{k}", f"10.213.{tag % 250}.{k + 1}", f"as{tag}v{k}") for k in range(2)]
    made = []
    try:
        for ns, _, _ in nodes:
            _ip("netns", "add", ns)
            made.append(ns)
    except (OSError, subprocess.CalledProcessError) as exc:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        reason = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        pytest.skip(f"cannot create network namespaces (needs root and iproute2): {reason}")
    try:
        (a, _, va), (b, _, vb) = nodes
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", va, "netns", a)
        _ip("link", "set", vb, "netns", b)
        for ns, addr, dev in nodes:
            _ip("addr", "add", f"{addr}/24", "dev", dev, ns=ns)
            _ip("link", "set", dev, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
        yield nodes
    finally:
        for ns, _, _ in nodes:          # deleting a namespace deletes its end of the veth pair, and so both
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_two_nodes_train_like_one_device(two_nodes, tmp_path):
    host_addr = two_nodes[0][1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "AUTOSPLIT_TIMEOUT": "60",
           "AUTOSPLIT_STRICT_P2P": "1"}
    agents = []
    start = time.monotonic()
    try:
        for k, (ns, addr, dev) in enumerate(two_nodes):
            cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
                   "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"{host_addr}:29400", "--rdzv-id", "autosplit-multinode",
                   "--rdzv-conf", f"is_host={int(k == 0)}", "--local-addr", addr,
                   "-m", "tests.multinode_worker", str(tmp_path)]
            log = open(tmp_path / f"node{k}.log", "w")
            agents.append(subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                           env={**env, "GLOO_SOCKET_IFNAME": dev, "AUTOSPLIT_TEST_NODE": ns},
                                           start_new_session=True))
        while any(p.poll() is None for p in agents) and time.monotonic() - start < LIMIT_S:
            time.sleep(0.5)
        codes = [p.poll() for p in agents]
    finally:
        for p in agents:                # the agent and its workers: their own session, killed by group id
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    wall = time.monotonic() - start
    logs = "\n".join((tmp_path / f"node{k}.log").read_text()[-3000:] for k in range(2))
    assert codes == [0, 0], f"agents exited {codes} after {wall:.0f} s (limit {LIMIT_S} s):\n{logs}"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    print(f"two-node training: {wall:.1f} s wall")
    for r in results:
        for case in ("pp_dp", "tp_dp"):
            assert r[case]["loss_diff"] <= TOL and r[case]["param_diff"] <= TOL, (case, r)
            assert r[case]["sharded"] > 0, (case, r)
    by_rank = {r["rank"]: r for r in results}
    assert len({r["node"] for r in results}) == 2
    for r in results:   # (1,2,2): each tensor-parallel pair (ranks 2k, 2k+1) shares a node; dp crosses nodes
        pair = by_rank[r["rank"] ^ 1]
        assert r["node"] == pair["node"] and r["tp_dp"]["coord"][1] != pair["tp_dp"]["coord"][1], (r, pair)
        assert r["tp_dp"]["coord"][2] == r["rank"] // 2
