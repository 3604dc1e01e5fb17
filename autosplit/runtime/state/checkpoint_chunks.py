"""One rank's tensors as DCP entries: its chunks of the full tensors, under the original names.

Terms:
  chunk      -- a contiguous block of a full tensor with its global offsets.  A tensor-parallel shard
                is one chunk per box of its ShardedParam (autosplit/tp/shards.py): the fused qkv by
                heads is three chunks per rank, a 2D layout a grid of them.  Under ``dp_shard`` (FSDP2)
                a rank holds a block of its tp shard (a DTensor over dp); its indices are the tp
                slice's indices at the block's offsets, so the same boxes describe it.  Replicated
                tensors (tp and dp) are one full chunk, written once (DCP de-duplicates equal chunks).
  entry      -- the local tensor DCP reads or writes for one key: a view of this rank's storage (a
                load writes into it) tagged with its chunks.

Why DCP's *CheckpointableTensor* protocol (a plain local tensor carrying ``global_shape``,
``global_offsets``, ``local_offsets``, ``local_sizes``) and not DTensor or ShardedTensor: a DTensor
placement cannot say "rows {0..7, 32..39, 64..71}" (qkv by heads) nor the index lists of a 2D layout,
and a ShardedTensor needs non-overlapping shards over one process group (dp replicas hold equal shards)
and is deprecated.  The protocol takes several boxes of one local tensor as they are, and DCP's own
resharding (``create_read_items_for_chunk_list``) then reads, on any mesh, only the byte ranges of the
saved chunks that overlap each box this rank holds (each such chunk is read whole, then narrowed).
A DCP without the protocol (torch 2.11) would save the bare local tensor as if it were the whole one; there
``_older_dcp`` gives the entry the same four fields through the hooks that DCP asks DTensor for.
"""
from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from autosplit.runtime.state.state_dict import local_tensors
from autosplit.tp.shards import ShardedParam


def entry(t: torch.Tensor, info: ShardedParam | None, tp_rank: int) -> torch.Tensor | None:
    """This rank's part of ``t`` as a DCP entry: a view of its local storage (DCP writes a load into
    it) tagged with its chunks; ``t`` itself's view for a whole tensor; None when it holds nothing."""
    slices = dict(info.slices[tp_rank]) if info is not None else {}
    full_shape = tuple(info.full_shape) if info is not None else tuple(t.shape)
    local = t.to_local() if isinstance(t, DTensor) else t
    if isinstance(t, DTensor):          # a block of the tp shard: narrow each dim's indices to it
        sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        for d, (size, offset) in enumerate(zip(sizes, offsets)):
            if size != t.shape[d]:
                slices[d] = slices.get(d, torch.arange(full_shape[d]))[offset:offset + size]
    view = local.detach()
    if not slices:
        return view
    if local.numel() == 0:
        return None
    boxes = ShardedParam("", full_shape, [slices]).boxes(0)
    view.global_shape = full_shape
    view.global_offsets = tuple(b[0] for b in boxes)
    view.local_sizes = tuple(b[1] for b in boxes)
    view.local_offsets = tuple(b[2] for b in boxes)
    if not hasattr(dcp, "CheckpointableTensor"):
        _older_dcp(view)
    return view


def _older_dcp(view: torch.Tensor) -> None:
    """The protocol's four fields for a DCP that does not read them (torch 2.11), through the hooks it asks
    DTensor for: the write items and chunk list of the boxes, a box's view by its global offsets, and
    ``size()`` the global shape (its load plan compares ``size()`` with the saved shape, global for a
    DTensor).  Only DCP sees the entry: autosplit reads the tensors, not the entries, by shape."""
    full = torch.Size(view.global_shape)
    chunks = [ChunkStorageMetadata(offsets=torch.Size(g), sizes=torch.Size(s))
              for g, s in zip(view.global_offsets, view.local_sizes)]

    def write_items(fqn: str, _entry) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(view)
        return [WriteItem(index=MetadataIndex(fqn, c.offsets, i), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=properties, size=full))
                for i, c in enumerate(chunks)]

    def shard(index: MetadataIndex) -> torch.Tensor:
        found = [i for i, c in enumerate(chunks) if index.offset is None or c.offsets == index.offset]
        if len(found) != 1:
            raise ValueError(f"no single chunk of '{index.fqn}' at offsets {index.offset}")
        box = zip(view.local_offsets[found[0]], view.local_sizes[found[0]])
        return view[tuple(slice(offset, offset + size) for offset, size in box)]

    view.__create_write_items__ = write_items
    view.__create_chunk_list__ = lambda: list(chunks)
    view.__get_tensor_shard__ = shard
    view.size = lambda dim=None: full if dim is None else full[dim]


def sharded(pm) -> dict:
    return pm.plan.tp_plan.sharded if pm.plan.tp_plan is not None else {}


def model_entries(pm) -> dict[str, torch.Tensor]:
    """This rank's model tensors under their original names (persistent ones: the state dict's)."""
    keys, info = set(pm.model.state_dict().keys()), sharded(pm)
    out = {}
    for name, t in local_tensors(pm.raw_modules).items():
        if name in keys:
            e = entry(t, info.get(name), pm.block_rank)
            if e is not None:
                out[name] = e
    return out
