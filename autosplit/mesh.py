"""The device mesh as plain data: sizes of the three axes and the rank layout.

Terms:
  axis   -- a mesh axis: ``pp`` (pipeline stages), ``tp`` (tensor-parallel ranks), ``dp`` (data-parallel
            replicas). Never a tensor dimension; those are "dims".
  layout -- global rank = (pp_rank * dp + dp_rank) * tp + tp_rank.  ``tp`` is the innermost axis, so
            the ranks of one tensor-parallel group are consecutive (they share a node's fast links), then
            ``dp``, then ``pp`` outermost (Megatron's order).  The DeviceMesh built by the runtime uses the
            same order: shape ``(pp, dp, tp)``, names ``("pp", "dp", "tp")``.

This module is pure: no process groups.  The runtime turns a MeshShape into a DeviceMesh.
"""
from __future__ import annotations

from dataclasses import dataclass

from autosplit.errors import AutosplitError

AXES = ("pp", "tp", "dp")          # the order users write: mesh=(pp, tp, dp)
LAYOUT_ORDER = ("pp", "dp", "tp")  # outermost to innermost in the global rank


@dataclass(frozen=True)
class Coord:
    pp: int
    tp: int
    dp: int


@dataclass(frozen=True)
class MeshShape:
    pp: int = 1
    tp: int = 1
    dp: int = 1

    @classmethod
    def parse(cls, mesh, world_size: int | None = None) -> "MeshShape":
        """Accept ``(pp, tp, dp)``, a MeshShape, or ``"pp,tp,dp"``; resolve ``dp=-1`` from world_size."""
        if isinstance(mesh, MeshShape):
            sizes = (mesh.pp, mesh.tp, mesh.dp)
        elif isinstance(mesh, str):
            try:
                sizes = tuple(int(s) for s in mesh.split(","))
            except ValueError:
                raise AutosplitError(f"mesh {mesh!r}: expected three integers 'PP,TP,DP', e.g. '2,1,1'") from None
        else:
            sizes = tuple(mesh)
        if len(sizes) != 3 or not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
            raise AutosplitError(f"mesh={mesh!r}: expected three integers (pp, tp, dp), e.g. mesh=(2, 1, 1)")
        pp, tp, dp = sizes
        for name, size in zip(AXES, sizes):
            if size == -1 and name == "dp" and world_size is not None:
                continue
            if size < 1:
                hint = " (dp=-1, 'whatever the world leaves', is accepted by parallelize only)" if name == "dp" else ""
                raise AutosplitError(f"mesh axis {name}={size} must be a positive integer{hint}")
        if dp == -1:
            if world_size % (pp * tp):
                raise AutosplitError(
                    f"dp=-1: WORLD_SIZE({world_size}) is not divisible by pp({pp}) * tp({tp}) = {pp * tp}")
            dp = world_size // (pp * tp)
        shape = cls(pp, tp, dp)
        if world_size is not None and shape.size != world_size:
            raise AutosplitError(f"pp({pp}) * tp({tp}) * dp({dp}) != WORLD_SIZE({world_size})")
        return shape

    @property
    def size(self) -> int:
        return self.pp * self.tp * self.dp

    def rank_of(self, pp: int, tp: int, dp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def coord_of(self, rank: int) -> Coord:
        if not 0 <= rank < self.size:
            raise AutosplitError(f"rank {rank} is outside the mesh of {self.size} ranks {self}")
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return Coord(pp=pp, tp=tp, dp=dp)

    def __str__(self) -> str:
        return f"(pp={self.pp}, tp={self.tp}, dp={self.dp})"


def node_layout_note(mesh: MeshShape, gpus_per_node: int | None) -> str | None:
    """Why the rank layout cannot keep each tensor-parallel group inside one node, or None when it does.

    Args:
        mesh: the mesh; its tp groups are blocks of tp consecutive ranks (see *layout*).
        gpus_per_node: ranks per node (torchrun's LOCAL_WORLD_SIZE, or the profile's); None: one node.
    """
    if not gpus_per_node or mesh.tp <= 1 or mesh.size <= gpus_per_node:
        return None
    if mesh.tp > gpus_per_node:
        return (f"tp={mesh.tp} > {gpus_per_node} GPUs per node: each tensor-parallel group spans "
                f"{-(-mesh.tp // gpus_per_node)} nodes, and its collectives run over the network (priced so)")
    if gpus_per_node % mesh.tp:
        return (f"{gpus_per_node} GPUs per node is not a multiple of tp={mesh.tp}: some tensor-parallel groups "
                f"straddle two nodes (ranks k*{mesh.tp} .. k*{mesh.tp}+{mesh.tp - 1}); pick tp dividing {gpus_per_node}")
    return None

