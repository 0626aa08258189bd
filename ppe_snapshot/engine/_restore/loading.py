"""Restore, in one room: the loader of each stored kind, and the walk that rebuilds app state from a manifest.

``leaf_loader`` picks the loader of one stored value by its kind (tensor or
array, sharded tensor, pickle, raw bytes); ``Snapshot`` and the DCP reader
both use it. Reads go straight into the target's memory where they can (see
:mod:`~ppe_snapshot.engine._files.reads`), checksums verified.

Sharded tensors: the target decides what to read: its local shard for a
DTensor or ShardedTensor, the whole tensor for a plain tensor (or
``read_object``). The overlap between saved shards and the target's regions
comes from DCP's resharding planner (``create_read_items_for_chunk_list``);
each rank reads only what it needs, with no collective. A saved shard that
lands whole in a contiguous region is read straight into it; otherwise the
checksummed chunks that hold the needed rows are streamed through a buffer
bounded by the memory budget, so every byte used is verified with its whole
chunk.
"""
from __future__ import annotations

import math
import pickle
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np
import torch

from ppe_snapshot.engine._files import (
    ChunkReader, DeviceReads, ReadBatch, check_stored, chunk_limit, fill, is_direct, read_into, read_through_host,
    tensor_bytes,
)
from ppe_snapshot.engine._format import (
    BytesEntry, Entry, Manifest, PickleEntry, Raw, Shard, ShardedTensorEntry, TensorEntry, torch_dtype,
)
from ppe_snapshot.engine._restore.bulk import BulkTensors
from ppe_snapshot.engine._restore.device_slabs import DeviceSlabs
from ppe_snapshot.engine._state import (
    LoadLeaf, check_target_fits, check_tensor_target, dtensor_class, escape, inflate, is_sharded,
    sharded_tensor_class, state_of,
)
from ppe_snapshot.engine._versions import FormatVersion, version_of
from ppe_snapshot.errors import CorruptSnapshotError, StateMismatchError, UnsupportedValueError
from ppe_snapshot.storage import Storage


def load_state(storage: Storage, manifest: Manifest, rank: int, key: str, obj: Any, allow_pickle: bool) -> Any:
    """The saved state of app state entry ``key`` as ``rank`` sees it, loaded into ``obj``'s tensors in place."""
    path = escape(key)
    _check_present(storage, manifest, rank, key, path)
    template = state_of(key, obj)
    value = read_value(storage, manifest, rank, path, template, allow_pickle)
    if isinstance(template, Mapping) and not isinstance(value, Mapping):  # (its load_state_dict would fail on it)
        raise StateMismatchError(f"app_state[{key!r}]: the snapshot holds a {type(value).__name__} value there, "
                                 f"where the state_dict() of the target is a {type(template).__name__}")
    return value


def read_value(storage: Storage, manifest: Manifest, rank: int, path: str, obj_out: Any, allow_pickle: bool,
               budget: int | None = None) -> Any:
    """The value stored at logical ``path`` (and everything under it), into ``obj_out`` where it fits."""
    reads = ReadBatch()
    device = DeviceReads(reads) if budget is None else None  # (a budget bounds the host buffers: one at a time)
    version = version_of(manifest.version)
    bulk = BulkTensors(storage, manifest, rank, reads, None if device is None else DeviceSlabs()) \
        if version.indexed else None
    try:
        value = inflate(path, lambda p: manifest.lookup(rank, p, own_shards=True),
                        leaf_loader(storage, allow_pickle, budget, reads, version, device), obj_out,
                        load_children=bulk.children if bulk is not None else None)
        if bulk is not None:
            bulk.flush()
    except RecursionError:
        raise _too_deep(storage, path) from None
    finally:
        (reads if device is None else device).join()
    if bulk is not None:
        bulk.finish()
    return value


def _check_present(storage: Storage, manifest: Manifest, rank: int, key: str, path: str) -> None:
    if manifest.lookup(rank, path, own_shards=True) is not None:
        return
    owners = [r for r, entries in enumerate(manifest.ranks) if path in entries]
    if owners:
        raise StateMismatchError(
            f"app_state[{key!r}] was saved per rank by ranks {owners} of a world of {manifest.world_size}; "
            f"this process is rank {rank} and has no state there. Read another rank's state with "
            f"read_object('<rank>/{path}').")
    saved = sorted({p.split("/", 1)[0] for r in range(manifest.world_size) for p in manifest.paths_for(r)})
    if path in saved:
        raise CorruptSnapshotError(f"{storage.url}: entries under {path!r} are listed, but no entry for {path!r} "
                                   "itself; the snapshot is damaged")
    raise StateMismatchError(f"app_state[{key!r}] is not in snapshot {storage.url}; it holds {saved}")


