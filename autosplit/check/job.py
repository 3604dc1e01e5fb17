"""The world the check runs in: the job's own backend and device, and a host group to gather records on.

Terms: see autosplit/check/__init__.py (host group).
  backend -- the job's: NCCL with ``cuda:LOCAL_RANK`` where CUDA and NCCL are present, gloo on the CPU
             otherwise (the choice ``autosplit.parallelize`` makes, runtime/parallel/world.py); an
             already initialized default group is used as it is.
  alone   -- run without torchrun (no RANK / WORLD_SIZE): a world of one rank on a free local port, so
             ``python -m autosplit check`` works on a single machine as it does under torchrun.
"""
from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class CheckWorld:
    rank: int
    size: int
    backend: str
    device: torch.device
    host_group: object = field(repr=False)
    created_default: bool = False        # whether join_world created the default group (close destroys it)

    @property
    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"

    def describe(self) -> dict:
        """The world as the records state it."""
        return {"ranks": self.size, "backend": self.backend, "device": str(self.device),
                "device_name": self.device_name, "torch": torch.__version__}

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order, on every rank, over the host group."""
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.host_group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.host_group)

    def say(self, text: str) -> None:
        """Print on rank 0 (the one place a part's lines appear)."""
        if self.rank == 0:
            print(text, flush=True)

    def close(self) -> None:
        """Meet the other ranks, then destroy the host group, and the default group where join_world
        created it.  Why meet first: a rank that returns (and exits) while rank 0 still writes the
        records would have torchrun stop rank 0 mid-write when the check failed (exit status 1)."""
        if self.host_group is not None:
            self.barrier()
            dist.destroy_process_group(self.host_group)
            self.host_group = None
        if self.created_default and dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_backend() -> tuple[str, torch.device]:
    """(backend, device) of a new default group: NCCL on ``cuda:LOCAL_RANK`` where possible, else gloo."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return "nccl", torch.device("cuda", local)
    return "gloo", torch.device("cpu")


def join_world(timeout_s: float = 600.0) -> CheckWorld:
    """The job's world (created from torchrun's environment where no default group exists, or a world of
    one rank when run alone) and a gloo host group over it.

    Args:
        timeout_s: the limit of the host group's waits (gathering the records of a part).
    """
    created = False
    if dist.is_initialized():
        backend = dist.get_backend()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    else:
        if not all(k in os.environ for k in LAUNCH_ENV):          # alone: a world of one rank
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(_free_port()))
        backend, device = job_backend()
        extra = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **extra)
        created = True
    # Why a gloo group of our own: records are Python objects gathered on the host; on the NCCL default
    # group all_gather_object would stage them through the GPU, behind whatever its queue holds.
    host = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return CheckWorld(dist.get_rank(), dist.get_world_size(), backend, device, host, created)


def release_open_modules() -> None:
    """Release the ParallelModules a failed run left open, without meeting the other ranks (each rank
    gets here only once its own run ended; they may differ in what they left open)."""
    from autosplit.runtime.parallel_module import open_modules, release_orphans
    for pm in open_modules():
        with contextlib.suppress(Exception):
            pm.release()
    with contextlib.suppress(Exception):
        release_orphans()


def one_line(exc: BaseException, limit: int = 400) -> str:
    """``Type: message`` on one line, cut at ``limit`` characters."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text if len(text) <= limit else text[:limit] + ' ...'}"
