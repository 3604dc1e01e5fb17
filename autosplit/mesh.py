"""The device mesh as plain data: sizes of the four axes and the rank layout.

Terms:
  axis   -- a mesh axis: ``pp`` (pipeline stages), ``cp`` (context-parallel ranks: the tokens of every op
            split over them, attention included), ``tp`` (tensor-parallel ranks), ``dp`` (data-parallel
            replicas). Never a tensor dimension; those are "dims".
  block  -- the cp x tp ranks that share one microbatch (every one of them is handed the same input): the
            tensor-parallel block of the plan and the runtime, whose group is named "tp" (the plan's
            axes inside it: autosplit/tp/axes.py; cp outermost).  With cp = 1 it is the tp group.
  block coordinate -- a rank's position in its block, 0 .. cp*tp - 1, cp outermost (``Coord.tp``):
            cp coordinate = position // tp, tp coordinate = position % tp.
  layout -- global rank = (pp_rank * dp + dp_rank) * block + position.  The block is innermost, so its
            ranks are consecutive (they share a node's fast links: tp innermost, then cp), then ``dp``,
            then ``pp`` outermost (Megatron's order).  The DeviceMesh built by the runtime uses the same
            order: shape ``(pp, dp, cp, tp)``, the cp axis only where cp > 1.

This module is pure: no process groups.  The runtime turns a MeshShape into a DeviceMesh.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from autosplit.errors import AutosplitError

AXES = ("pp", "tp", "dp")          # the order users write: mesh=(pp, tp, dp)
NAMED_AXES = ("pp", "cp", "tp", "dp")   # the axes a mapping or "pp=..,cp=..,tp=..,dp=.." may name
LAYOUT_ORDER = ("pp", "dp", "tp")  # outermost to innermost in the global rank (the block as "tp")


@dataclass(frozen=True)
class Coord:
    pp: int
    tp: int            # the block coordinate (see *block coordinate*): the tp coordinate when cp = 1
    dp: int


@dataclass(frozen=True)
class MeshShape:
    pp: int = 1
    tp: int = 1
    dp: int = 1
    cp: int = 1

    @classmethod
    def parse(cls, mesh, world_size: int | None = None) -> "MeshShape":
        """Accept ``(pp, tp, dp)``, a MeshShape, a mapping of axis names (missing axes are 1), ``"pp,tp,dp"``
        or ``"pp=1,cp=2,tp=2,dp=1"``; resolve ``dp=-1`` from world_size."""
        if isinstance(mesh, MeshShape):
            named = {"pp": mesh.pp, "cp": mesh.cp, "tp": mesh.tp, "dp": mesh.dp}
        elif isinstance(mesh, dict):
            named = dict(mesh)
        elif isinstance(mesh, str) and "=" in mesh:
            named = {}
            for part in mesh.split(","):
                m = re.fullmatch(r"\s*(\w+)\s*=\s*(-?\d+)\s*", part)
                if not m:
                    raise AutosplitError(f"mesh {mesh!r}: expected 'axis=size' pairs such as 'pp=1,cp=2,tp=2,dp=1', "
                                         f"got {part!r}")
                named[m.group(1)] = int(m.group(2))
        else:
            if isinstance(mesh, str):
                try:
                    sizes = tuple(int(s) for s in mesh.split(","))
                except ValueError:
                    raise AutosplitError(f"mesh {mesh!r}: expected three integers 'PP,TP,DP', e.g. '2,1,1', "
                                         f"or named sizes 'pp=1,cp=2,tp=2,dp=1'") from None
            else:
                sizes = tuple(mesh)
            if len(sizes) != 3:
                raise AutosplitError(f"mesh={mesh!r}: expected three integers (pp, tp, dp), e.g. mesh=(2, 1, 1), "
                                     f"or a mapping {{'pp': 1, 'cp': 2, 'tp': 2, 'dp': -1}} for a cp axis")
            named = dict(zip(AXES, sizes))
        unknown = sorted(set(named) - set(NAMED_AXES))
        if unknown:
            raise AutosplitError(f"mesh={mesh!r}: unknown axis {', '.join(map(repr, unknown))}; the axes are "
                                 f"{', '.join(NAMED_AXES)}")
        sizes = {axis: named.get(axis, 1) for axis in NAMED_AXES}
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes.values()):
            raise AutosplitError(f"mesh={mesh!r}: every axis size must be an integer, got "
                                 f"{', '.join(f'{a}={s!r}' for a, s in sizes.items())}")
        for name, size in sizes.items():
            if size == -1 and name == "dp" and world_size is not None:
                continue
            if size < 1:
                hint = " (dp=-1, 'whatever the world leaves', is accepted by parallelize only)" if name == "dp" else ""
                raise AutosplitError(f"mesh axis {name}={size} must be a positive integer{hint}")
        pp, cp, tp, dp = (sizes[a] for a in NAMED_AXES)
        inner = f"pp({pp}) * cp({cp}) * tp({tp})" if cp > 1 else f"pp({pp}) * tp({tp})"
        if dp == -1:
            if world_size % (pp * cp * tp):
                raise AutosplitError(
                    f"dp=-1: WORLD_SIZE({world_size}) is not divisible by {inner} = {pp * cp * tp}")
            dp = world_size // (pp * cp * tp)
        shape = cls(pp=pp, tp=tp, dp=dp, cp=cp)
        if world_size is not None and shape.size != world_size:
            raise AutosplitError(f"{inner} * dp({dp}) != WORLD_SIZE({world_size})")
        return shape

    @property
    def size(self) -> int:
        return self.pp * self.block * self.dp

    @property
    def block(self) -> int:
        """The ranks that share a microbatch: cp * tp (see *block*)."""
        return self.cp * self.tp

    def rank_of(self, pp: int, tp: int, dp: int) -> int:
        """The global rank at (pp, block coordinate ``tp``, dp)."""
        return (pp * self.dp + dp) * self.block + tp

    def coord_of(self, rank: int) -> Coord:
        if not 0 <= rank < self.size:
            raise AutosplitError(f"rank {rank} is outside the mesh of {self.size} ranks {self}")
        tp = rank % self.block
        dp = (rank // self.block) % self.dp
        pp = rank // (self.block * self.dp)
        return Coord(pp=pp, tp=tp, dp=dp)

    def cp_of(self, position: int) -> int:
        """The cp coordinate of block coordinate ``position``."""
        return position // self.tp

    def tp_of(self, position: int) -> int:
        """The tp coordinate of block coordinate ``position``."""
        return position % self.tp

    def __str__(self) -> str:
        if self.cp > 1:
            return f"(pp={self.pp}, cp={self.cp}, tp={self.tp}, dp={self.dp})"
        return f"(pp={self.pp}, tp={self.tp}, dp={self.dp})"


def node_layout_note(mesh: MeshShape, gpus_per_node: int | None) -> str | None:
    """Why the rank layout cannot keep each block (the tensor-parallel group; cp x tp ranks) inside one
    node, or None when it does.

    Args:
        mesh: the mesh; its blocks are runs of cp * tp consecutive ranks (see *layout*).
        gpus_per_node: ranks per node (torchrun's LOCAL_WORLD_SIZE, or the profile's); None: one node.
    """
    n = mesh.block
    name = f"cp*tp={mesh.cp}*{mesh.tp}={n}" if mesh.cp > 1 else f"tp={n}"
    if not gpus_per_node or n <= 1 or mesh.size <= gpus_per_node:
        return None
    if n > gpus_per_node:
        return (f"{name} > {gpus_per_node} GPUs per node: each tensor-parallel group spans "
                f"{-(-n // gpus_per_node)} nodes, and its collectives run over the network (priced so)")
    if gpus_per_node % n:
        return (f"{gpus_per_node} GPUs per node is not a multiple of {name}: some tensor-parallel groups "
                f"straddle two nodes (ranks k*{n} .. k*{n}+{n - 1}); pick {'cp*tp' if mesh.cp > 1 else 'tp'} "
                f"dividing {gpus_per_node}")
    return None
