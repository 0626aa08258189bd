"""The bytes on disk and their checks: names and ids, JSON, value encoding, the manifest and its entries,
entry columns, index files, what a reader refuses.

The face of this subpackage: what the rest of the engine uses of it (modules here import each other directly).
"""
from ppe_snapshot.engine._format.entry_columns import EntryColumns, ShapeColumns, dtype_key
from ppe_snapshot.engine._format.index import Index, IndexBuilder, IndexTable, chunk_list, decode_index
from ppe_snapshot.engine._format.jsonio import dumps as dump_json, loads as load_json
from ppe_snapshot.engine._format.manifest import (
    BytesEntry, Chunk, ContainerEntry, Entry, LazyEntries, Manifest, ObjectEntry, PickleEntry, Shard,
    ShardedTensorEntry, TensorEntry, commit_stamp, entries_from_json, entries_to_json, entry_to_json, parse_document,
    read_stamp,
)
from ppe_snapshot.engine._format.names import (
    DEFAULT_VERSION, INCREMENTAL_VERSION, INDEX_DIR, MANIFEST_NAME, PARTS_DIR, RETIRED_NAME, SHARED_INDEX, Container,
    Raw, abort_name, data_file, data_file_rank, detail_name, new_take_id, parse_parts_name, part_name, rank_index,
    takes_in_progress,
)
from ppe_snapshot.engine._format.serialization import (
    PLAIN_TENSOR_TYPES, RAW_DTYPE_NAMES, can_store_raw, decode_value, dtype_name, encode_value, is_raw_array,
    memory_problem, raw_storage_problem, torch_dtype,
)
from ppe_snapshot.engine._format.validation import (
    CHECKSUM_ALGORITHM, FORMAT_NAME, document_problem, document_v2_problem, document_v3_problem,
)

__all__ = [
    "abort_name", "BytesEntry", "can_store_raw", "CHECKSUM_ALGORITHM", "Chunk", "chunk_list", "commit_stamp",
    "Container", "ContainerEntry", "data_file", "data_file_rank", "decode_index", "decode_value", "DEFAULT_VERSION",
    "detail_name", "document_problem", "document_v2_problem", "document_v3_problem", "dtype_key", "dtype_name",
    "dump_json", "encode_value", "entries_from_json", "entries_to_json", "Entry", "entry_to_json", "EntryColumns",
    "FORMAT_NAME", "INCREMENTAL_VERSION", "Index", "INDEX_DIR", "IndexBuilder", "IndexTable", "is_raw_array",
    "LazyEntries", "load_json", "Manifest", "MANIFEST_NAME", "memory_problem", "new_take_id", "ObjectEntry",
    "parse_document", "parse_parts_name", "part_name", "PARTS_DIR", "PickleEntry", "PLAIN_TENSOR_TYPES", "rank_index",
    "Raw", "RAW_DTYPE_NAMES", "raw_storage_problem", "read_stamp", "RETIRED_NAME", "ShapeColumns", "Shard",
    "ShardedTensorEntry", "SHARED_INDEX", "takes_in_progress", "TensorEntry", "torch_dtype",
]
