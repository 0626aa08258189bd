"""Every check a reader makes on a manifest before it uses anything in it.

A snapshot is untrusted input (``docs/format.md``, "What a reader must
refuse"): a malformed manifest must fail with :class:`CorruptSnapshotError`
saying what is wrong, and no entry may make the reader return wrong data,
size an allocation beyond the bytes recorded for the data files, or name a
file outside the snapshot. The checks run on the parsed JSON, before any
object is built from it: the document's top level when it is parsed
(:func:`check_document`), each entry when it is first decoded or when all of
them are checked (:func:`check_entry`). Manifests hold thousands of entries
and a restore decodes them lazily, so the entry checks are a few type tests
and sums per entry.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, TypeVar

import numpy as np

from ppe_snapshot.engine._format.names import FORMAT_VERSION, Container, EntryType, Raw
from ppe_snapshot.engine._format.serialization import decode_value, torch_dtype
from ppe_snapshot.errors import CorruptSnapshotError, UnsupportedFormatError
from ppe_snapshot.storage import is_safe_relative

#: Offsets, sizes, dimensions and world sizes from this up are refused (their sums must not overflow 64 bits).
MAX_VALUE = 1 << 56

FORMAT_NAME = "ppe-snapshot"
CHECKSUM_ALGORITHM = "xxh3_64"

_CONTAINER_KINDS = frozenset({Container.DICT, Container.ORDERED_DICT, Container.LIST, Container.TUPLE})
_FIELDS = {
    EntryType.TENSOR: frozenset({"type", "dtype", "shape", "chunks", "kind", "replicated"}),
    EntryType.SHARDED: frozenset({"type", "dtype", "shape", "shards", "replicated"}),
    EntryType.OBJECT: frozenset({"type", "value", "replicated"}),
    EntryType.PICKLE: frozenset({"type", "chunks", "replicated"}),
    EntryType.BYTES: frozenset({"type", "chunks", "replicated"}),
    EntryType.CONTAINER: frozenset({"type", "kind", "keys", "length", "replicated"}),
}
TupleT = TypeVar("TupleT", bound=tuple)
# A chunk's fields in the order of manifest.Chunk, fetched at once; tuple.__new__ builds the named tuple
# without its Python-level __new__ (for 5,000 entries, a third of their decoding time).
_CHUNK_FIELDS = operator.itemgetter("file", "offset", "nbytes", "checksum")
_new_tuple = tuple.__new__
# Element sizes by dtype name, filled on first use (only with names that passed the check).
_TORCH_ITEMSIZES: dict[str, int] = {}
_ARRAY_ITEMSIZES: dict[str, int] = {}


def _is_count(value: Any) -> bool:
    """A non-negative JSON integer (``true`` is not one, nor ``1.0``)."""
    return type(value) is int and value >= 0


# -- the document -----------------------------------------------------------------------------------

def check_document(doc: Any, where: str) -> None:
    """Check what every version's manifest has at its top level: format, version and checksum algorithm (the
    fields of each version: ``_versions/table.read_manifest``, with :func:`document_problem` or
    :func:`document_v2_problem`)."""
    if type(doc) is not dict or doc.get("format") != FORMAT_NAME:
        raise CorruptSnapshotError(f"{where} is not a {FORMAT_NAME} manifest")
    version = doc.get("version")
    if type(version) is not int or version < 1:
        raise CorruptSnapshotError(f"{where} is malformed: its version {version!r:.60} is not a positive "
                                   "integer; the snapshot is damaged")
    if version > FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"{where} has format version {version!r}, newer than the {FORMAT_VERSION} this "
            "ppe-snapshot reads; upgrade ppe-snapshot to read it")
    if doc.get("checksum_algorithm") != CHECKSUM_ALGORITHM:
        raise UnsupportedFormatError(f"{where} uses checksum {doc.get('checksum_algorithm')!r}, "
                                     f"this ppe-snapshot knows only {CHECKSUM_ALGORITHM!r}")


def document_v2_problem(doc: dict[str, Any]) -> str | None:
    """What is wrong with a version-2 manifest's fields (its entries are in index files: ``_versions/manifest_v2.py``,
    ``index.py``); None when nothing is."""
    world_size, take_id = doc.get("world_size"), doc.get("take_id")
    if type(world_size) is not int or not 1 <= world_size < MAX_VALUE:
        return f"world_size {world_size!r:.60} is not a positive integer below 2^56"
    if type(take_id) is not str or not take_id:
        return "take_id is not a non-empty string"
    if type(doc.get("metadata", {})) is not dict:
        return "metadata is not an object"
    return None


def document_v3_problem(doc: dict[str, Any]) -> str | None:
    """What is wrong with a version-3 (incremental) manifest's fields: version 2's, and ``references``."""
    references = doc.get("references")
    if type(references) is not list or not all(is_safe_relative(name) and "/" not in name for name in references) \
            or len(set(references)) != len(references):
        return "references is not a list of distinct snapshot names (one path segment each)"
    return document_v2_problem(doc)


def document_problem(doc: dict[str, Any]) -> str | None:
    """What is wrong with a version-1 manifest's fields (every entry's checked when decoded); None when nothing is."""
    for name in ("world_size", "ranks", "replicated", "files"):
        if name not in doc:
            return f"field {name!r} is missing"
    world_size, ranks = doc["world_size"], doc["ranks"]
    if type(world_size) is not int or world_size < 1:
        return f"world_size {world_size!r:.60} is not a positive integer"
    if type(ranks) is not list or len(ranks) != world_size:
        return f"ranks is not a list of world_size ({world_size}) objects"
    for rank, entries in enumerate(ranks):
        if type(entries) is not dict:
            return f"ranks[{rank}] is not an object"
    for name in ("replicated", "sharded", "metadata"):
        if type(doc.get(name, {})) is not dict:
            return f"{name} is not an object"
    if type(doc.get("take_id", "")) is not str:
        return "take_id is not a string"
    files = doc["files"]
    if type(files) is not dict:
        return "files is not an object of data file names and sizes"
    for name, size in files.items():
        if not is_safe_relative(name):
            return (f"data file name {name!r:.200} is not a normalised relative path inside the snapshot "
                    "(no '..', '.', empty or absolute parts, no backslashes)")
        if not _is_count(size):
            return f"the size of data file {name!r} is {size!r:.60}, not a non-negative integer"
    return None


# -- entries ----------------------------------------------------------------------------------------

def check_entry(data: Any, files: dict[str, int], only: str | None = None) -> None:
    """Check one entry's JSON against the format and against ``files`` (the manifest's data file sizes).

    Raises :class:`CorruptSnapshotError` with the reason; the caller names the entry. ``only``
    restricts the entry's type (the ``sharded`` section holds sharded entries only).
    """
    if only is not None or tensor_chunks(data, files, tuple) is None:
        _check_thoroughly(data, files, only)


def tensor_chunks(data: Any, files: dict[str, int], chunk_type: type[TupleT]) -> list[TupleT] | None:
    """The chunks of a tensor entry that passes every check, built as ``chunk_type(file, offset, nbytes,
    checksum)`` tuples; None for any other entry, and for one the quick way does not accept (then
    :func:`check_entry` must look, and say what is wrong).

    Every check of :func:`_check_thoroughly` on a tensor entry, in one pass that also builds its chunks:
    a manifest holds thousands, and a restore checks and decodes each as it goes.
    """
    if type(data) is not dict or data.get("type") != EntryType.TENSOR:
        return None
    try:
        kind, replicated = data.get("kind"), data.get("replicated")
        # No unknown fields: type, dtype, shape and chunks are read below, so their count says it.
        if len(data) != 4 + (kind is not None) + (replicated is not None) or (
                replicated is not None and type(replicated) is not bool):
            return None
        itemsizes = (_TORCH_ITEMSIZES if kind is None or kind == Raw.TENSOR
                     else _ARRAY_ITEMSIZES if kind == Raw.NDARRAY else {})
        missing = itemsizes.get(data["dtype"])  # a dtype seen before; the thorough check adds new ones
        shape, chunks = data["shape"], data["chunks"]
        if missing is None or type(shape) is not list or type(chunks) is not list:
            return None
        for size in shape:
            if type(size) is not int or size < 0:
                return None
            missing *= size
        out = []
        for chunk in chunks:
            fields = _CHUNK_FIELDS(chunk)
            file, offset, nbytes, checksum = fields
            if (type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0
                    or offset + nbytes > files.get(file, -1) or type(checksum) is not str):
                return None
            missing -= nbytes
            out.append(_new_tuple(chunk_type, fields))
    except (KeyError, TypeError):  # a field missing, or of the wrong type
        return None
    return out if missing == 0 else None


#: What JSON calls the values Python parses it into.
_JSON_KINDS = {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string", list: "list"}


def _check_thoroughly(data: Any, files: dict[str, int], only: str | None) -> None:
    if type(data) is not dict:
        raise CorruptSnapshotError(f"it is a JSON {_JSON_KINDS.get(type(data), type(data).__name__)}, not an object")
    kind = data.get("type")
    fields = _FIELDS.get(kind) if type(kind) is str else None
    if fields is None or (only is not None and kind != only):
        raise CorruptSnapshotError(f"its type {kind!r:.60} is not " + (repr(only) if only else "a known entry type"))
    if not data.keys() <= fields:
        raise CorruptSnapshotError(f"unknown fields {sorted(data.keys() - fields)!r:.200}")
    if type(data.get("replicated", False)) is not bool:
        raise CorruptSnapshotError("replicated is not a boolean")
    try:
        _CHECKS[kind](data, files)
    except KeyError as e:
        raise CorruptSnapshotError(f"field {e.args[0]!r} is missing") from None
    except TypeError as e:  # a field of the wrong JSON type met an operation (an unhashable dtype, ...)
        raise CorruptSnapshotError(f"a field has the wrong type ({e})") from None


def _itemsize(kind: str, dtype: Any) -> int:
    """The element size of a tensor's (torch name) or array's (numpy ``dtype.str``) dtype."""
    if kind == Raw.TENSOR:
        size = _TORCH_ITEMSIZES.get(dtype)
        if size is None:
            size = _TORCH_ITEMSIZES[dtype] = torch_dtype(dtype).itemsize
        return size
    if kind != Raw.NDARRAY:
        raise CorruptSnapshotError(f"kind {kind!r:.60} is neither 'tensor' nor 'ndarray'")
    size = _ARRAY_ITEMSIZES.get(dtype)
    if size is None:
        try:
            np_dtype = np.dtype(dtype) if type(dtype) is str else None
        except Exception:  # numpy parses the text its own way; anything it refuses is not a dtype here
            np_dtype = None
        if np_dtype is None or np_dtype.hasobject:
            raise CorruptSnapshotError(f"dtype {dtype!r:.60} is not a numpy dtype of plain data")
        size = _ARRAY_ITEMSIZES[dtype] = np_dtype.itemsize
    return size


def dtype_itemsize(kind: str, dtype: Any) -> int:
    """The element size of a stored dtype (``kind`` ``"tensor"``: a torch name; ``"ndarray"``: numpy's
    ``dtype.str``); raises :class:`CorruptSnapshotError` for a name that is neither."""
    if type(dtype) is not str:
        raise CorruptSnapshotError(f"dtype {dtype!r:.60} is not a name")
    return _itemsize(kind, dtype)


def _element_count(shape: Any, what: str = "shape") -> int:
    if type(shape) is not list:
        raise CorruptSnapshotError(f"{what} {shape!r:.60} is not a list of sizes")
    count = 1
    for size in shape:
        if type(size) is not int or size < 0:
            raise CorruptSnapshotError(f"{what} {shape!r:.60} is not a list of non-negative integers")
        count *= size
    return count


def _chunk_bytes(chunks: Any, files: dict[str, int]) -> int:
    """The bytes the chunks hold, each checked: a data file the manifest lists, inside its recorded size."""
    if type(chunks) is not list:
        raise CorruptSnapshotError("chunks is not a list")
    total = 0
    for chunk in chunks:
        offset, nbytes = chunk["offset"], chunk["nbytes"]
        if (type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0
                or offset + nbytes > files.get(chunk["file"], -1) or type(chunk["checksum"]) is not str):
            raise CorruptSnapshotError(_chunk_problem(chunk, files))
        total += nbytes
    return total


def _chunk_problem(chunk: dict[str, Any], files: dict[str, int]) -> str:
    """Why a chunk failed the check of :func:`_chunk_bytes` (the slow way: only on failure)."""
    file, offset, nbytes = chunk["file"], chunk["offset"], chunk["nbytes"]
    if not _is_count(offset) or not _is_count(nbytes):
        return f"a chunk's offset {offset!r:.60} or nbytes {nbytes!r:.60} is not a non-negative integer"
    if type(chunk["checksum"]) is not str:
        return "a chunk's checksum is not a string"
    if file not in files:
        return f"a chunk names data file {file!r:.200}, which is not among the manifest's files"
    return (f"a chunk claims bytes {offset}..{offset + nbytes} of {file}, beyond its recorded size of "
            f"{files[file]} bytes")


def _check_tensor(data: dict[str, Any], files: dict[str, int]) -> None:
    shape = data["shape"]
    expected = _element_count(shape) * _itemsize(data.get("kind", Raw.TENSOR), data["dtype"])
    stored = _chunk_bytes(data["chunks"], files)
    if stored != expected:
        raise CorruptSnapshotError(
            f"its chunks hold {stored} bytes, but shape {shape} of {data['dtype']} needs {expected}")


def _check_sharded(data: dict[str, Any], files: dict[str, int]) -> None:
    shape, shards = data["shape"], data["shards"]
    total = _element_count(shape)
    itemsize = _itemsize(Raw.TENSOR, data["dtype"])
    if type(shards) is not list:
        raise CorruptSnapshotError("shards is not a list")
    covered = 0
    for index, shard in enumerate(shards):
        offsets, sizes = shard["offsets"], shard["sizes"]
        count = _element_count(sizes, f"shard {index}'s sizes")
        _element_count(offsets, f"shard {index}'s offsets")
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o + s > n for o, s, n in zip(offsets, sizes, shape)):
            raise CorruptSnapshotError(
                f"shard {index} (offsets {offsets}, sizes {sizes}) does not lie within the global shape {shape}")
        stored = _chunk_bytes(shard["chunks"], files)
        if stored != count * itemsize:
            raise CorruptSnapshotError(f"shard {index}'s chunks hold {stored} bytes, but its sizes {sizes} of "
                                       f"{data['dtype']} need {count * itemsize}")
        covered += count
    if covered != total:
        raise CorruptSnapshotError(f"its shards hold {covered} elements, but the global shape {shape} has {total}")


def _check_chunks(data: dict[str, Any], files: dict[str, int]) -> None:
    _chunk_bytes(data["chunks"], files)


def _check_object(data: dict[str, Any], files: dict[str, int]) -> None:
    data["value"]  # noqa: B018 - present; its encoding is checked when decoded (serialization.py)


def _check_container(data: dict[str, Any], files: dict[str, int]) -> None:
    if data["kind"] not in _CONTAINER_KINDS:
        raise CorruptSnapshotError(f"container kind {data['kind']!r:.60} is not one of {sorted(_CONTAINER_KINDS)}")
    keys = data.get("keys", [])
    if type(keys) is not list:
        raise CorruptSnapshotError("keys is not a list")
    if not set(map(type, keys)) <= {str}:  # (a string is a key as it is; others are tagged values)
        for key in keys:
            if type(key) is not str:
                _check_key(key)
    if not _is_count(data.get("length", 0)):
        raise CorruptSnapshotError(f"length {data.get('length')!r:.60} is not a non-negative integer")


def _check_key(encoded: Any) -> None:
    key = decode_value(encoded)
    try:
        hash(key)
    except TypeError:
        raise CorruptSnapshotError(f"a key is a {type(key).__name__} value, which cannot key a dict") from None


_CHECKS: dict[str, Callable[[dict[str, Any], dict[str, int]], None]] = {
    EntryType.TENSOR: _check_tensor, EntryType.SHARDED: _check_sharded, EntryType.OBJECT: _check_object,
    EntryType.PICKLE: _check_chunks, EntryType.BYTES: _check_chunks, EntryType.CONTAINER: _check_container,
}