def _too_deep(storage: Storage, path: str) -> CorruptSnapshotError:
    return CorruptSnapshotError(f"{storage.url}: the state under {path!r} is nested too deeply to rebuild "
                                "(containers or values within one another); the snapshot is damaged")


def leaf_loader(storage: Storage, allow_pickle: bool, budget: int | None = None,
                reads: ReadBatch | None = None, version: FormatVersion | None = None,
                device: DeviceReads | None = None) -> LoadLeaf:
    """The loader of one stored value, chosen by its kind (``inflate`` handles containers and inline objects).

    Tensors go into the template's tensor when it fits (reads may be left to ``reads``: complete after its
    ``join()``); host buffers for device targets stay under ``budget``; pickles load only with ``allow_pickle``.
    ``version``: the record of the manifest the entries come from, where a sharded entry may hold only this
    rank's shards (looked up with ``own_shards``); by default every entry is whole.
    """
    more_shards = version_of(None).more_shards if version is None else version.more_shards

    def load(path: str, entry: Entry, template: Any) -> Any:
        if isinstance(entry, TensorEntry) and not is_sharded(template):  # most leaves; checked first
            return load_tensor(storage, path, entry, template, budget, reads, device)
        if isinstance(entry, (TensorEntry, ShardedTensorEntry)):  # a sharded entry, or a sharded target
            return load_sharded(storage, path, entry, template, budget, reads, more_shards, device)
        if isinstance(entry, PickleEntry):
            return load_pickle(storage, path, entry, allow_pickle)
        return load_bytes(storage, path, entry)  # the last kind of leaf
    return load


def load_tensor(storage: Storage, path: str, entry: TensorEntry, target: Any,
                budget: int | None = None, reads: ReadBatch | None = None, device: DeviceReads | None = None) -> Any:
    """The saved tensor or array at ``path``, loaded into ``target`` in place when it fits.

    Reads straight into the result may be left to ``reads``, and reads into a device tensor to ``device``; the
    result is complete after their ``join()``.
    """
    if entry.kind == Raw.NDARRAY:
        return _load_array(storage, path, entry, target, reads)
    if isinstance(target, torch.Tensor):
        check_tensor_target(path, entry, target)
    else:
        check_stored(storage, entry.chunks, path)
        target = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
    if is_direct(target):
        fill(reads, storage, entry.chunks, tensor_bytes(target), path)
    elif target.is_cpu or device is None or not device.add(storage, entry.chunks, target, path):
        read_through_host(storage, entry.chunks, target, path, budget)
    return target


def _load_array(storage: Storage, path: str, entry: TensorEntry, target: Any,
                reads: ReadBatch | None) -> np.ndarray:
    dtype = np.dtype(entry.dtype)
    fits = (isinstance(target, np.ndarray) and target.dtype == dtype and list(target.shape) == entry.shape
            and target.flags.c_contiguous and target.flags.writeable)
    if not fits:
        check_stored(storage, entry.chunks, path)
    out = target if fits else np.empty(entry.shape, dtype=dtype)
    fill(reads, storage, entry.chunks, memoryview(out.reshape(-1).view(np.uint8)), path)
    return out


def load_pickle(storage: Storage, path: str, entry: PickleEntry, allow_pickle: bool) -> Any:
    """Unpickle an entry, only when the reader opted in: unpickling runs code named by the snapshot."""
    if not allow_pickle:
        raise UnsupportedValueError(
            f"{storage.url}: entry {path!r} was saved with pickle, and unpickling runs code chosen by whoever "
            "wrote the snapshot; pass allow_pickle=True to read it if you trust this snapshot")
    check_stored(storage, entry.chunks, path)
    data = bytearray(sum(c.nbytes for c in entry.chunks))
    read_into(storage, entry.chunks, memoryview(data), path)
    return pickle.loads(data)


def load_bytes(storage: Storage, path: str, entry: BytesEntry) -> bytes:
    """The raw bytes of an opaque entry, verified; never unpickled."""
    check_stored(storage, entry.chunks, path)
    data = bytearray(sum(c.nbytes for c in entry.chunks))
    read_into(storage, entry.chunks, memoryview(data), path)
    return bytes(data)


# -- sharded tensors -----------------------------------------------------------

