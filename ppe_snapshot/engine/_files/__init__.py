"""Data files: their layout and writing (``packing``), verified reads of their chunks (``reads``), reads into
device tensors through page-locked buffers (``device_reads``), and the checksums of many chunks in one call that
leaves the GIL (``chunk_hashes``).

The face of this subpackage: what the rest of the engine uses of it (modules here import each other directly).
"""
from ppe_snapshot.engine._files.chunk_hashes import HashesAfterRead, hash_addresses
from ppe_snapshot.engine._files.device_reads import DeviceReads, host_buffer
from ppe_snapshot.engine._files.packing import (
    ALIGNMENT, CHUNK_BYTES, FileLayout, PayloadAppender, Written, align, checksum, chunk_limit, host_copy_buffer,
    is_copyable_raw, is_direct, lay_out, needs_bounce, payload_chunks, tensor_bytes, write_from_sources,
)
from ppe_snapshot.engine._files.reads import (
    ChunkReader, ReadBatch, check_stored, coalesced, fill, mismatch_error, read_addresses_into, read_file_into,
    read_into, read_through_host, verify_chunks,
)

__all__ = [
    "align", "ALIGNMENT", "check_stored", "checksum", "CHUNK_BYTES", "chunk_limit", "ChunkReader", "coalesced",
    "DeviceReads", "FileLayout", "fill", "hash_addresses", "HashesAfterRead", "host_buffer", "host_copy_buffer",
    "is_copyable_raw", "is_direct", "lay_out", "mismatch_error", "needs_bounce", "payload_chunks",
    "PayloadAppender", "read_addresses_into", "read_file_into", "read_into", "read_through_host", "ReadBatch",
    "tensor_bytes", "verify_chunks", "write_from_sources", "Written",
]
