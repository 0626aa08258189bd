"""``SnapshotStorageReader``: a ppe-snapshot snapshot read by ``torch.distributed.checkpoint.load``.

Snapshots written through DCP (see :mod:`ppe_snapshot.dcp.layout`) are served as they were saved.
Snapshots taken by the engine (no ``"dcp"`` metadata) are served under DCP's FQNs (see
:mod:`ppe_snapshot.dcp.keys`): tensors as tensors, every other DCP leaf as the ``torch.save`` bytes
of its decoded value. A rank reads its own per-rank entries plus the replicated ones (its global
rank; every rank reads rank 0's state of a one-process snapshot). DCP's planners do the resharding.
"""
from __future__ import annotations

import dataclasses
import io
import os
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, StorageMeta, TensorProperties, TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ppe_snapshot.dcp.keys import IndexKey, engine_leaves, index_key, is_tensor, unescape
from ppe_snapshot.dcp.layout import ADAPTER_VERSION, DCP_KEY, location, properties_from_json, valid_location
from ppe_snapshot.engine import MANIFEST_NAME, group_rank, read_manifest
from ppe_snapshot.engine.codec import (
    BytesEntry, Chunk, DeviceReads, Manifest, ReadBatch, ShardedTensorEntry, TensorEntry, decode_value, inflate,
    is_direct, leaf_loader, new_take_id, read_into, tensor_bytes, torch_dtype,
)
from ppe_snapshot.errors import CorruptSnapshotError, UnsupportedFormatError, UnsupportedValueError
from ppe_snapshot.storage import Storage, open_storage


@dataclass(frozen=True)
class _TensorSource:
    """One stored chunk of a tensor: its dtype and shape, and the engine chunks holding its bytes."""
    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: list[Chunk]


@dataclass(frozen=True)
class _BytesSource:
    """A DCP bytes item: ``load(storage)`` gives the bytes DCP's load planner deserializes."""
    fqn: str
    load: Callable[[Storage], bytes]


_Source = _TensorSource | _BytesSource
_Sources = dict[IndexKey, _Source]


@dataclass
class _View:
    """What ``read_metadata`` builds: DCP's metadata and where each of its items is stored."""
    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata] = dataclasses.field(
        default_factory=dict)
    sources: _Sources = dataclasses.field(default_factory=dict)
    planner_data: Any = None

    def add_tensor(self, fqn: str, entry: TensorEntry | ShardedTensorEntry, props: TensorProperties) -> None:
        dtype = torch_dtype(entry.dtype)
        if isinstance(entry, TensorEntry):
            pieces = [([0] * len(entry.shape), entry.shape, entry.chunks)]
        else:
            pieces = [(shard.offsets, shard.sizes, shard.chunks) for shard in entry.shards]
        chunks = []
        for offsets, sizes, stored in pieces:
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            self.sources[index_key(fqn, offsets)] = _TensorSource(fqn, dtype, tuple(sizes), stored)
        self.state_dict_metadata[fqn] = TensorStorageMetadata(props, torch.Size(entry.shape), chunks)

    def add_bytes(self, fqn: str, load: Callable[[Storage], bytes]) -> None:
        self.state_dict_metadata[fqn] = BytesStorageMetadata()
        self.sources[index_key(fqn, None)] = _BytesSource(fqn, load)


def _dcp_view(manifest: Manifest, dcp_meta: dict[str, Any], where: str, allow_pickle: bool) -> _View:
    """DCP's view of a snapshot written through DCP."""
    version = dcp_meta.get("adapter_version")
    if not isinstance(version, int) or version > ADAPTER_VERSION:
        raise UnsupportedFormatError(f"{where} was written through DCP with adapter version {version!r}, newer "
                                     f"than the {ADAPTER_VERSION} this ppe-snapshot reads; upgrade ppe-snapshot")
    properties, dcp_version = dcp_meta.get("properties", {}), dcp_meta.get("version")
    if type(properties) is not dict or any(type(p) is not dict for p in properties.values()):
        raise CorruptSnapshotError(f"{where} is malformed: the DCP tensor properties are not an object of objects")
    if dcp_version is not None and type(dcp_version) is not str:
        raise CorruptSnapshotError(f"{where} is malformed: the DCP metadata version {dcp_version!r:.60} is not a "
                                   "string")
    view = _View()
    for path, entry in manifest.paths_for(0).items():
        fqn = unescape(path)
        if isinstance(entry, BytesEntry):
            view.add_bytes(fqn, lambda storage, fqn=fqn, entry=entry: _dcp_value(
                fqn, leaf_loader(storage, allow_pickle)(fqn, entry, None), allow_pickle, where))
        elif is_tensor(entry):
            view.add_tensor(fqn, entry, properties_from_json(properties.get(fqn, {}), torch_dtype(entry.dtype), fqn))
        else:
            raise CorruptSnapshotError(f"{where}: entry {path!r} is a {type(entry).__name__}, which a snapshot "
                                       "written through DCP never holds")
    view.planner_data = decode_value(dcp_meta.get("planner_data"))
    return view


