"""Tensors split over ranks: DTensor (any placement, FSDP2 ``fully_shard``) and ShardedTensor.

Take: ``flatten`` turns such a tensor into a :class:`ShardedPayload` (this
rank's local shards with their global offsets, computed by
``torch.distributed.checkpoint``'s own helpers). The planner writes each
shard once: ranks holding identical copies (``Replicate`` mesh dims) agree,
without communication, on which of them writes it, spreading the choice over
tensors. Each rank's part lists the shards it wrote; ``merge_sharded`` joins
them into one :class:`ShardedTensorEntry` per tensor, in the manifest's
``sharded`` section, which every rank of any world size sees.

Restore: the target decides what to read: its local shard for a DTensor or
ShardedTensor, the whole tensor for a plain tensor (or ``read_object``). The
overlap between saved shards and the target's regions comes from DCP's
resharding planner (``create_read_items_for_chunk_list``); each rank reads
only what it needs, with no collective. A saved shard that lands whole in a
contiguous region is read straight into it; otherwise the checksummed chunks
that hold the needed rows are streamed through a buffer bounded by the memory
budget, so every byte used is verified with its whole chunk.
"""
from __future__ import annotations

import math
import sys
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from ppe_snapshot.engine.manifest import Chunk, Shard, ShardedTensorEntry, TensorEntry
from ppe_snapshot.engine.serialization import dtype_name, torch_dtype
from ppe_snapshot.errors import CorruptSnapshotError, SnapshotError, StateMismatchError, UnsupportedValueError
from ppe_snapshot.storage import Storage

# flatten imports this module, and loading / packing import flatten: the readers below import them when called.

#: Separates a sharded tensor's path from a shard's number in a rank's file layout; ``%``
#: followed by ``#`` never occurs in a logical path (``%`` is always escaped as ``%25``).
_SHARD_MARK = "%#"


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _loaded_class(module: str, name: str) -> type | None:
    """A class of an optional torch.distributed module, only if something already imported it
    (a value of that class cannot exist otherwise, and the imports are slow)."""
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def _dtensor_class() -> type | None:
    return _loaded_class("torch.distributed.tensor", "DTensor")


def _sharded_tensor_class() -> type | None:
    return _loaded_class("torch.distributed._shard.sharded_tensor", "ShardedTensor")


def is_sharded(value: Any) -> bool:
    """Whether ``value`` is a DTensor or a ShardedTensor."""
    if type(value) in _PLAIN_TENSORS:  # the common case, asked once per tensor of the state
        return False
    classes = tuple(c for c in (_dtensor_class(), _sharded_tensor_class()) if c is not None)
    return bool(classes) and isinstance(value, classes)


# -- take ---------------------------------------------------------------------

@dataclass
class LocalShard:
    """A block of the global tensor held by this rank."""
    offsets: list[int]
    tensor: torch.Tensor


@dataclass
class ShardedPayload:
    """A sharded tensor as this rank holds it (a flatten item).

    Ranks holding the same block form a replica group of ``group_size``;
    ``replica`` is this rank's place in it and ``block`` numbers the block
    among the groups. ``replicated`` is always true: the entry is seen by
    every rank at restore, so containers above it are too.
    """
    dtype: str
    shape: list[int]
    shards: list[LocalShard]
    replica: int = 0
    group_size: int = 1
    block: int = 0
    replicated: bool = True

    def written(self, path: str, dedupe: bool) -> list[LocalShard]:
        """The shards this rank writes: all of them, or with ``dedupe`` only where it is
        its replica group's writer (chosen per path and block, so writes spread over ranks)."""
        if dedupe and (zlib.crc32(path.encode()) + self.block) % self.group_size != self.replica:
            return []
        return [s for s in self.shards if s.tensor.numel()]


def _linear(coordinate: list[int], sizes: list[int]) -> int:
    index = 0
    for c, n in zip(coordinate, sizes):
        index = index * n + c
    return index