def _target_regions(target: torch.Tensor) -> list[tuple[Any, torch.Tensor]]:
    """(global chunk, local tensor) for every non-empty block of the target held by this rank."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata  # slow imports: only sharded restores
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_list

    dtensor, sharded_tensor = dtensor_class(), sharded_tensor_class()
    if dtensor is not None and isinstance(target, dtensor):
        if target.device_mesh.get_coordinate() is None:
            return []
        locals_ = [target.to_local()]
    elif sharded_tensor is not None and isinstance(target, sharded_tensor):
        locals_ = [s.tensor for s in target.local_shards()]
    else:
        return [(ChunkStorageMetadata(torch.Size([0] * target.dim()), target.shape), target)] if target.numel() else []
    return [(chunk, local.detach()) for chunk, local in zip(_create_chunk_list(target), locals_) if local.numel()]


def load_sharded(storage: Storage, path: str, entry: ShardedTensorEntry | TensorEntry, target: Any,
                 budget: int | None = None, batch: ReadBatch | None = None,
                 more_shards: Callable[[ShardedTensorEntry], Callable[[], list[Shard]] | None] | None = None,
                 device: DeviceReads | None = None) -> Any:
    """Load the saved sharded tensor into ``target`` in place (a DTensor, ShardedTensor or
    full-size tensor); without a tensor target, into a new full tensor.

    A whole saved tensor (``TensorEntry``) loads as one shard, e.g. into a DTensor. ``more_shards``: the
    question of the manifest's version record (``FormatVersion.more_shards``) where ``entry`` may hold only this
    rank's own shards.
    """
    if isinstance(entry, TensorEntry):
        entry = ShardedTensorEntry(entry.dtype, entry.shape, [Shard([0] * len(entry.shape), entry.shape, entry.chunks)])
    more = None if more_shards is None else more_shards(entry)
    if not isinstance(target, torch.Tensor):
        if more is not None:  # the whole tensor: every rank's shards
            entry = ShardedTensorEntry(entry.dtype, entry.shape, more())
        check_stored(storage, [c for shard in entry.shards for c in shard.chunks], path)
        target = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
    check_target_fits(path, target, entry.shape, entry.dtype, "a sharded tensor", "global shape")
    regions = _target_regions(target)
    if not regions:
        return target
    reads = _read_items(path, entry, target, regions)
    if more is not None and _uncovered(reads, regions):  # beyond this rank's own shards
        entry = ShardedTensorEntry(entry.dtype, entry.shape, more())
        reads = _read_items(path, entry, target, regions)
    _check_covered(path, reads, regions)
    by_shard: dict[int, list[Any]] = defaultdict(list)
    for item in reads:
        by_shard[item.storage_index.index].append(item)
    dests = [local for _, local in regions]
    with torch.no_grad():
        for index, items in sorted(by_shard.items()):
            _read_shard(storage, path, entry.shards[index], items, dests, budget, batch, device)
    return target


def _read_items(path: str, entry: ShardedTensorEntry, target: torch.Tensor,
                regions: list[tuple[Any, torch.Tensor]]) -> list[Any]:
    """DCP's read items: which part of which saved shard goes where in the target's regions."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    saved = TensorStorageMetadata(
        TensorProperties(dtype=target.dtype), torch.Size(entry.shape),
        [ChunkStorageMetadata(torch.Size(s.offsets), torch.Size(s.sizes)) for s in entry.shards])
    return create_read_items_for_chunk_list(path, saved, [chunk for chunk, _ in regions])


def _uncovered(reads: list[Any], regions: list[tuple[Any, torch.Tensor]]) -> bool:
    got: dict[int, int] = defaultdict(int)
    for item in reads:
        got[item.dest_index.index] += math.prod(item.lengths)
    return any(got[index] != local.numel() for index, (_, local) in enumerate(regions))


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
                budget: int | None, batch: ReadBatch | None, device: DeviceReads | None) -> None:
    """Copy the parts ``items`` of one saved shard into their destinations (whole-shard reads via ``batch``, or
    ``device`` for a device tensor)."""
    item = items[0]
    if len(items) == 1 and not any(item.storage_offsets) and list(item.lengths) == shard.sizes:
        dest = _region(dests[item.dest_index.index], item.dest_offsets, item.lengths)
        if is_direct(dest):
            fill(batch, storage, shard.chunks, tensor_bytes(dest), path)
            return
        if dest.is_contiguous():
            if dest.is_cpu or device is None or not device.add(storage, shard.chunks, dest, path):
                read_through_host(storage, shard.chunks, dest, path, budget)
            return
    _stream_shard(storage, path, shard, items, dests, budget)


def _stream_shard(storage: Storage, path: str, shard: Shard, items: list[Any], dests: list[torch.Tensor],
                  budget: int | None) -> None:
    """Read the chunks holding the rows ``items`` need, in slabs of whole rows, and copy out the overlaps.

    Only whole chunks are read, so each is verified against its checksum.
    """
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
    reader = ChunkReader(storage, shard.chunks[span[0]:span[-1] + 1], path)
    rows = max(1, (budget or chunk_limit(None)) // row)  # read at call time: tests shrink it
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