def _dcp_value(fqn: str, data: bytes, allow_pickle: bool, where: str) -> bytes:
    """A value DCP saved (``torch.save`` bytes), for DCP's load planner, which unpickles it whole
    (``weights_only=False``): without ``allow_pickle``, only once torch's restricted unpickler has read it, so
    that no code a crafted snapshot names runs."""
    if allow_pickle:
        return data
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsupportedValueError(
            f"{where}: the DCP value {fqn!r} can only be read by unpickling it, which runs code chosen by whoever "
            f"wrote the snapshot ({_refusal(e):.200}); pass SnapshotStorageReader(..., allow_pickle=True) to read "
            "it if you trust the snapshot") from None
    except Exception as e:  # noqa: BLE001 - whatever torch.load makes of bytes that are not its stream
        raise CorruptSnapshotError(f"{where}: the DCP value {fqn!r} is not a torch.save stream "
                                   f"({type(e).__name__}: {str(e):.200}); the snapshot is damaged") from None
    return data


def _refusal(error: pickle.UnpicklingError) -> str:
    """What torch's restricted unpickler refused, from its message (its paragraphs but the general ones)."""
    general = ("Weights only load failed", "Check the documentation", "Please file an issue")
    paragraphs = (" ".join(p.split()) for p in str(error).split("\n\n"))
    found = [p for p in paragraphs if p and not p.startswith(general)]
    return "; ".join(found) or " ".join(str(error).split())


def _engine_view(manifest: Manifest, rank: int, where: str, allow_pickle: bool) -> _View:
    """DCP's view of an engine snapshot, as ``rank`` sees it."""
    def value_bytes(path: str) -> Callable[[Storage], bytes]:
        def load(storage: Storage) -> bytes:
            try:
                value = inflate(path, lambda p: manifest.lookup(rank, p), leaf_loader(storage, allow_pickle))
            except RecursionError:
                raise CorruptSnapshotError(f"{where}: the value at {path!r} is nested too deeply to read; the "
                                           "snapshot is damaged") from None
            buffer = io.BytesIO()
            torch.save(value, buffer)
            return buffer.getvalue()
        return load

    view = _View(planner_data={})
    for leaf in engine_leaves(manifest, rank, where):
        view.planner_data[leaf.fqn] = leaf.obj_path
        if is_tensor(leaf.entry):
            view.add_tensor(leaf.fqn, leaf.entry, TensorProperties(dtype=torch_dtype(leaf.entry.dtype)))
        else:
            view.add_bytes(leaf.fqn, value_bytes(leaf.path))
    return view


