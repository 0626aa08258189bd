"""``torch.distributed.checkpoint`` (DCP) storage adapters over ppe-snapshot's storage and format.

``dcp.save(state, storage_writer=SnapshotStorageWriter(path))`` writes an ordinary engine
snapshot, and ``dcp.load(state, storage_reader=SnapshotStorageReader(path))`` reads one,
whether DCP or ``Snapshot.take`` wrote it; DCP's planners do the resharding.

Layout of a snapshot written through DCP (same files, checksums and commit as the engine's):

* rank ``r`` writes its items into ``data/rank<r>.bin``: payloads at 64-byte aligned
  offsets, an xxh3_64 checksum per chunk of at most 64 MiB;
* the coordinator's ``finish`` writes ``manifest.json`` last (the commit point). DCP's state
  is global, so every entry sits in ``replicated``, keyed by its DCP FQN (escaped as one
  path segment, e.g. ``"model.layer.weight"``):

  - a tensor saved as one whole chunk is a ``TensorEntry``;
  - a tensor saved as several chunks (DTensor / ShardedTensor shards) is a
    ``ShardedTensorEntry`` (global shape; shards with offsets, sizes and chunks, in DCP's order);
  - a non-tensor value (a DCP ``BYTE_IO`` item: the bytes DCP's planner serialized, by default
    a ``torch.save`` stream) is a ``BytesEntry``: opaque bytes the engine hands back as
    ``bytes`` and never unpickles. Only ``dcp.load`` deserializes them, as DCP always does;

* ``manifest.metadata["dcp"]`` holds, as JSON, what DCP needs beyond the entries:
  ``adapter_version``, DCP's metadata ``version``, the planner's ``planner_data`` (tagged JSON,
  see ``engine/serialization.py``) and the ``TensorProperties`` that differ from the defaults.

Reading an engine snapshot (no ``"dcp"`` metadata), logical paths become FQNs the way DCP
flattens nested state dicts (``"optim/state/0/exp_avg"`` -> ``"optim.state.0.exp_avg"``):
dicts are always descended, lists only when they hold a tensor, a dict or such a list, tuples
never. Tensors are served as tensors; every other DCP leaf is served as the ``torch.save``
bytes of its decoded value. A rank reads its own per-rank entries plus the replicated ones
(its global rank; every rank reads rank 0's state of a one-process snapshot).
"""
from __future__ import annotations

import dataclasses
import io
import os
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import fsspec
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, StorageMeta, TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItem, WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ppe_snapshot.engine import commit as commit_protocol
from ppe_snapshot.engine.flatten import Payload, escape, inflate, join
from ppe_snapshot.engine.loading import load_bytes, load_pickle, load_tensor, read_into
from ppe_snapshot.engine.manifest import (
    MANIFEST_NAME, BytesEntry, Chunk, ContainerEntry, Entry, Manifest, PickleEntry, Shard, ShardedTensorEntry,
    TensorEntry,
)
from ppe_snapshot.engine.packing import (
    BOUNCE_BYTES, PayloadAppender, align, is_direct, needs_bounce, tensor_bytes,
)
from ppe_snapshot.engine.serialization import can_store_raw, decode_value, dtype_name, encode_value, torch_dtype
from ppe_snapshot.engine.sharded import load_sharded
from ppe_snapshot.errors import (
    CorruptSnapshotError, SnapshotError, SnapshotExistsError, SnapshotNotFoundError, UnsupportedFormatError,
    UnsupportedValueError,
)
from ppe_snapshot.storage import Storage, is_local, open_storage

#: Key of the DCP metadata in ``Manifest.metadata``.
DCP_KEY = "dcp"
#: Version of the layout described above; readers refuse newer ones.
ADAPTER_VERSION = 1
_DICT_KINDS = ("dict", "OrderedDict")


def _location(checkpoint_id: str | os.PathLike) -> str:
    path = os.fsdecode(os.fspath(checkpoint_id))
    if not path:
        raise ValueError("the snapshot path is empty; pass a directory path or an fsspec URL")
    return path


def _new_id() -> str:
    return uuid.uuid4().hex[:16]


def _data_file(rank: int) -> str:
    return f"data/rank{rank}.bin"


