"""The job's store when autosplit starts the default process group itself: every rank joins it within
``timeout_s``, and the ranks that do not are named.

Terms:
  job's store -- the TCPStore at MASTER_ADDR:MASTER_PORT the default process group is built on: hosted
                 by rank 0's process, or by torchrun's agent where ``TORCHELASTIC_USE_AGENT_STORE`` says
                 so (torch's env:// rendezvous decides the same way), every other rank a client.  Its
                 keys live under the prefix ``default_pg/``, as torch's own rendezvous puts them.
  join        -- connect to the store (the host starts it, without waiting for the workers), then meet
                 every rank in the layout-argument agreement (arguments.py), all within ``timeout_s``
                 from the start: its message names the ranks that joined and those that did not.
  host        -- the rank hosting the store keeps it for the life of the process, also when joining
                 fails: the ranks that joined still read the outcome from it after this rank raised, and
                 a new attempt in this process (multi-tenant, as torch's) serves from the same server
                 instead of finding the port taken.
  probe       -- a client waits for the host with plain socket connections, every ``_PROBE_EVERY_S``,
                 until our deadline: a host that never comes is named as rank 0 (or torchrun's agent).

Why not torch's env:// rendezvous: its host waits inside the TCPStore constructor until every worker
has connected, for the process group's timeout (ours plus the NCCL margin, world.py), with a message
that counts the workers ("1/2 clients joined") without naming them; the group's creation then waits
for the missing rank's address for as long.  Why a probe and not TCPStore's own connect: its retries
overshoot their timeout by a back-off of seconds and log a stack trace per try.
"""
from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch.distributed as dist

from autosplit.errors import AutosplitError
from autosplit.runtime.faults.arguments import agree_on_arguments

_PROBE_EVERY_S = 0.05
_HOSTED: dict[str, object] = {}     # address -> the store this process hosts there (see *host*)


def join_job(rank: int, size: int, arguments: dict[str, str], timeout_s: float, store_timeout_s: float):
    """The job's store (prefixed ``default_pg/``), once every rank has joined it and passed the same
    ``arguments``; otherwise the same kind of AutosplitError on every rank that joined, within
    ``timeout_s``, naming the ranks that did not.

    Args:
      rank, size: this rank and the world size (RANK, WORLD_SIZE).
      arguments: the layout arguments every rank must agree on (arguments.py).
      timeout_s: the deadline of joining, from now.
      store_timeout_s: the store's own timeout afterwards (for the process group's blocking reads).
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    address = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    hosting = rank == 0 and not agent
    if not hosting:
        _probe(host, port, deadline, rank, timeout_s, agent)
    options = {} if agent else {"multi_tenant": True}
    store = dist.TCPStore(host, port, size, is_master=hosting, wait_for_workers=False,
                          timeout=timedelta(seconds=max(deadline - time.monotonic(), 1.0)),
                          use_libuv=os.environ.get("USE_LIBUV", "1") == "1", **options)
    if hosting:       # see *host*
        _HOSTED[address] = store
    store.set_timeout(timedelta(seconds=store_timeout_s))
    store = dist.PrefixStore("default_pg", store)
    try:
        agree_on_arguments(store, rank, size, arguments, timeout_s, wait_s=max(deadline - time.monotonic(), 0.0),
                           arrive=f"join the job's store at {address} (autosplit.parallelize starts the "
                                  f"process group)")
    except RuntimeError as exc:      # torch's store errors (DistNetworkError, ...); ours are ValueErrors
        host = "torchrun's agent" if agent else "rank 0's process"
        raise AutosplitError(f"rank {rank} lost the job's store at {address} while the ranks joined "
                             f"({type(exc).__name__}: {exc}): {host} hosts it and has exited, probably with "
                             f"its own error naming the ranks that did not join") from None
    return store


def _probe(host: str, port: int, deadline: float, rank: int, timeout_s: float, agent: bool) -> None:
    """Return once the store's host accepts a connection; raise an AutosplitError at ``deadline``."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(1.0, deadline - time.monotonic()))):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                who = ("torchrun's agent hosts it: is the agent alive, and does MASTER_ADDR lead to it from here?"
                       if agent else "rank 0's process hosts it, so rank 0 has not joined (not started, failed "
                       "before autosplit.parallelize, or MASTER_ADDR / MASTER_PORT do not lead to it)")
                raise AutosplitError(f"rank {rank} could not reach the job's store at {host}:{port} within "
                                     f"timeout_s={timeout_s:g} s ({type(exc).__name__}: {exc}): {who}") from None
        time.sleep(_PROBE_EVERY_S)
