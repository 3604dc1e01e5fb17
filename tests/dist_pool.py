"""A pool of spawned processes (a gloo or NCCL world) that stays up across checks (spawning torch costs seconds).

``pool.run(fn, *args, **kwargs)`` runs ``fn(*args, **kwargs)`` on every rank (fn must be importable: a module-level
function) and returns the per-rank results; an exception on any rank is re-raised in the test with
that rank's traceback.  A pool whose ranks may be left waiting on each other (fault tests) should be
closed after use; ``run`` kills the pool when its timeout expires.

Point-to-point runs with the strict transport (``AUTOSPLIT_STRICT_P2P=1``: NCCL's ordering on gloo)
unless the environment running the tests sets ``AUTOSPLIT_STRICT_P2P=0``, so every pipeline test
would hang, and time out, on an order that would hang on NCCL.

The backend comes from the environment: ``AUTOSPLIT_TEST_BACKEND=gloo`` (the default: CPU ranks) or
``nccl`` (rank r on ``cuda:r``, its LOCAL_RANK; ``torch.cuda.set_device`` before the group is made, so
``autosplit.parallelize`` finds NCCL and that GPU as it does under torchrun).  ``device()`` is the
rank's device, for a check that creates tensors where the rank computes; ``gpus_missing(size)`` says
why a world of ``size`` ranks cannot run here (tests/conftest.py skips those tests with it).
"""
from __future__ import annotations

import importlib
import os
import queue
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STRICT = os.environ.get("AUTOSPLIT_STRICT_P2P", "1")
BACKEND = os.environ.get("AUTOSPLIT_TEST_BACKEND", "gloo").lower()
if BACKEND not in ("gloo", "nccl"):
    raise ValueError(f"AUTOSPLIT_TEST_BACKEND={BACKEND!r}: expected gloo (CPU ranks) or nccl (one GPU per rank)")


def gpus_missing(size: int) -> str | None:
    """Why a world of ``size`` ranks cannot run on this backend here (the GPUs it needs), or None."""
    if BACKEND != "nccl":
        return None
    import torch
    present = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if present >= size:
        return None
    return f"AUTOSPLIT_TEST_BACKEND=nccl: needs {size} GPUs (one per rank), {present} present"


def device():
    """This rank's device: ``cuda:LOCAL_RANK`` under NCCL, the CPU under gloo."""
    import torch
    return torch.device("cuda", torch.cuda.current_device()) if BACKEND == "nccl" else torch.device("cpu")


def _worker(rank: int, size: int, port: int, tasks, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", AUTOSPLIT_TIMEOUT="60",
                      AUTOSPLIT_STRICT_P2P=STRICT)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    from datetime import timedelta
    extra = {}
    if BACKEND == "nccl":     # the GPU first: the group binds to it (device_id), as autosplit's own does
        torch.cuda.set_device(rank)
        extra["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(BACKEND, rank=rank, world_size=size, timeout=timedelta(seconds=60), **extra)
    while True:
        task = tasks.get()
        if task is None:
            break
        module, name, args, kwargs = task
        _release_modules()
        try:
            value = getattr(importlib.import_module(module), name)(*args, **kwargs)
            results.put((rank, True, value))
        except BaseException as exc:  # report everything, including RankFailure
            results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    _release_modules()
    dist.destroy_process_group()
    # Why exit at once: every result went out (the queue's feeder is joined), and the interpreter's own
    # teardown of torch took 3-5 s per worker, paid by every pool at the end of the session.
    results.close()
    results.join_thread()
    os._exit(0)


def _release_modules() -> None:
    """Release the ParallelModules the previous check left open or dropped without closing, so that a
    worker running hundreds of checks does not keep every one's process groups (each a set of gloo
    connections and threads that wake even when idle: dozens of them ate a fifth of a core per idle
    worker).  Without meeting the other ranks (``release``, not ``close``): a new task is sent only once
    every rank has returned from the previous one, and the ranks may differ in what they left open (a
    check whose ``parallelize`` failed on one rank only)."""
    from autosplit.runtime.parallel_module import open_modules, release_orphans
    for pm in open_modules():
        try:
            pm.release()
        except Exception:       # the next check still runs; its own groups are fresh
            traceback.print_exc()
    try:
        release_orphans()
    except Exception:
        traceback.print_exc()


class RankError(AssertionError):
    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        super().__init__("\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items())))


class Pool:
    def __init__(self, size: int):
        ctx = mp.get_context("spawn")
        self.size = size
        self.tasks = [ctx.Queue() for _ in range(size)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, size, port, self.tasks[r], self.results), daemon=True)
                      for r in range(size)]
        for p in self.procs:
            p.start()

    def run_raw(self, fn, *args, timeout: float = 180, expect: int | None = None,
                **kwargs) -> dict[int, tuple[bool, object]]:
        """Per rank (ok, value); ``expect`` ranks (default all) must report within ``timeout`` s."""
        for q in self.tasks:
            q.put((fn.__module__, fn.__name__, args, kwargs))
        out = {}
        try:
            while len(out) < (self.size if expect is None else expect):
                rank, ok, value = self.results.get(timeout=timeout)
                out[rank] = (ok, value)
        except queue.Empty:
            self.close(force=True)
            raise TimeoutError(f"ranks {sorted(set(range(self.size)) - set(out))} did not finish "
                               f"{fn.__name__} within {timeout} s") from None
        return out

    def run(self, fn, *args, timeout: float = 180, **kwargs) -> list:
        out = self.run_raw(fn, *args, timeout=timeout, **kwargs)
        errors = {r: v for r, (ok, v) in out.items() if not ok}
        if errors:
            raise RankError(errors)
        return [out[r][1] for r in range(self.size)]

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