def _dtensor_payload(path: str, value: Any) -> ShardedPayload:
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_list
    from torch.distributed.tensor import Replicate, Shard as ShardPlacement
    from torch.distributed.tensor.placement_types import _StridedShard

    for placement in value.placements:
        if isinstance(placement, _StridedShard) or not isinstance(placement, (ShardPlacement, Replicate)):
            raise UnsupportedValueError(
                f"{path}: DTensor placement {placement!r} is not supported (only Shard(dim) and Replicate); "
                "redistribute it first, e.g. value.redistribute(placements=[Replicate()] * mesh.ndim)")
    payload = ShardedPayload(_dtype(path, value), list(value.shape), [])
    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the DTensor's mesh: it holds nothing
        return payload
    (chunk,) = _create_chunk_list(value)
    local = value.to_local().detach()
    payload.shards.append(LocalShard(list(chunk.offsets), local))
    shape = list(mesh.shape)
    replicate = [d for d, p in enumerate(value.placements) if isinstance(p, Replicate)]
    shard = [d for d in range(mesh.ndim) if d not in replicate]
    payload.group_size = math.prod(shape[d] for d in replicate)
    payload.replica = _linear([coordinate[d] for d in replicate], [shape[d] for d in replicate])
    payload.block = _linear([coordinate[d] for d in shard], [shape[d] for d in shard])
    return payload


def _dtype(path: str, value: Any) -> str:
    try:
        return dtype_name(value.dtype)
    except UnsupportedValueError as e:
        raise UnsupportedValueError(f"{path}: {e}") from None


def sharded_payload(path: str, value: Any) -> ShardedPayload:
    """The flatten item of a DTensor or ShardedTensor (see :func:`is_sharded`)."""
    dtensor = _dtensor_class()
    if dtensor is not None and isinstance(value, dtensor):
        return _dtensor_payload(path, value)
    shards = [LocalShard(list(s.metadata.shard_offsets), s.tensor.detach()) for s in value.local_shards()]
    return ShardedPayload(_dtype(path, value), list(value.size()), shards)


def sharded_state_patterns(items: dict[str, Any]) -> list[str]:
    """Replicated-globs for app state entries that hold sharded tensors.

    Like ``torch.distributed.checkpoint``, such state (an FSDP2 module, its
    optimizer) is taken to be SPMD: its other values (``step``, hyper-
    parameters) are the same on every rank, so they are written once and
    every rank, of any world size, restores them. Keep per-rank values under
    another app state key.
    """
    keys = {path.split("/", 1)[0] for path, item in items.items() if isinstance(item, ShardedPayload)}
    return [p for key in sorted(keys) for p in (key, f"{key}/*")]


def shard_key(path: str, index: int) -> str:
    """The name of a shard in a rank's file layout."""
    return f"{path}{_SHARD_MARK}{index}"


def is_shard_key(name: str) -> bool:
    return _SHARD_MARK in name


@dataclass
class ShardPlan:
    """The shards of one tensor that a rank writes, by their file layout names."""
    dtype: str
    shape: list[int]
    shards: list[tuple[list[int], list[int], str]] = field(default_factory=list)  # offsets, sizes, name


def plan_sharded(path: str, item: ShardedPayload, dedupe: bool) -> tuple[ShardPlan, list[tuple[str, torch.Tensor]]]:
    """What this rank writes of ``item``: its plan and the tensors to lay out, by name."""
    plan, tensors = ShardPlan(item.dtype, item.shape), []
    for i, shard in enumerate(item.written(path, dedupe)):
        name = shard_key(path, i)
        plan.shards.append((shard.offsets, list(shard.tensor.shape), name))
        tensors.append((name, shard.tensor))
    return plan, tensors


def sharded_entries(plans: dict[str, ShardPlan], chunks: dict[str, list[Chunk]]) -> dict[str, ShardedTensorEntry]:
    """A rank's part: its shards of every sharded tensor (none for a rank that wrote none)."""
    return {path: ShardedTensorEntry(plan.dtype, plan.shape,
                                     [Shard(offsets, sizes, chunks[name]) for offsets, sizes, name in plan.shards])
            for path, plan in plans.items()}


