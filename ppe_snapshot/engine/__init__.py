"""The snapshot engine: flatten app state, plan, stage, write, commit; restore in place.

This module is the engine's one public surface: the floors above it (``writing/``, ``dcp/``,
``retention``, ``cli``, the extension) import ``ppe_snapshot.engine`` and nothing below it.

Taking a snapshot
    :class:`Snapshot` (``take``, ``async_take``, ``restore``, ``read_object``, ``verify``,
    ``get_manifest``), :class:`PendingSnapshot`. In stages, for writers that run the write elsewhere:
    ``job = prepare_take(path, app_state, *, pg=..., ...)`` plans this rank's share (every rank of ``pg``
    calls it); ``job.stage(provider)`` copies the state into a staging buffer;
    ``job.write_and_commit()`` writes and commits (in a thread, or in another process: the job pickles;
    there ``release_staging()`` / ``use_staged(buffer)`` hand the staged image over). ``LOCAL`` as ``pg``
    takes or restores in this process alone; ``group_rank(pg)`` is (rank, world size). Between ranks, naming a
    rank that died (``rank_channel.py``): ``side_group(pg)`` (the gloo group beside ``pg`` that takes use),
    ``exchange(group, doc, tag, decide, root=)`` (through one rank), ``agree_max(group, value,
    tag)``. ``gc_paused()`` pauses Python's cyclic collector around a take the caller waits for (as
    ``Snapshot.take`` does).
State objects
    :class:`Stateful`, :class:`StateDict`, :class:`RNGState`, :class:`OptimizerState`.
The format, in one place (``engine/format.py``)
    ``MANIFEST_NAME``, ``PARTS_DIR``, ``data_file(rank)``, ``new_take_id()``, ``part_name`` /
    ``abort_name`` / ``parse_parts_name`` / ``takes_in_progress`` (in-progress takes under ``.parts/``),
    entry kinds ``Kind`` (manifest entry types), ``Raw`` (what a data file holds for a leaf), ``Container``.
The manifest
    :class:`Manifest`, ``read_manifest(storage)`` (raises ``SnapshotNotFoundError`` when none is committed),
    the entry classes, ``commit_manifest(storage, manifest)`` (checks, then writes the manifest last, as the
    format version the settings say: 2 by default), ``refuse_overwrite(storage)``, ``upgrade_snapshot(source,
    dest)`` (a version-1 snapshot rewritten as version 2). A version-2 manifest reads its index files when first
    needed; ``manifest.lookup(rank, path, own_shards=True)`` gives a sharded entry with the shards of ``rank``'s
    own index only (``entry.complete()`` gives all).
Values and their bytes
    ``escape`` / ``child_path`` (logical paths), ``inflate`` (rebuild a value from entries), ``leaf_loader``
    (THE loader of one stored value, by its kind), ``read_into`` (verified reads), ``Payload`` and
    ``PayloadAppender`` (append payloads to a data file), ``align``, ``needs_bounce``, ``host_copy_buffer``,
    ``is_direct``, ``tensor_bytes``, ``new_staging_buffer`` and ``new_shared_buffer`` (staging buffers; the
    shared one for another process to map), the value encoding (``encode_value``, ``decode_value``,
    ``dtype_name``, ``torch_dtype``, ``can_store_raw``).
"""
from ppe_snapshot.engine.commit import commit as commit_manifest
from ppe_snapshot.engine.commit import refuse_overwrite
from ppe_snapshot.engine.flatten import LoadLeaf, Payload, child_path, escape, inflate
from ppe_snapshot.engine.format import (
    MANIFEST_NAME, PARTS_DIR, Container, InProgress, Kind, Raw, abort_name, data_file, new_take_id,
    parse_parts_name, part_name, takes_in_progress,
)
from ppe_snapshot.engine.gcpause import gc_paused
from ppe_snapshot.engine.hostmem import new_shared_buffer
from ppe_snapshot.engine.loading import leaf_loader
from ppe_snapshot.engine.manifest import (
    BytesEntry, Chunk, ContainerEntry, Entry, Manifest, ObjectEntry, PickleEntry, Shard, ShardedTensorEntry,
    TensorEntry,
)
from ppe_snapshot.engine.commit_v2 import upgrade as upgrade_snapshot
from ppe_snapshot.engine.manifest_v2 import read_manifest
from ppe_snapshot.engine.packing import PayloadAppender, align, host_copy_buffer, is_direct, needs_bounce, tensor_bytes
from ppe_snapshot.engine.rank_channel import SideGroup, agree_max, exchange, side_group
from ppe_snapshot.engine.ranks import LOCAL, LocalGroup, group_rank
from ppe_snapshot.engine.reads import read_into
from ppe_snapshot.engine.serialization import can_store_raw, decode_value, dtype_name, encode_value, torch_dtype
from ppe_snapshot.engine.snapshot import PendingSnapshot, Snapshot
from ppe_snapshot.engine.staging import new_staging_buffer
from ppe_snapshot.engine.stateful import OptimizerState, RNGState, Stateful, StateDict
from ppe_snapshot.engine.take import StagingProvider, TakeJob, TensorPrepare, prepare_take

__all__ = [
    # taking and restoring
    "LOCAL", "LocalGroup", "PendingSnapshot", "SideGroup", "Snapshot", "StagingProvider", "TakeJob", "TensorPrepare",
    "agree_max", "exchange", "gc_paused", "group_rank", "prepare_take", "side_group",
    # state objects
    "OptimizerState", "RNGState", "StateDict", "Stateful",
    # the format
    "Container", "InProgress", "Kind", "MANIFEST_NAME", "PARTS_DIR", "Raw", "abort_name", "data_file", "new_take_id",
    "parse_parts_name", "part_name", "takes_in_progress",
    # the manifest
    "BytesEntry", "Chunk", "ContainerEntry", "Entry", "Manifest", "ObjectEntry", "PickleEntry", "Shard",
    "ShardedTensorEntry", "TensorEntry", "commit_manifest", "read_manifest", "refuse_overwrite", "upgrade_snapshot",
    # values and their bytes
    "LoadLeaf", "Payload", "PayloadAppender", "align", "can_store_raw", "child_path", "decode_value", "dtype_name",
    "encode_value", "escape", "host_copy_buffer", "inflate", "is_direct", "leaf_loader", "needs_bounce",
    "new_shared_buffer", "new_staging_buffer", "read_into", "tensor_bytes", "torch_dtype",
]
