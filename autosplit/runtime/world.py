"""The distributed world a ParallelModule runs in: process group, device, mesh axes and groups.

Terms:
  world    -- all processes of the job (torchrun's RANK / WORLD_SIZE / LOCAL_RANK, or an already
              initialized default process group).
  backend  -- NCCL with ``cuda:LOCAL_RANK`` when GPUs are present, gloo on CPU otherwise; chosen here.
  groups   -- one process group per mesh axis ("pp", "tp", "dp"), from torch's DeviceMesh of shape
              (pp, dp, tp): tp innermost, so tensor-parallel ranks are consecutive (see mesh.py).
              With tp_mode="2d" also "tp_row" and "tp_col", from a DeviceMesh (pp, dp, q, q): tp rank
              t is grid row t // q and column t % q.
  timeout  -- every wait in the runtime gives up after this many seconds with an error naming the rank
              and what it waited for (faults.Watchdog).  The process groups get the same timeout
              plus ``NCCL_GRACE_S``: NCCL's own watchdog (async error handling, on by default here as
              under torchrun) then tears down a rank whose kernels are still stuck after ours has
              reported, instead of leaving it hanging on the GPU.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autosplit.errors import AutosplitError
from autosplit.mesh import LAYOUT_ORDER, Coord, MeshShape

DEFAULT_TIMEOUT_S = float(os.environ.get("AUTOSPLIT_TIMEOUT", "120"))
NCCL_GRACE_S = 5.0


@dataclass
class World:
    rank: int
    size: int
    device: torch.device
    backend: str
    mesh: MeshShape
    coord: Coord
    device_mesh: DeviceMesh = field(repr=False)
    timeout_s: float = DEFAULT_TIMEOUT_S
    control_group: object = field(default=None, repr=False)   # gloo over WORLD when the backend is NCCL
    grid_mesh: DeviceMesh | None = field(default=None, repr=False)   # 2D: (pp, dp, tp_row, tp_col)

    def group(self, axis: str):
        if self.device_mesh is None:
            raise AutosplitError(f"the process groups of rank {self.rank} were closed (ParallelModule.close)")
        if axis in ("tp_row", "tp_col"):
            return self.grid_mesh.get_group(axis)
        return self.device_mesh.get_group(axis)

    def rank_at(self, *, pp: int | None = None, tp: int | None = None, dp: int | None = None) -> int:
        """The global rank that differs from this one only on the named axes."""
        c = self.coord
        return self.mesh.rank_of(pp=c.pp if pp is None else pp, tp=c.tp if tp is None else tp,
                                 dp=c.dp if dp is None else dp)

    @property
    def store(self):
        return dist.distributed_c10d._get_default_store()

    def barrier(self, watchdog, doing: str) -> None:
        """Every rank of the world meets here, bounded by ``watchdog``; under NCCL on the host-side
        control group, so no GPU queue is waited on."""
        group = self.control_group
        watchdog.wait(dist.barrier(group=group, async_op=True), doing, host=True, on_host=group is not None)

    def close(self) -> None:
        """Destroy the process groups this World created (never the default group, which the job may
        still use), in the same order on every rank.  Call after a ``barrier``: a group destroyed while
        a peer still has an operation on it would fail that operation."""
        groups = [self.device_mesh.get_group(axis) for axis in LAYOUT_ORDER]
        if self.grid_mesh is not None:
            groups += [self.grid_mesh.get_group(axis) for axis in self.grid_mesh.mesh_dim_names]
        groups.append(self.control_group)
        default, seen = dist.group.WORLD, set()
        for group in groups:
            if group is None or group is default or id(group) in seen:
                continue
            seen.add(id(group))
            dist.destroy_process_group(group)
        # A gloo group's connections and threads end when its last reference goes, not at destroy
        self.device_mesh = self.grid_mesh = self.control_group = None
        forget_meshes()


def forget_meshes() -> None:
    """Empty torch's DTensor caches of meshes.  Why: they key on DeviceMesh *equality* (layout, dim
    names, device type: not the groups) and keep the meshes they saw, so the next World with the same
    layout would be handed this one's destroyed groups from them (FSDP2's full_tensor: "Could not
    resolve the process group registered under the name 11").  These caches are private to torch: each
    is looked up and skipped where a torch version lacks it."""
    from torch.distributed.tensor import DTensor, _redistribute
    for clear in (getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),    # the C++ dispatch's
                  getattr(_redistribute, "clear_redistribute_planner_cache", None),
                  getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
                  getattr(getattr(getattr(DTensor._op_dispatcher, "sharding_propagator", None),
                                  "propagate_op_sharding", None), "cache_clear", None)):
        if clear is not None:
            clear()


def _choose_backend() -> tuple[str, torch.device]:
    if torch.cuda.is_available() and dist.is_nccl_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return "nccl", torch.device("cuda", local)
    return "gloo", torch.device("cpu")


def init_world(mesh, timeout_s: float = DEFAULT_TIMEOUT_S, tp_mode: str = "1d") -> World:
    """Join (or create) the default process group and build the mesh's axis groups.

    Raises the same clear error on every rank, without communicating, when the mesh does not match
    the world size: "pp(2) * tp(1) * dp(2) != WORLD_SIZE(3)".
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise AutosplitError(f"timeout_s={timeout_s!r} must be a positive, finite number of seconds (every "
                             f"distributed wait gives up after it)")
    if dist.is_initialized():
        backend = dist.get_backend()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        size = dist.get_world_size()
    else:
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise AutosplitError(
                f"autosplit.parallelize needs a distributed launch, but {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set: run under torchrun "
                f"(torchrun --nproc-per-node N train.py) or call torch.distributed.init_process_group first")
        size = int(os.environ["WORLD_SIZE"])
        shape = MeshShape.parse(mesh, world_size=size)   # fail before any rendezvous wait
        backend, device = _choose_backend()
        options = {}
        if backend == "nccl":
            # NCCL's watchdog aborts stuck communicators (torchrun sets this too); device_id binds the
            # default group to this GPU, so its communicators are created eagerly, on every rank at once.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
            options["device_id"] = device
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s + NCCL_GRACE_S), **options)
    shape = MeshShape.parse(mesh, world_size=size)
    dims = tuple(getattr(shape, axis) for axis in LAYOUT_ORDER)
    device_mesh = init_device_mesh(device.type, dims, mesh_dim_names=LAYOUT_ORDER)
    # The agreement checks exchange a few integers on the host at the start of every call; on NCCL a
    # CPU (gloo) group does it, so reading them never waits for the GPU's queue (no device sync).
    control = dist.new_group(backend="gloo") if backend == "nccl" else None
    grid = None
    q = math.isqrt(shape.tp)
    if tp_mode == "2d" and q * q == shape.tp and q > 1:
        # tp rank = row * q + col (row-major inside the consecutive tp ranks); every rank builds the same
        # groups in the same order, as DeviceMesh requires.
        layout = torch.arange(size).reshape(shape.pp, shape.dp, q, q)
        grid = DeviceMesh(device.type, layout, mesh_dim_names=("pp", "dp", "tp_row", "tp_col"))
    rank = dist.get_rank()
    return World(grid_mesh=grid, rank=rank, size=size, device=device, backend=backend, mesh=shape,
                 coord=shape.coord_of(rank), device_mesh=device_mesh, timeout_s=timeout_s,
                 control_group=control)
