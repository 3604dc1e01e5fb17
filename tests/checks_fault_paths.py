"""Faults injected on one rank in the paths the watchdog once missed (issue 50, item 7); run on every
rank of a fresh pool (test_fault_paths.py).  Each returns {"error": "Type: message" or None,
"seconds": how long the faulty call took on this rank}."""
from __future__ import annotations

import dataclasses
import threading
import time

import torch
import torch.distributed as dist

from tests.dist_checks import _small, error_of


def _timed(fn, *args, **kwargs) -> dict:
    start = time.monotonic()
    err = error_of(lambda: fn(*args, **kwargs))
    return {"error": err, "seconds": time.monotonic() - start}


def meshes_differ(timeout_s: float) -> dict:
    """Rank 0 asks for (2, 1, 1), rank 1 for (1, 1, 2): no group may be built, and both ranks say why."""
    mesh = (2, 1, 1) if dist.get_rank() == 0 else (1, 1, 2)
    dist.barrier()            # start together: the test measures the check, not the ranks' skew
    return _timed(_small, mesh, 2, example_input=None, timeout_s=timeout_s, device="h100")


def one_rank_skips_parallelize(timeout_s: float) -> dict:
    """Rank 1 never calls parallelize (it has already failed on its own): rank 0 names it within timeout_s."""
    dist.barrier()
    if dist.get_rank() == 1:
        return {"error": None, "seconds": 0.0}
    return _timed(_small, (2, 1, 1), 2, timeout_s=timeout_s, device="h100")


def loss_all_reduce_raises(timeout_s: float) -> dict:
    """Rank 1's step-end loss all-reduce raises (as a collective does when its connection breaks at the
    call): rank 0, waiting in the same reduction, must learn it at once and name rank 1 and the action."""
    pm = _small((2, 1, 1), 2, example_input=torch.randn(1, 3, 32, 32), timeout_s=timeout_s, device="h100")
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    pm.step(x, y)                    # the first step's agreement and warm-up are not what is tested
    if dist.get_rank() == 1:
        real = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            if tensor.dtype == torch.float64 and tensor.numel() == 2:     # the loss and overflow flag
                raise RuntimeError("injected: connection reset by peer")
            return real(tensor, *args, **kwargs)
        dist.all_reduce = all_reduce          # this pool is thrown away after the test
    dist.barrier()
    return _timed(pm.step, x, y)


def stage_output_shape_changes(timeout_s: float) -> dict:
    """Rank 0's stage 0 returns one token fewer than planned (what shape-dependent Python does): rank 0
    must refuse to send it, naming the stage, the action and both shapes; rank 1 stops with that."""
    pm = _small((2, 1, 1), 2, example_input=torch.randn(1, 3, 32, 32), timeout_s=timeout_s, device="h100")
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    pm.step(x, y)
    if dist.get_rank() == 0:
        stage = pm.executor.modules[0]
        pm.executor.modules[0] = lambda *inputs: [o[:, :-1] for o in stage(*inputs)]
    dist.barrier()
    return _timed(pm.step, x, y)


def abandoned_call_then_good_one(timeout_s: float) -> dict:
    """Rank 1's parallelize raises before the layout agreement (its mesh does not fit 2 ranks), so rank 0's
    call is abandoned at its deadline; then both call again with the same arguments, which must work."""
    rank = dist.get_rank()
    dist.barrier()
    first = _timed(_small, (2, 1, 2) if rank == 1 else (2, 1, 1), 2, timeout_s=timeout_s, device="h100")
    dist.barrier()            # both first calls are over
    second = _timed(_small, (2, 1, 1), 2, timeout_s=20.0, device="h100")
    return {"first": first, "second": second}


def checksums_never_finish(timeout_s: float) -> dict:
    """Rank 1's parameter checksums before the first step never finish (on a GPU: a ``.cpu()`` behind a
    stuck device queue): rank 1 must stop at its deadline, and rank 0, waiting for its row, name it."""
    pm = _small((2, 1, 1), 2, example_input=torch.randn(1, 3, 32, 32), device="h100")
    pm.watchdog.timeout_s = timeout_s     # for the step: the ranks' skew in building is not what is tested
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    if dist.get_rank() == 1:
        from autosplit.runtime.faults import agreement
        never = threading.Event()
        agreement.model_checksums = lambda *args: never.wait()     # this pool is thrown away after the test
    dist.barrier()
    return _timed(pm.step, x, y)


def pp_group_start_fails(timeout_s: float) -> dict:
    """The executor's first collective on the pp group under NCCL, modelled on gloo: NCCL creates the
    communicator inside that call, which returns only once every rank of the group has joined.  Rank 1's
    creation fails at the call; rank 0's never returns (rank 1 never joins it): rank 0 must stop at once,
    naming rank 1 and the action, not block in the call for good."""
    from autosplit.runtime.pipeline.executor import PipelineExecutor
    pm = _small((2, 1, 1), 2, example_input=torch.randn(1, 3, 32, 32), timeout_s=timeout_s, device="h100")
    world = dataclasses.replace(pm.world, backend="nccl")
    never = threading.Event()

    def all_reduce(tensor, *args, **kwargs):
        if dist.get_rank() == 1:
            raise RuntimeError("injected: NCCL error: unhandled system error (creating the communicator)")
        never.wait()                 # this pool is thrown away after the test
    dist.barrier()
    dist.all_reduce = all_reduce
    return _timed(PipelineExecutor, world, pm.plan, pm.planner.modules, pm.loss_fn, pm.watchdog)
