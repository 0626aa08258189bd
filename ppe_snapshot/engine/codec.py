"""The format's pieces, for code that reads or writes them itself: the surface the DCP adapters use.

``ppe_snapshot.dcp`` maps torch.distributed.checkpoint's plans onto the format without going through
:class:`~ppe_snapshot.engine.Snapshot`: its writer appends payloads to data files and commits a manifest it
builds, its reader looks entries up and reads their chunks. The CLI's ``inspect`` and ``verify`` show and check
entries one by one. They import this module (and :mod:`ppe_snapshot.engine`) and nothing else of the engine.

The manifest and its entries
    :class:`Manifest` (as ``read_manifest`` returns it, or built by a writer; ``check_structure(manifest)``:
    ``CorruptSnapshotError`` unless the entries make whole containers and every value decodes, part of
    ``Snapshot.verify``'s deep check), :class:`Entry` (any of):
    :class:`TensorEntry`, :class:`ShardedTensorEntry` (of :class:`Shard` objects), :class:`BytesEntry`,
    :class:`PickleEntry`, :class:`ObjectEntry`, :class:`ContainerEntry`; :class:`Chunk` (checksummed bytes of a
    data file); ``Raw`` (what a data file holds for a leaf), ``Container`` (a container entry's kinds).
Paths and values
    ``escape`` / ``child_path`` (logical paths), ``inflate`` (rebuild a value from entries), ``leaf_loader``
    (the one loader of a stored value, by its kind), the value encoding (``encode_value``, ``decode_value``,
    ``dtype_name``, ``torch_dtype``, ``can_store_raw``).
Bytes
    ``data_file(rank)`` (the data file a rank writes), ``Payload`` and ``PayloadAppender`` (append payloads to a
    data file, their chunks checksummed), ``needs_bounce`` / ``host_copy_buffer`` (a tensor written through a
    host copy), ``is_direct``, ``tensor_bytes``, ``read_into`` (verified reads of chunks), ``DeviceReads`` over a
    ``ReadBatch`` (verified reads into device tensors, pipelined through page-locked buffers).
Incremental writes
    ``write_pieces(storage, file, pieces, base, storage_options)``: a data file whose pieces unchanged since
    snapshot ``base`` are referenced, not written (``base=`` of the DCP writer); ``block_size(block_bytes)``: the
    block size a write uses (its chunks' largest size; None: the settings'); ``referenced_bytes(manifest)``: the
    bytes of other snapshots' data files a snapshot reads (``ls``, ``inspect``).
Committing
    ``new_take_id()``, ``refuse_overwrite(storage)``, ``commit_manifest(storage, manifest)`` (checks it restores,
    then writes it in the format version takes write, the manifest last).
"""
from ppe_snapshot.engine._files import (
    DeviceReads, PayloadAppender, ReadBatch, host_copy_buffer, is_direct, needs_bounce, read_into, tensor_bytes,
)
from ppe_snapshot.engine._format import (
    BytesEntry, Chunk, Container, ContainerEntry, Entry, Manifest, ObjectEntry, PickleEntry, Raw, Shard,
    ShardedTensorEntry, TensorEntry, can_store_raw, data_file, decode_value, dtype_name, encode_value, new_take_id,
    torch_dtype,
)
from ppe_snapshot.engine._restore import leaf_loader
from ppe_snapshot.engine._state import Payload, child_path, escape, inflate
from ppe_snapshot.engine._take import block_size, write_pieces
from ppe_snapshot.engine._versions import (
    check_structure, commit as commit_manifest, referenced_bytes, refuse_overwrite,
)

__all__ = [
    # the manifest and its entries
    "BytesEntry", "Chunk", "Container", "ContainerEntry", "Entry", "Manifest", "ObjectEntry", "PickleEntry", "Raw",
    "Shard", "ShardedTensorEntry", "TensorEntry", "check_structure",
    # paths and values
    "can_store_raw", "child_path", "decode_value", "dtype_name", "encode_value", "escape", "inflate", "leaf_loader",
    "torch_dtype",
    # bytes
    "DeviceReads", "Payload", "PayloadAppender", "ReadBatch", "data_file", "host_copy_buffer", "is_direct",
    "needs_bounce", "read_into", "tensor_bytes",
    # committing
    "commit_manifest", "new_take_id", "refuse_overwrite",
    # incremental writes
    "block_size", "referenced_bytes", "write_pieces",
]
