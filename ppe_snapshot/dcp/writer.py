"""``SnapshotStorageWriter``: ``torch.distributed.checkpoint.save`` output as a ppe-snapshot snapshot.

See :mod:`ppe_snapshot.dcp.layout` for what it writes.
"""
from __future__ import annotations

import dataclasses
import io
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ppe_snapshot.dcp.keys import IndexKey, index_key
from ppe_snapshot.dcp.layout import ADAPTER_VERSION, DCP_KEY, location, properties_json, valid_location
from ppe_snapshot.engine import align
from ppe_snapshot.engine.codec import (
    BytesEntry, Chunk, Entry, Manifest, Payload, PayloadAppender, Raw, Shard, ShardedTensorEntry, TensorEntry,
    block_size, can_store_raw, commit_manifest, data_file, dtype_name, encode_value, escape, host_copy_buffer,
    needs_bounce, new_take_id, refuse_overwrite, write_pieces,
)
from ppe_snapshot.errors import SnapshotError, UnsupportedValueError
from ppe_snapshot.storage import Storage, open_storage


@dataclass(frozen=True)
class _Stored:
    """Where one write item went (``WriteResult.storage_data``, gathered to the coordinator)."""
    dtype: str | None  # None for bytes
    chunks: list[Chunk]
    #: The data files its chunks name, with their sizes (an incremental write's include its base's).
    files: dict[str, int]


def _resolve(item: WriteItem, planner: SavePlanner) -> Payload:
    """The item's data as an engine payload: a tensor, or raw bytes (never unpickled by the engine)."""
    fqn = item.index.fqn
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        if isinstance(data, io.BytesIO):
            # Its bytes, not a getbuffer() view: a view pins the planner's buffer (no write may resize it), and
            # one that ends up in a reference cycle crashes the garbage collector of Python 3.12.0-3.12.1 (the
            # collector clears the BytesIO before the view that exports it; CPython gh-111049).
            data = data.getvalue()
        if isinstance(data, (bytes, bytearray, memoryview)):
            return Payload(Raw.BYTES, memoryview(data).cast("B"))
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
    return Payload(Raw.TENSOR, tensor)


def _write_file(storage: Storage, file: str, items: Sequence[WriteItem], planner: SavePlanner, block_bytes: int
                ) -> list[WriteResult]:
    """Write one rank's items into ``file`` in chunks of at most ``block_bytes``, resolving each only when its turn
    comes."""
    written: list[tuple[WriteItem, int, str | None, list[Chunk]]] = []
    bounce: torch.Tensor | None = None
    writer = storage.open_writer(file)
    try:
        appender = PayloadAppender(writer, file, block_bytes)
        for item in items:
            payload = _resolve(item, planner)
            appender.pad_to(align(appender.position))
            if needs_bounce(payload):
                bounce = host_copy_buffer(payload.data, bounce)
            chunks = appender.append(payload, bounce)
            dtype = dtype_name(payload.data.dtype) if payload.kind == Raw.TENSOR else None
            written.append((item, payload.nbytes, dtype, chunks))
        appender.finish(align(appender.position))
        size = writer.close()
    except BaseException:
        writer.abort()
        raise
    return [WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=_Stored(dtype, chunks, {file: size}))
            for item, nbytes, dtype, chunks in written]


def _piece_offsets(item: WriteItem) -> list[int] | None:
    """Where the item's tensor lies in the saved tensor, when it is a piece of it (None: the whole value)."""
    data = item.tensor_data
    if data is None or (not any(data.chunk.offsets) and list(data.chunk.sizes) == list(data.size)):
        return None
    return list(data.chunk.offsets)


def _write_file_incremental(storage: Storage, file: str, items: Sequence[WriteItem], planner: SavePlanner,
                            base: str, storage_options: dict[str, Any] | None,
                            block_bytes: int | None) -> list[WriteResult]:
    """``_write_file``, referencing what snapshot ``base`` holds unchanged (every item resolved first)."""
    payloads = [_resolve(item, planner) for item in items]
    pieces = [(escape(item.index.fqn), _piece_offsets(item), payload) for item, payload in zip(items, payloads)]
    written = write_pieces(storage, file, pieces, base, storage_options, block_bytes)
    return [WriteResult(index=item.index, size_in_bytes=payload.nbytes, storage_data=_Stored(
                dtype_name(payload.data.dtype) if payload.kind == Raw.TENSOR else None, chunks,
                {name: written.files[name] for name in {c.file for c in chunks}} or {file: written.files[file]}))
            for item, payload, chunks in zip(items, payloads, written.chunks)]


def _build_manifest(metadata: Metadata, results: list[list[WriteResult]], take_id: str) -> Manifest:
    stored: dict[IndexKey, _Stored] = {}
    files: dict[str, int] = {}
    for rank_results in results:
        for result in rank_results:
            stored[index_key(result.index.fqn, result.index.offset)] = result.storage_data
            files.update(result.storage_data.files)

    def take(fqn: str, offsets: Sequence[int] | None) -> _Stored:
        found = stored.get(index_key(fqn, offsets))
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
        if props := properties_json(md.properties, dtype):
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
    ``Snapshot.take``, it refuses to write over a committed snapshot. See :mod:`ppe_snapshot.dcp.layout`
    for the layout. ``base``: an earlier snapshot beside ``path`` whose unchanged blocks the new one references
    rather than writes, as ``Snapshot.take(base=)`` does. ``block_bytes`` (default ``PPE_SNAPSHOT_BLOCK_KB``): the
    size of the chunks written, the blocks the next incremental save compares.
    """

    def __init__(self, path: str | os.PathLike, storage_options: dict[str, Any] | None = None, *,
                 base: str | os.PathLike | None = None, block_bytes: int | None = None) -> None:
        super().__init__()
        self.path = location(path)
        self.storage_options = storage_options
        self.base = None if base is None else location(base)
        self.block_bytes = block_size(block_bytes)
        self.save_id = new_take_id()
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
            self.path = location(checkpoint_id)
        self.save_id = new_take_id()
        self._storage = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise ValueError("SnapshotStorageWriter needs use_collectives=True: one manifest, written by the "
                             "coordinator, commits every rank's data")
        self.is_coordinator = is_coordinator

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.is_coordinator:
            refuse_overwrite(self._opened())
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(plan, storage_data=data_file(rank)) for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results: list[WriteResult] = []
        if plan.items:
            if not isinstance(plan.storage_data, str):
                raise ValueError("the save plan carries no data file name; SnapshotStorageWriter.prepare_global_plan "
                                 "must run on the coordinator's plans before write_data")
            if self.base is None:
                results = _write_file(self._opened(), plan.storage_data, plan.items, planner, self.block_bytes)
            else:
                results = _write_file_incremental(self._opened(), plan.storage_data, plan.items, planner, self.base,
                                                  self.storage_options, self.block_bytes)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write ``manifest.json`` (after checking every data file's size): the commit point."""
        commit_manifest(self._opened(), _build_manifest(metadata, results, self.save_id))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return valid_location(checkpoint_id)
