"""The distributed world a ParallelModule runs in: process group, device, mesh axes and groups.

Terms:
  world    -- all processes of the job (torchrun's RANK / WORLD_SIZE / LOCAL_RANK, or an already
              initialized default process group).  Where no default group exists, every rank joins the
              job's store first, within ``timeout_s`` (faults/job_store.py), and the group is built on it.
  backend  -- NCCL with ``cuda:LOCAL_RANK`` when GPUs are present, gloo on CPU otherwise; chosen here.
  groups   -- one process group per mesh axis ("pp", "tp", "dp"), from torch's DeviceMesh of shape
              (pp, dp, tp): tp innermost, so tensor-parallel ranks are consecutive (see mesh.py).
              With a grid tp_mode ("2d", "2.5d", "3d") also the tp sub-mesh's axes (autosplit/tp/axes.py:
              "tp_row" and "tp_col"; "tp_dep" too; or "tp_x", "tp_y", "tp_z"), from a DeviceMesh
              (pp, dp, *their sizes): tp rank t is read in mixed radix over them (2D: row t // q, col t % q).
  own groups -- the groups this World created (every mesh axis gets its own, even one spanning the
              whole world, which DeviceMesh would otherwise run on the default group), the only ones
              it destroys (``close``) and a failure aborts (faults/deadlines.py): never the default group.
  timeout  -- every wait in the runtime gives up after this many seconds with an error naming the rank
              and what it waited for (faults/deadlines.py Watchdog).  NCCL's own timeout (``nccl_timeout_s``: of
              the default group when we create it, and of every own group) is longer by the
              heartbeats' diagnosis time plus ``NCCL_MARGIN_S``, so our message is out before NCCL's
              watchdog acts.  Its async error handling is left as torch (3) or torchrun (1) set it:
              with it on, that watchdog tears down a rank whose kernels are still stuck after ours
              has reported; with it off (``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``, what torch's abort
              API asks for), our failure path aborts the own groups itself.
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
from autosplit.runtime.faults.arguments import agree_on_arguments
from autosplit.runtime.faults.heartbeat import watch_s
from autosplit.runtime.faults.job_store import join_job
from autosplit.tp.axes import block_axes

DEFAULT_TIMEOUT_S = float(os.environ.get("AUTOSPLIT_TIMEOUT", "120"))
# Beyond our deadline and the diagnosis: the store round trips that publish the failure, the polling
# period, and a collective waited on some time after its launch (NCCL's clock starts at the launch).
NCCL_MARGIN_S = 30.0


def nccl_timeout_s(timeout_s: float, world_size: int) -> float:
    """NCCL's own timeout for our groups: our deadline + the heartbeats' diagnosis + NCCL_MARGIN_S."""
    return timeout_s + watch_s(world_size) + NCCL_MARGIN_S


def set_nccl_timeout(group, timeout_s: float, world_size: int) -> None:
    """Give ``group``'s NCCL watchdog ``nccl_timeout_s``.  Why two ways: ``dist.set_timeout`` is recent
    (torch 2.11 has none, and pyproject allows torch >= 2.4); before it, the NCCL backend object took
    the same setting as ``_set_default_timeout``.  Where neither exists the watchdog would keep its
    creation-time timeout (10 minutes) and might end the process before our diagnosis: refused."""
    timeout = timedelta(seconds=nccl_timeout_s(timeout_s, world_size))
    if hasattr(dist, "set_timeout"):
        dist.set_timeout(timeout, group)
        return
    backend = group._get_backend(torch.device("cuda"))
    if not hasattr(backend, "_set_default_timeout"):
        raise AutosplitError(f"torch {torch.__version__} cannot set NCCL's watchdog timeout on a process group "
                             f"(neither torch.distributed.set_timeout nor ProcessGroupNCCL._set_default_timeout); "
                             f"autosplit needs one of them on NCCL: upgrade torch")
    backend._set_default_timeout(timeout)


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
    grid_mesh: DeviceMesh | None = field(default=None, repr=False)   # grid modes: (pp, dp, *tp axes)
    grad_mesh: DeviceMesh | None = field(default=None, repr=False)   # cp: the dp x cp mesh (add_grad_group)
    created: list = field(default_factory=list, repr=False)          # own groups, in creation order
    axis_groups: dict = field(default_factory=dict, repr=False)      # axis -> its group, as built

    def group(self, axis: str):
        if self.device_mesh is None:
            raise AutosplitError(f"the process groups of rank {self.rank} were closed (ParallelModule.close)")
        # the group objects as built (init_world): DeviceMesh.get_group resolves a name torch no longer
        # knows once a failure has aborted the group (faults/deadlines.py), and the release after it still asks
        if axis not in self.axis_groups:
            raise AutosplitError(f"rank {self.rank} has no '{axis}' group (axes: {sorted(self.axis_groups)})")
        return self.axis_groups[axis]

    def add_tp_axes(self, axes) -> None:
        """The groups of a grid mode's tp axes (autosplit/tp/axes.py), unless built already: at the start
        for a fixed tp_mode, after planning for tp_mode="auto".  Every rank plans the same, so every rank
        builds the same groups in the same order, as DeviceMesh requires; tp rank = mixed radix over the
        axes (outermost first), inside the consecutive tp ranks."""
        axes = tuple(axes)
        if all(a in self.axis_groups and dist.get_world_size(self.axis_groups[a]) == n
                                for a, n in axes):
            return
        names, sizes = zip(*axes)
        layout = torch.arange(self.size).reshape(self.mesh.pp, self.mesh.dp, *sizes)
        grid = DeviceMesh(self.device.type, layout, mesh_dim_names=("pp", "dp", *names))
        for axis in grid.mesh_dim_names:
            group = grid.get_group(axis)
            if group is not dist.group.WORLD and all(group is not g for g in self.created):
                self.created.append(group)
                if self.backend == "nccl":     # NCCL's watchdog after ours (init_world)
                    set_nccl_timeout(group, self.timeout_s, self.size)
        self.axis_groups.update({axis: grid.get_group(axis) for axis in names})
        self.grid_mesh = grid

    def add_grad_group(self) -> None:
        """With a cp axis, the group the gradients are summed over: the ranks of one pp and tp coordinate,
        every dp replica and cp rank (passes/sharding/lower.py *replicated axis*), as the 1-D mesh
        ``grad_mesh`` FSDP2 shards over.  The dims (pp, dp, cp, tp) of the layout, dp and cp merged:
        consecutive in it, so the merge is a reshape.  Every rank builds every group, in the same order.
        Why groups of our own and not a DeviceMesh of the layout: where dp x cp is the whole world,
        DeviceMesh would run it on the default group, which the job's other threads also use (see
        ``init_world``); one gloo group used by two threads at once mixes their messages."""
        m = self.mesh
        layout = torch.arange(self.size).reshape(m.pp, m.dp * m.cp, m.tp)
        blocks = [layout[a, :, t].tolist() for a in range(m.pp) for t in range(m.tp)]
        group, _ = dist.new_subgroups_by_enumeration(blocks, backend=dist.get_backend())
        mine = next(ranks for ranks in blocks if self.rank in ranks)
        self.created.append(group)
        if self.backend == "nccl":
            set_nccl_timeout(group, self.timeout_s, self.size)
        self.axis_groups["dp_cp"] = group
        self.grad_mesh = DeviceMesh.from_group(group, self.device.type, mesh=mine, mesh_dim_names=("dp_cp",))

    @property
    def grad_axis(self) -> str:
        """The axis gradients are averaged over: "dp", or "dp_cp" with a cp axis (``add_grad_group``)."""
        return "dp_cp" if self.mesh.cp > 1 else "dp"

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

    def own_groups(self) -> list:
        """The groups this World created and that still exist (a failure may have aborted them), in
        creation order: the same on every rank."""
        return [g for g in self.created if _registered(g)]

    def close(self) -> None:
        """Destroy the process groups this World created (never the default group, which the job may
        still use), in the same order on every rank.  Call after a ``barrier``: a group destroyed while
        a peer still has an operation on it would fail that operation."""
        for group in self.own_groups():
            dist.destroy_process_group(group)
        # A gloo group's connections and threads end when its last reference goes, not at destroy
        self.device_mesh = self.grid_mesh = self.grad_mesh = self.control_group = None
        self.created, self.axis_groups = [], {}
        forget_meshes()


def _registered(group) -> bool:
    """Whether torch still knows ``group`` (destroy and abort both unregister it).  torch's table of
    groups is private; where a torch version lacks it, every group counts as registered."""
    table = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    return table is None or group in table


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


def _layout_arguments(shape: MeshShape, tp_mode: str, tp_depth: int | None) -> dict[str, str]:
    """What decides the groups a rank builds (faults/arguments.py *layout arguments*), as text."""
    return {"mesh": str(shape), "tp_mode": repr(tp_mode), "tp_depth": repr(tp_depth)}


def init_world(mesh, timeout_s: float = DEFAULT_TIMEOUT_S, tp_mode: str = "1d", tp_depth: int | None = None) -> World:
    """Join (or create) the default process group and build the mesh's axis groups.

    Raises the same clear error on every rank, without communicating, when the mesh does not match
    the world size: "pp(2) * tp(1) * dp(2) != WORLD_SIZE(3)".
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise AutosplitError(f"timeout_s={timeout_s!r} must be a positive, finite number of seconds (every "
                             f"distributed wait gives up after it)")
    joined_here = not dist.is_initialized()     # the layout agreement is then part of joining
    if not joined_here:
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
            # device_id binds the default group to this GPU, so its communicators are created eagerly,
            # on every rank at once.  TORCH_NCCL_ASYNC_ERROR_HANDLING is the user's (see the docstring).
            options["device_id"] = device
        group_timeout_s = nccl_timeout_s(timeout_s, size)
        # Our own rendezvous, before the default group (faults/job_store.py): every rank joins the store
        # and agrees on the layout arguments within timeout_s, or the ranks that joined name those that
        # did not; torch's would wait group_timeout_s and count the missing ranks without naming them.
        rank = int(os.environ["RANK"])
        store = join_job(rank, size, _layout_arguments(shape, tp_mode, tp_depth), timeout_s, group_timeout_s)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=timedelta(seconds=group_timeout_s), **options)
    shape = MeshShape.parse(mesh, world_size=size)
    if not joined_here:
        # Before the first group: ranks whose layout arguments differ would create different groups (or a
        # different number of them) and wait on each other forever inside torch; the exchange goes through
        # the store, bounded by timeout_s, and raises the same error on every rank (faults/arguments.py).
        agree_on_arguments(dist.distributed_c10d._get_default_store(), dist.get_rank(), size,
                           _layout_arguments(shape, tp_mode, tp_depth), timeout_s)
    dims = (shape.pp, shape.dp, shape.block)        # LAYOUT_ORDER; "tp" is the cp x tp block (mesh.py)
    # Every axis on a group of its own (the default group's backend named for each): DeviceMesh would
    # run an axis spanning the whole world on the default group, which is the user's, which we
    # neither abort nor time as ours.
    own = dist.get_backend()
    override = {axis: own for axis in LAYOUT_ORDER} if own in ("nccl", "gloo") else None
    device_mesh = init_device_mesh(device.type, dims, mesh_dim_names=LAYOUT_ORDER, backend_override=override)
    # The agreement checks exchange a few integers on the host at the start of every call; on NCCL a
    # CPU (gloo) group does it, so reading them never waits for the GPU's queue (no device sync).
    control = dist.new_group(backend="gloo") if backend == "nccl" else None
    axis_groups = {axis: device_mesh.get_group(axis) for axis in LAYOUT_ORDER}
    created, default = [], dist.group.WORLD
    for group in [*(axis_groups[a] for a in LAYOUT_ORDER), control]:
        if group is not None and group is not default and all(group is not g for g in created):
            created.append(group)
    if backend == "nccl":
        # NCCL's watchdog times a work from its launch and, with async error handling on, ends the
        # process: it must act only after our deadline has fired and the diagnosis is published.
        for group in created:
            set_nccl_timeout(group, timeout_s, size)
    rank = dist.get_rank()
    world = World(rank=rank, size=size, device=device, backend=backend, mesh=shape,
                  coord=shape.coord_of(rank), device_mesh=device_mesh, timeout_s=timeout_s,
                  control_group=control, created=created, axis_groups=axis_groups)
    if tp_mode != "auto":             # "auto" knows its layout once planned (ParallelModule adds it then)
        world.add_tp_axes(block_axes(tp_mode, shape, tp_depth))
    if shape.cp > 1:
        world.add_grad_group()
    return world