def _valid_location(checkpoint_id: Any) -> bool:
    """A local path, or an fsspec URL (chains like ``simplecache::s3://...`` too) of a known protocol."""
    try:
        path = _location(checkpoint_id)
    except (TypeError, ValueError):
        return False
    if is_local(path) and "::" not in path:
        return True
    known = set(fsspec.available_protocols())
    return all(part.split("://", 1)[0] in known for part in path.split("::"))


def _index_key(fqn: str, offsets: Sequence[int] | None) -> tuple[str, tuple[int, ...] | None]:
    return fqn, None if offsets is None else tuple(offsets)


def _torch_name(value: Any) -> str:
    return str(value).removeprefix("torch.")


def _torch_attr(name: Any, kind: type, what: str) -> Any:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, kind):
        raise CorruptSnapshotError(f"the DCP metadata of {what} names an unknown torch {kind.__name__} {name!r}")
    return value


# -- writing --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Stored:
    """Where one write item went (``WriteResult.storage_data``, gathered to the coordinator)."""
    dtype: str | None  # None for bytes
    chunks: list[Chunk]
    file_size: int


def _resolve(item: WriteItem, planner: SavePlanner) -> Payload:
    """The item's data as an engine payload ("pickle" is packing's name for raw bytes)."""
    fqn = item.index.fqn
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        if isinstance(data, io.BytesIO):
            return Payload("pickle", data.getbuffer())
        if isinstance(data, (bytes, bytearray, memoryview)):
            return Payload("pickle", memoryview(data).cast("B"))
        raise TypeError(f"{fqn}: the save planner resolved a BYTE_IO item to a {type(data).__name__}; "
                        "it must resolve to io.BytesIO or bytes")
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{fqn}: the save planner resolved a tensor item to a {type(data).__name__}")
    tensor = data.detach()
    expected = list(item.tensor_data.chunk.sizes) if item.tensor_data is not None else list(tensor.shape)
    if list(tensor.shape) != expected:
        raise ValueError(f"{fqn}: the save planner resolved a tensor of shape {list(tensor.shape)} "
                         f"for a chunk of shape {expected}")
    if not can_store_raw(tensor):
        raise UnsupportedValueError(f"{fqn}: a {tensor.layout} tensor of dtype {tensor.dtype} cannot be stored "
                                    "as raw bytes; convert it to a dense tensor of a standard dtype")
    return Payload("tensor", tensor)


def _bounce_for(tensor: torch.Tensor, bounce: torch.Tensor | None) -> torch.Tensor:
    """A host buffer for packing's pieces of a device or non-contiguous tensor (reused when big enough)."""
    need = min(BOUNCE_BYTES, tensor.numel() * tensor.element_size())
    if bounce is not None and bounce.numel() >= need:
        return bounce
    return torch.empty(need, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def _write_file(storage: Storage, file: str, items: Sequence[WriteItem], planner: SavePlanner) -> list[WriteResult]:
    """Write one rank's items into ``file``, resolving each only when its turn comes."""
    written: list[tuple[WriteItem, int, str | None, list[Chunk]]] = []
    bounce: torch.Tensor | None = None
    writer = storage.open_writer(file)
    try:
        appender = PayloadAppender(writer, file)
        for item in items:
            payload = _resolve(item, planner)
            appender.pad_to(align(appender.position))
            if needs_bounce(payload):
                bounce = _bounce_for(payload.data, bounce)
            chunks = appender.append(payload, bounce)
            dtype = dtype_name(payload.data.dtype) if payload.kind == "tensor" else None
            written.append((item, payload.nbytes, dtype, chunks))
        appender.finish(align(appender.position))
        size = writer.close()
    except BaseException:
        writer.abort()
        raise
    return [WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=_Stored(dtype, chunks, size))
            for item, nbytes, dtype, chunks in written]


def _properties_json(props: TensorProperties, stored_dtype: str) -> dict[str, Any]:
    """The properties that differ from what a reader assumes (the stored dtype, plain strided tensors)."""
    out: dict[str, Any] = {}
    if props.dtype != torch_dtype(stored_dtype):
        out["dtype"] = _torch_name(props.dtype)
    if props.requires_grad:
        out["requires_grad"] = True
    if props.pin_memory:
        out["pin_memory"] = True
    if props.layout != torch.strided:
        out["layout"] = _torch_name(props.layout)
    if props.memory_format != torch.contiguous_format:
        out["memory_format"] = _torch_name(props.memory_format)
    return out