def merge_sharded(parts: list[dict[str, ShardedTensorEntry]]) -> dict[str, ShardedTensorEntry]:
    """Every rank's shards of each tensor in one entry; raises unless they tile the tensor exactly."""
    merged: dict[str, ShardedTensorEntry] = {}
    for rank, part in enumerate(parts):
        for path, entry in part.items():
            first = merged.setdefault(path, ShardedTensorEntry(entry.dtype, entry.shape, []))
            if (first.dtype, first.shape) != (entry.dtype, entry.shape):
                raise SnapshotError(
                    f"{path}: ranks disagree on the sharded tensor: rank {rank} has global shape {entry.shape} "
                    f"and dtype {entry.dtype}, another rank global shape {first.shape} and dtype {first.dtype}")
            first.shards.extend(entry.shards)
    for path, entry in merged.items():
        # A block written by two ranks (copies of one DTensor on separate meshes) is kept once.
        unique = {(tuple(s.offsets), tuple(s.sizes)): s for s in reversed(entry.shards)}
        entry.shards[:] = [unique[key] for key in sorted(unique)]
        covered, total = sum(math.prod(s.sizes) for s in entry.shards), math.prod(entry.shape)
        if covered != total:
            raise SnapshotError(
                f"{path}: the shards written cover {covered} of the {total} elements of the sharded tensor; "
                "take the snapshot on every rank of its device mesh (pg=None or a group holding all of them)")
    return merged


# -- restore ------------------------------------------------------------------

