"""Faults injected on one rank in the paths the watchdog once missed (issue 50, item 7); run on every
rank of a fresh pool (test_fault_paths.py).  Each returns {"error": "Type: message" or None,
"seconds": how long the faulty call took on this rank}."""
from __future__ import annotations

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