def _properties(data: dict[str, Any], dtype: torch.dtype, fqn: str) -> TensorProperties:
    return TensorProperties(
        dtype=_torch_attr(data["dtype"], torch.dtype, fqn) if "dtype" in data else dtype,
        layout=_torch_attr(data.get("layout", "strided"), torch.layout, fqn),
        requires_grad=bool(data.get("requires_grad", False)),
        memory_format=_torch_attr(data.get("memory_format", "contiguous_format"), torch.memory_format, fqn),
        pin_memory=bool(data.get("pin_memory", False)),
    )


def _build_manifest(metadata: Metadata, results: list[list[WriteResult]], take_id: str) -> Manifest:
    stored: dict[tuple[str, tuple[int, ...] | None], _Stored] = {}
    files: dict[str, int] = {}
    for rank_results in results:
        for result in rank_results:
            stored[_index_key(result.index.fqn, result.index.offset)] = result.storage_data
            for chunk in result.storage_data.chunks:
                files[chunk.file] = result.storage_data.file_size

    def take(fqn: str, offsets: Sequence[int] | None) -> _Stored:
        found = stored.get(_index_key(fqn, offsets))
        if found is None:
            where = "" if offsets is None else f" at offsets {list(offsets)}"
            raise SnapshotError(f"no rank wrote {fqn!r}{where}; not committing the snapshot")
        return found

    entries: dict[str, Entry] = {}
    properties: dict[str, dict[str, Any]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            entries[escape(fqn)] = BytesEntry(take(fqn, None).chunks, replicated=True)
            continue
        pieces = [(chunk, take(fqn, chunk.offsets)) for chunk in md.chunks]
        dtypes = {piece.dtype for _, piece in pieces} or {dtype_name(md.properties.dtype)}
        if len(dtypes) > 1:
            raise SnapshotError(f"the chunks of {fqn!r} were written with different dtypes {sorted(dtypes)}")
        (dtype,) = dtypes
        shape = list(md.size)
        if len(pieces) == 1 and not any(pieces[0][0].offsets) and list(pieces[0][0].sizes) == shape:
            entries[escape(fqn)] = TensorEntry(dtype, shape, pieces[0][1].chunks, replicated=True)
        else:
            shards = [Shard(list(chunk.offsets), list(chunk.sizes), piece.chunks) for chunk, piece in pieces]
            entries[escape(fqn)] = ShardedTensorEntry(dtype, shape, shards, replicated=True)
        if props := _properties_json(md.properties, dtype):
            properties[fqn] = props
    try:
        planner_data = encode_value(metadata.planner_data)
    except UnsupportedValueError as e:
        raise UnsupportedValueError(f"the save planner's planner_data cannot be stored without pickle: {e}") from None
    dcp_meta = {"adapter_version": ADAPTER_VERSION, "version": metadata.version,
                "planner_data": planner_data, "properties": properties}
    return Manifest(len(results), [{} for _ in results], entries, files, take_id, {DCP_KEY: dcp_meta})


class SnapshotStorageWriter(StorageWriter):
    """Writes ``torch.distributed.checkpoint.save`` output as a ppe-snapshot snapshot at ``path``.

    ``path`` is a local directory or any fsspec URL (``storage_options`` go to fsspec). Like
    ``Snapshot.take``, it refuses to write over a committed snapshot. See the module docstring
    for the layout.
    """

    def __init__(self, path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.path = _location(path)
        self.storage_options = storage_options
        self.save_id = _new_id()
        self.is_coordinator = True
        self._storage: Storage | None = None

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def _opened(self) -> Storage:
        if self._storage is None:
            self._storage = open_storage(self.path, self.storage_options)
        return self._storage

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = _location(checkpoint_id)
        self.save_id = _new_id()
        self._storage = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise ValueError("SnapshotStorageWriter needs use_collectives=True: one manifest, written by the "
                             "coordinator, commits every rank's data")
        self.is_coordinator = is_coordinator

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.is_coordinator and self._opened().exists(MANIFEST_NAME):
            raise SnapshotExistsError(f"a snapshot already exists at {self.path}; choose a new path or remove it first")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(plan, storage_data=_data_file(rank)) for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results: list[WriteResult] = []
        if plan.items:
            if not isinstance(plan.storage_data, str):
                raise ValueError("the save plan carries no data file name; SnapshotStorageWriter.prepare_global_plan "
                                 "must run on the coordinator's plans before write_data")
            results = _write_file(self._opened(), plan.storage_data, plan.items, planner)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write ``manifest.json`` (after checking every data file's size): the commit point."""
        commit_protocol.commit(self._opened(), _build_manifest(metadata, results, self.save_id))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _valid_location(checkpoint_id)


# -- reading --------------------------------------------------------------------------------------


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
_Sources = dict[tuple[str, tuple[int, ...] | None], _Source]


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
            self.sources[_index_key(fqn, offsets)] = _TensorSource(fqn, dtype, tuple(sizes), stored)
        self.state_dict_metadata[fqn] = TensorStorageMetadata(props, torch.Size(entry.shape), chunks)

    def add_bytes(self, fqn: str, load: Callable[[Storage], bytes]) -> None:
        self.state_dict_metadata[fqn] = BytesStorageMetadata()
        self.sources[_index_key(fqn, None)] = _BytesSource(fqn, load)


def _unescape(segment: str) -> str:
    """The inverse of the engine's path-segment escape (``%`` and ``/`` percent-encoded)."""
    return urllib.parse.unquote(segment)


def _is_tensor(entry: Entry) -> bool:
    return isinstance(entry, ShardedTensorEntry) or (isinstance(entry, TensorEntry) and entry.kind == "tensor")


def _dcp_view(manifest: Manifest, dcp_meta: dict[str, Any], where: str) -> _View:
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
        fqn = _unescape(path)
        if isinstance(entry, BytesEntry):
            view.add_bytes(fqn, lambda storage, fqn=fqn, entry=entry: load_bytes(storage, fqn, entry))
        elif _is_tensor(entry):
            view.add_tensor(fqn, entry, _properties(properties.get(fqn, {}), torch_dtype(entry.dtype), fqn))
        else:
            raise CorruptSnapshotError(f"{where}: entry {path!r} is a {type(entry).__name__}, which a snapshot "
                                       "written through DCP never holds")
    view.planner_data = decode_value(dcp_meta.get("planner_data"))
    return view


def _leaf_loader(storage: Storage, allow_pickle: bool) -> Callable[[str, Entry, Any], Any]:
    def load(path: str, entry: Entry, template: Any) -> Any:
        if isinstance(entry, PickleEntry):
            return load_pickle(storage, path, entry, allow_pickle)
        if isinstance(entry, BytesEntry):
            return load_bytes(storage, path, entry)
        if isinstance(entry, ShardedTensorEntry):
            return load_sharded(storage, path, entry, template)
        return load_tensor(storage, path, entry, template)
    return load


def _engine_view(manifest: Manifest, rank: int, where: str, allow_pickle: bool) -> _View:
    """DCP's view of an engine snapshot, as ``rank`` sees it."""
    def lookup(path: str) -> Entry | None:
        return manifest.lookup(rank, path)

    def value_bytes(path: str) -> Callable[[Storage], bytes]:
        def load(storage: Storage) -> bytes:
            try:
                value = inflate(path, lookup, _leaf_loader(storage, allow_pickle))
            except RecursionError:
                raise CorruptSnapshotError(f"{where}: the value at {path!r} is nested too deeply to read; the "
                                           "snapshot is damaged") from None
            buffer = io.BytesIO()
            torch.save(value, buffer)
            return buffer.getvalue()
        return load

    def terminal(path: str, entry: ContainerEntry) -> bool:
        """DCP's rule: a list is one value unless it holds a tensor, a dict or a list that is not."""
        for i in range(entry.length):
            child_path = join(path, i)
            child = lookup(child_path)
            if _is_tensor(child) or (isinstance(child, ContainerEntry) and (
                    child.kind in _DICT_KINDS or (child.kind == "list" and not terminal(child_path, child)))):
                return False
        return True

    view = _View(planner_data={})
    origin: dict[str, str] = {}

    def visit(path: str, obj_path: tuple[str | int, ...]) -> None:
        entry = lookup(path)
        if entry is None:
            raise CorruptSnapshotError(f"{where} lists no entry for {path!r}, which its parent refers to")
        if isinstance(entry, ContainerEntry):
            if entry.kind in _DICT_KINDS:
                for key in (decode_value(k) for k in entry.keys):
                    visit(join(path, key), obj_path + (str(key),))
                return
            if entry.kind == "list" and not terminal(path, entry):
                for i in range(entry.length):
                    visit(join(path, i), obj_path + (i,))
                return
        fqn = ".".join(map(str, obj_path))
        if fqn in origin:
            raise ValueError(f"{where}: the entries {origin[fqn]!r} and {path!r} both map to the DCP key {fqn!r}; "
                             "read this snapshot with Snapshot.restore instead")
        origin[fqn] = path
        view.planner_data[fqn] = obj_path
        if _is_tensor(entry):
            view.add_tensor(fqn, entry, TensorProperties(dtype=torch_dtype(entry.dtype)))
        else:
            view.add_bytes(fqn, value_bytes(path))

    for path in manifest.paths_for(rank):
        if "/" not in path:
            visit(path, (_unescape(path),))
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


def _read_tensor(storage: Storage, source: _TensorSource, item: ReadItem, target: torch.Tensor) -> None:
    offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
    if tuple(target.shape) != lengths:
        raise ValueError(f"{source.fqn}: the load planner resolved a target of shape {list(target.shape)} "
                         f"for a read of shape {list(lengths)}")
    whole = not any(offsets) and lengths == source.shape
    if whole and target.dtype == source.dtype and is_direct(target):
        read_into(storage, source.chunks, tensor_bytes(target), source.fqn)
        return
    region = _region(storage, source, offsets, lengths)
    with torch.no_grad():
        target.copy_(region)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class SnapshotStorageReader(StorageReader):
    """Reads a ppe-snapshot snapshot at ``path`` for ``torch.distributed.checkpoint.load``.

    Works on snapshots written through :class:`SnapshotStorageWriter` and on snapshots taken
    by ``Snapshot.take``. Reads go straight into the tensors DCP's planner resolves, checksums
    verified (:class:`~ppe_snapshot.errors.CorruptSnapshotError` on a mismatch). Entries an
    engine snapshot saved with pickle are read only with ``allow_pickle=True``.
    """

    def __init__(self, path: str | os.PathLike, storage_options: dict[str, Any] | None = None, *,
                 allow_pickle: bool = False) -> None:
        super().__init__()
        self.path = _location(path)
        self.storage_options = storage_options
        self.allow_pickle = allow_pickle
        self.load_id = _new_id()
        self._sources: _Sources | None = None

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = _location(checkpoint_id)
        self.load_id = _new_id()
        self._sources = None

    def read_metadata(self) -> Metadata:
        storage = open_storage(self.path, self.storage_options)
        where = f"{self.path}/{MANIFEST_NAME}"
        try:
            data = storage.read_bytes(MANIFEST_NAME)
        except FileNotFoundError:
            raise SnapshotNotFoundError(f"no snapshot at {self.path}: {MANIFEST_NAME} is missing (never taken, still "
                                        "being written, or its save crashed before the commit)") from None
        manifest = Manifest.from_bytes(data, where=where)
        manifest.check_entries()
        dcp_meta = manifest.metadata.get(DCP_KEY)
        try:
            if isinstance(dcp_meta, dict):
                view, version = _dcp_view(manifest, dcp_meta, where), dcp_meta.get("version")
            else:
                view, version = _engine_view(manifest, 0 if manifest.world_size == 1 else _rank(), where,
                                              self.allow_pickle), None
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
        try:
            for item in plan.items:
                source = self._sources.get(_index_key(item.storage_index.fqn, item.storage_index.offset))
                if source is None:
                    raise KeyError(f"{item.storage_index} is not in snapshot {self.path}")
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(source.load(storage)))
                else:
                    target = planner.resolve_tensor(item).detach()
                    _read_tensor(storage, source, item, target)
                    planner.commit_tensor(item, target)
        finally:
            storage.close()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _valid_location(checkpoint_id)


__all__ = ["ADAPTER_VERSION", "DCP_KEY", "SnapshotStorageReader", "SnapshotStorageWriter"]