def _target_regions(target: torch.Tensor) -> list[tuple[Any, torch.Tensor]]:
    """(global chunk, local tensor) for every non-empty block of the target held by this rank."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_list

    dtensor, sharded_tensor = _dtensor_class(), _sharded_tensor_class()
    if dtensor is not None and isinstance(target, dtensor):
        if target.device_mesh.get_coordinate() is None:
            return []
        locals_ = [target.to_local()]
    elif sharded_tensor is not None and isinstance(target, sharded_tensor):
        locals_ = [s.tensor for s in target.local_shards()]
    else:
        return [(ChunkStorageMetadata(torch.Size([0] * target.dim()), target.shape), target)] if target.numel() else []
    return [(chunk, local.detach()) for chunk, local in zip(_create_chunk_list(target), locals_) if local.numel()]


def _check_target(path: str, entry: ShardedTensorEntry, target: torch.Tensor) -> None:
    found = (list(target.shape), str(target.dtype).removeprefix("torch."))  # the manifest's dtype names
    if found != (entry.shape, entry.dtype):
        raise StateMismatchError(
            f"{path}: the snapshot holds a sharded tensor of global shape {entry.shape} and dtype {entry.dtype}, "
            f"but the restore target has global shape {found[0]} and dtype {found[1]}")


def load_sharded(storage: Storage, path: str, entry: ShardedTensorEntry | TensorEntry, target: Any,
                 budget: int | None = None, batch: Any = None) -> Any:
    """Load the saved sharded tensor into ``target`` in place (a DTensor, ShardedTensor or
    full-size tensor); without a tensor target, into a new full tensor.

    A whole saved tensor (``TensorEntry``) loads as one shard, e.g. into a DTensor.
    """
    if isinstance(entry, TensorEntry):
        entry = ShardedTensorEntry(entry.dtype, entry.shape, [Shard([0] * len(entry.shape), entry.shape, entry.chunks)])
    if not isinstance(target, torch.Tensor):
        from ppe_snapshot.engine.loading import check_stored
        check_stored(storage, [c for shard in entry.shards for c in shard.chunks], path)
        target = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
    _check_target(path, entry, target)
    regions = _target_regions(target)
    if not regions:
        return target
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    saved = TensorStorageMetadata(
        TensorProperties(dtype=target.dtype), torch.Size(entry.shape),
        [ChunkStorageMetadata(torch.Size(s.offsets), torch.Size(s.sizes)) for s in entry.shards])
    reads = create_read_items_for_chunk_list(path, saved, [chunk for chunk, _ in regions])
    _check_covered(path, reads, regions)
    by_shard: dict[int, list[Any]] = defaultdict(list)
    for item in reads:
        by_shard[item.storage_index.index].append(item)
    dests = [local for _, local in regions]
    with torch.no_grad():
        for index, items in sorted(by_shard.items()):
            _read_shard(storage, path, entry.shards[index], items, dests, budget, batch)
    return target


def _check_covered(path: str, reads: list[Any], regions: list[tuple[Any, torch.Tensor]]) -> None:
    got: dict[int, int] = defaultdict(int)
    for item in reads:
        got[item.dest_index.index] += math.prod(item.lengths)
    for index, (chunk, local) in enumerate(regions):
        if got[index] != local.numel():
            raise CorruptSnapshotError(
                f"{path}: the saved shards cover {got[index]} of the {local.numel()} elements at global offsets "
                f"{list(chunk.offsets)} (sizes {list(chunk.sizes)}); the snapshot is incomplete")


def _region(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


def _read_shard(storage: Storage, path: str, shard: Shard, items: list[Any], dests: list[torch.Tensor],
                budget: int | None, batch: Any) -> None:
    """Copy the parts ``items`` of one saved shard into their destinations (whole-shard reads via ``batch``,
    a ``loading.ReadBatch``)."""
    from ppe_snapshot.engine.loading import fill, read_through_host
    from ppe_snapshot.engine.packing import is_direct, tensor_bytes

    item = items[0]
    if len(items) == 1 and not any(item.storage_offsets) and list(item.lengths) == shard.sizes:
        dest = _region(dests[item.dest_index.index], item.dest_offsets, item.lengths)
        if is_direct(dest):
            fill(batch, storage, shard.chunks, tensor_bytes(dest), path)
            return
        if dest.is_contiguous():
            read_through_host(storage, shard.chunks, dest, path, budget)
            return
    _stream_shard(storage, path, shard, items, dests, budget)


def _stream_shard(storage: Storage, path: str, shard: Shard, items: list[Any], dests: list[torch.Tensor],
                  budget: int | None) -> None:
    """Read the chunks holding the rows ``items`` need, in slabs of whole rows, and copy out the overlaps.

    Only whole chunks are read, so each is verified against its checksum.
    """
    from ppe_snapshot.engine.loading import _ChunkReader
    from ppe_snapshot.engine.packing import CHUNK_BYTES, tensor_bytes

    dtype, sizes = dests[0].dtype, shard.sizes  # not 0-d: those always land whole in their target
    row = math.prod(sizes[1:]) * dests[0].element_size()
    if sum(c.nbytes for c in shard.chunks) != sizes[0] * row:
        raise CorruptSnapshotError(f"{path}: a saved shard's chunks do not hold its {sizes} elements")
    need = (min(i.storage_offsets[0] for i in items) * row,
            max(i.storage_offsets[0] + i.lengths[0] for i in items) * row)
    starts, position = [], 0
    for chunk in shard.chunks:
        starts.append(position)
        position += chunk.nbytes
    span = [i for i, (s, c) in enumerate(zip(starts, shard.chunks)) if s < need[1] and s + c.nbytes > need[0]]
    begin, end = starts[span[0]], starts[span[-1]] + shard.chunks[span[-1]].nbytes
    reader = _ChunkReader(storage, shard.chunks[span[0]:span[-1] + 1], path)
    rows = max(1, (budget or CHUNK_BYTES) // row)
    buffer = torch.empty(max(rows * row, 1), dtype=torch.uint8)
    position = begin
    while position < end:
        if position < need[0] or position >= need[1]:  # bytes of a needed chunk outside the needed rows
            stop = min(need[0] if position < need[0] else end, position + buffer.numel())
            reader.read(tensor_bytes(buffer[: stop - position]))
        else:
            stop = min(need[1], position + rows * row)
            reader.read(tensor_bytes(buffer[: stop - position]))
            slab = buffer[: stop - position].view(dtype).view([(stop - position) // row] + sizes[1:])
            _copy_overlaps(slab, position // row, items, dests)
        position = stop


def _copy_overlaps(slab: torch.Tensor, slab_start: int, items: list[Any], dests: list[torch.Tensor]) -> None:
    """Copy the rows ``slab_start..`` of a saved shard into every destination that needs them."""
    slab_stop = slab_start + slab.shape[0]
    for item in items:
        src_off, dst_off, lengths = list(item.storage_offsets), list(item.dest_offsets), list(item.lengths)
        lo, hi = max(src_off[0], slab_start), min(src_off[0] + lengths[0], slab_stop)
        if lo >= hi:
            continue
        src = _region(slab, [lo - slab_start] + src_off[1:], [hi - lo] + lengths[1:])
        dst = _region(dests[item.dest_index.index], [dst_off[0] + lo - src_off[0]] + dst_off[1:],
                      [hi - lo] + lengths[1:])
        dst.copy_(src)