def _region(storage: Storage, source: _TensorSource, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The box ``offsets``/``lengths`` of the stored chunk, reading only the engine chunks it spans."""
    if any(n == 0 for n in lengths):
        return torch.empty(tuple(lengths), dtype=source.dtype)
    strides, step = [], 1
    for size in reversed(source.shape):
        strides.insert(0, step)
        step *= size
    itemsize = source.dtype.itemsize
    first = sum(o * s for o, s in zip(offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides))
    lo, hi = first * itemsize, (last + 1) * itemsize
    spanned, position = [], 0
    for chunk in source.chunks:
        if position < hi and position + chunk.nbytes > lo:
            spanned.append((position, chunk))
        position += chunk.nbytes
    base = spanned[0][0]
    buffer = torch.empty(spanned[-1][0] + spanned[-1][1].nbytes - base, dtype=torch.uint8)
    read_into(storage, [chunk for _, chunk in spanned], tensor_bytes(buffer), source.fqn)
    return buffer.view(source.dtype).as_strided(tuple(lengths), strides, (lo - base) // itemsize)


def _read_tensor(storage: Storage, source: _TensorSource, item: ReadItem, target: torch.Tensor,
                 device: DeviceReads) -> bool:
    """Read ``item`` into ``target``: now (True), or left to ``device`` (False: complete after its ``join()``)."""
    offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
    if tuple(target.shape) != lengths:
        raise ValueError(f"{source.fqn}: the load planner resolved a target of shape {list(target.shape)} "
                         f"for a read of shape {list(lengths)}")
    whole = not any(offsets) and lengths == source.shape
    if whole and target.dtype == source.dtype and is_direct(target):
        read_into(storage, source.chunks, tensor_bytes(target), source.fqn)
        return True
    if whole and target.dtype == source.dtype and not target.is_cpu and device.add(storage, source.chunks, target,
                                                                                   source.fqn):
        return False
    region = _region(storage, source, offsets, lengths)
    with torch.no_grad():
        target.copy_(region)
    return True


class SnapshotStorageReader(StorageReader):
    """Reads a ppe-snapshot snapshot at ``path`` for ``torch.distributed.checkpoint.load``.

    Works on snapshots written through :class:`~ppe_snapshot.dcp.SnapshotStorageWriter` and on snapshots
    taken by ``Snapshot.take``. Reads go straight into the tensors DCP's planner resolves, checksums
    verified (:class:`~ppe_snapshot.errors.CorruptSnapshotError` on a mismatch). Entries an
    engine snapshot saved with pickle are read only with ``allow_pickle=True``, and so are values saved through
    DCP that torch's restricted unpickler (``weights_only=True``) refuses: DCP's planner unpickles them whole.
    """

    def __init__(self, path: str | os.PathLike, storage_options: dict[str, Any] | None = None, *,
                 allow_pickle: bool = False) -> None:
        super().__init__()
        self.path = location(path)
        self.storage_options = storage_options
        self.allow_pickle = allow_pickle
        self.load_id = new_take_id()
        self._sources: _Sources | None = None

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = location(checkpoint_id)
        self.load_id = new_take_id()
        self._sources = None

    def read_metadata(self) -> Metadata:
        manifest = read_manifest(open_storage(self.path, self.storage_options))
        where = f"{self.path}/{MANIFEST_NAME}"
        manifest.check_entries()
        dcp_meta = manifest.metadata.get(DCP_KEY)
        try:
            if isinstance(dcp_meta, dict):
                view, version = _dcp_view(manifest, dcp_meta, where, self.allow_pickle), dcp_meta.get("version")
            else:
                rank = 0 if manifest.world_size == 1 else group_rank()[0]
                view, version = _engine_view(manifest, rank, where, self.allow_pickle), None
        except RecursionError:
            raise CorruptSnapshotError(f"{where}: the saved state is nested too deeply to read (containers "
                                       "within one another); the snapshot is damaged") from None
        self._sources = view.sources
        return Metadata(
            state_dict_metadata=view.state_dict_metadata,
            planner_data=view.planner_data,
            storage_meta=StorageMeta(checkpoint_id=self.path, save_id=manifest.take_id or None, load_id=self.load_id),
            version=version,
        )

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._sources is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._sources is None:
            raise ValueError("read_metadata() must run before read_data()")
        storage = open_storage(self.path, self.storage_options)
        device = DeviceReads(ReadBatch())  # device targets: pipelined through page-locked buffers
        pending: list[tuple[ReadItem, torch.Tensor]] = []  # committed once ``device`` has read them
        try:
            for item in plan.items:
                source = self._sources.get(index_key(item.storage_index.fqn, item.storage_index.offset))
                if source is None:
                    raise KeyError(f"{item.storage_index} is not in snapshot {self.path}")
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(source.load(storage)))
                    continue
                target = planner.resolve_tensor(item).detach()
                if _read_tensor(storage, source, item, target, device):
                    planner.commit_tensor(item, target)
                else:
                    pending.append((item, target))
        finally:
            try:
                device.join()
            finally:
                storage.close()
        for item, target in pending:
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return valid_location(checkpoint_id)
