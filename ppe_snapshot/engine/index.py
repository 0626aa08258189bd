"""Index files of format version 2: one section of a manifest's entries in columns (``docs/format.md``, section 11).

An index file is ``magic | header length | JSON header | padding | column bytes | xxh3_64 of all before``.
The header names the take, the data files its chunks name (with their sizes), a table of dtypes, the paths of
its tensor entries (one row each in the columns), every other entry as version-1 JSON, and, in a rank's index,
the sharded tensors it holds shards of. The columns are little-endian numpy arrays: per tensor its dtype id,
its number of dimensions and where its chunks end; the dimensions of all tensors one after another; per chunk
its file id, offset, size and checksum; per shard its tensor, its box (offsets then sizes) and where its chunks
end. Reading one checks the whole file (:func:`decode_index`) with a few vectorised comparisons; entries are
built only when looked up (:class:`IndexTable`).
"""
from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import xxhash

from ppe_snapshot.engine import jsonio
from ppe_snapshot.engine.format import Kind, Raw
from ppe_snapshot.engine.manifest import (
    Chunk, Entry, Shard, ShardedTensorEntry, TensorEntry, entry_from_json, entry_to_json,
)
from ppe_snapshot.engine.validation import check_entry, dtype_itemsize
from ppe_snapshot.errors import CorruptSnapshotError
from ppe_snapshot.storage import is_safe_relative

MAGIC = b"PPESIDX2"
_HEAD = struct.Struct("<8sQ")
#: Every column: its numpy dtype (little-endian), in the order they follow one another in the file.
COLUMNS: dict[str, str] = {
    "tensor_dtype": "<u4", "tensor_ndim": "<u4", "tensor_chunk_end": "<i8", "dims": "<i8",
    "chunk_file": "<u4", "chunk_offset": "<i8", "chunk_nbytes": "<i8", "chunk_checksum": "<u8",
    "shard_tensor": "<u4", "shard_box": "<i8", "shard_chunk_end": "<i8",
}
#: Offsets, sizes and dimensions beyond this are refused (their sums must not overflow 64 bits).
_MAX_VALUE = 1 << 56


def _hex(values: np.ndarray) -> list[str]:
    return [f"{v:016x}" for v in values.tolist()]


def _unhex(checksum: str) -> int:
    return int(checksum, 16)


class IndexBuilder:
    """Collects one section's entries (and a rank's shards) into the columns of an index file."""

    def __init__(self) -> None:
        self.files: dict[str, int] = {}
        self._file_ids: dict[str, int] = {}
        self._dtypes: dict[tuple[str, str], int] = {}
        self.paths: list[str] = []
        self.others: dict[str, Any] = {}
        self.sharded: list[list[Any]] = []
        self._cols: dict[str, list[int]] = {name: [] for name in COLUMNS}
        self._chunks_after_tensors = 0

    def add_file(self, name: str, files: Mapping[str, int]) -> int:
        """The id of data file ``name`` in this index's file table (added with its size from ``files``)."""
        fid = self._file_ids.get(name)
        if fid is None:
            fid = self._file_ids[name] = len(self._file_ids)
            self.files[name] = files[name]
        return fid

    def _add_chunks(self, chunks: list[Chunk], files: Mapping[str, int]) -> None:
        cols = self._cols
        for c in chunks:
            cols["chunk_file"].append(self.add_file(c.file, files))
            cols["chunk_offset"].append(c.offset)
            cols["chunk_nbytes"].append(c.nbytes)
            cols["chunk_checksum"].append(_unhex(c.checksum))

    def add(self, path: str, entry: Entry, files: Mapping[str, int]) -> None:
        """One entry: a tensor entry goes to the columns, anything else to the header as version-1 JSON."""
        if type(entry) is not TensorEntry:
            self.others[path] = entry_to_json(entry)
            for chunk in _entry_chunks(entry):
                self.add_file(chunk.file, files)
            return
        key = (entry.kind, entry.dtype)
        did = self._dtypes.get(key)
        if did is None:
            did = self._dtypes[key] = len(self._dtypes)
        cols = self._cols
        self.paths.append(path)
        cols["tensor_dtype"].append(did)
        cols["tensor_ndim"].append(len(entry.shape))
        cols["dims"].extend(entry.shape)
        chunks = entry.chunks
        if len(chunks) == 1:  # most tensors: inline
            c = chunks[0]
            fid = self._file_ids.get(c.file)
            cols["chunk_file"].append(fid if fid is not None else self.add_file(c.file, files))
            cols["chunk_offset"].append(c.offset)
            cols["chunk_nbytes"].append(c.nbytes)
            cols["chunk_checksum"].append(int(c.checksum, 16))
        else:
            self._add_chunks(chunks, files)
        cols["tensor_chunk_end"].append(len(cols["chunk_file"]))

    def add_shards(self, path: str, dtype: str, shape: list[int], shards: list[Shard],
                   files: Mapping[str, int]) -> None:
        """The shards of sharded tensor ``path`` that this rank wrote (after every tensor)."""
        tid = len(self.sharded)
        self.sharded.append([path, dtype, list(shape)])
        cols = self._cols
        for shard in shards:
            cols["shard_tensor"].append(tid)
            cols["shard_box"].extend(shard.offsets)
            cols["shard_box"].extend(shard.sizes)
            self._add_chunks(shard.chunks, files)
            cols["shard_chunk_end"].append(len(cols["chunk_file"]))

    def to_bytes(self, take_id: str, section: str, rank: int | None = None, extra: dict[str, Any] | None = None
                 ) -> bytes:
        arrays = {name: np.asarray(values, dtype=COLUMNS[name]) for name, values in self._cols.items()}
        header = {"take_id": take_id, "section": section, "rank": rank, "files": [[n, s] for n, s in self.files.items()],
                  "dtypes": [list(k) for k in self._dtypes], "tensors": self.paths, "entries": self.others,
                  "sharded": self.sharded, "columns": {name: len(a) for name, a in arrays.items()}, **(extra or {})}
        return encode(header, arrays)


def _entry_chunks(entry: Entry) -> list[Chunk]:
    if isinstance(entry, ShardedTensorEntry):
        return [c for s in entry.shards for c in s.chunks]
    return list(getattr(entry, "chunks", []))


def encode(header: dict[str, Any], arrays: dict[str, np.ndarray]) -> bytes:
    head = jsonio.dumps(header)
    pieces = [_HEAD.pack(MAGIC, len(head)), head, bytes(-(len(head) + _HEAD.size) % 8)]
    pieces += [arrays[name].astype(COLUMNS[name], copy=False).tobytes() for name in COLUMNS]
    body = b"".join(pieces)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


class Index:
    """A decoded, checked index file: its header and its columns (read-only numpy views of the bytes)."""

    def __init__(self, header: dict[str, Any], cols: dict[str, np.ndarray], files: dict[str, int],
                 itemsizes: np.ndarray) -> None:
        self.header, self.cols, self.files, self.itemsizes = header, cols, files, itemsizes
        self.file_names: list[str] = list(files)
        self.tensor_rows = {path: i for i, path in enumerate(header["tensors"])}
        ends = cols["tensor_chunk_end"]
        self.tensor_chunk_start = np.concatenate(([0], ends[:-1])) if len(ends) else ends
        dims_end = np.cumsum(cols["tensor_ndim"], dtype=np.int64)
        self.dims_start = dims_end - cols["tensor_ndim"]
        #: The sharded tensors this index lists: path -> [path, dtype, shape].
        self.sharded_rows: dict[str, list[Any]] = {s[0]: s for s in header["sharded"]}
        self._shards: dict[str, list[Shard]] | None = None

    def shards(self) -> dict[str, list[Shard]]:
        """The shards this index holds, by sharded tensor path (built once)."""
        if self._shards is None:
            self._shards = shards_by_tensor(self)
        return self._shards


def _bad(where: str, problem: str) -> CorruptSnapshotError:
    return CorruptSnapshotError(f"{where} is malformed: {problem}; the snapshot is damaged")


def decode_index(data: bytes, where: str, take_id: str, section: str, rank: int | None = None) -> Index:
    """Parse and check an index file: everything a reader must refuse (docs/format.md, section 8) that can be
    seen in the file alone. Entries of version-1 JSON are checked when looked up (:class:`IndexTable`)."""
    if len(data) < _HEAD.size + 8 or data[:8] != MAGIC:
        raise _bad(where, "it is not a ppe-snapshot index file")
    (stored,) = struct.unpack_from("<Q", data, len(data) - 8)
    if xxhash.xxh3_64_intdigest(memoryview(data)[:-8]) != stored:
        raise _bad(where, "its checksum does not match its bytes")
    _, head_len = _HEAD.unpack_from(data)
    body_start = _HEAD.size + head_len + (-(head_len + _HEAD.size) % 8)
    if body_start > len(data) - 8:
        raise _bad(where, "its header runs past its end")
    try:
        header = jsonio.loads(bytes(data[_HEAD.size:_HEAD.size + head_len]))
    except ValueError as e:
        raise _bad(where, f"its header is not JSON ({e})") from None
    problem = _header_problem(header, take_id, section, rank)
    if problem:
        raise _bad(where, problem)
    cols, position = {}, body_start
    for name, dtype in COLUMNS.items():
        count = header["columns"][name]
        nbytes = count * 8 if dtype.endswith("8") else count * 4
        if position + nbytes > len(data) - 8:
            raise _bad(where, f"column {name} runs past the end of the file")
        cols[name] = np.frombuffer(data, dtype=dtype, count=count, offset=position)
        position += nbytes
    if position != len(data) - 8:
        raise _bad(where, "it holds bytes after its last column")
    files = dict((name, size) for name, size in header["files"])
    try:
        itemsizes = np.array([dtype_itemsize(kind, name) for kind, name in header["dtypes"]], dtype=np.int64)
    except CorruptSnapshotError as e:
        raise _bad(where, str(e)) from None
    problem = _columns_problem(header, cols, files, itemsizes)
    if problem:
        raise _bad(where, problem)
    return Index(header, cols, files, itemsizes)


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value < _MAX_VALUE


def _header_problem(header: Any, take_id: str, section: str, rank: int | None) -> str | None:
    if type(header) is not dict:
        return "its header is not an object"
    if header.get("take_id") != take_id or header.get("section") != section or header.get("rank") != rank:
        return (f"it belongs to take {header.get('take_id')!r:.40}, section {header.get('section')!r:.40}, rank "
                f"{header.get('rank')!r:.20}, not to take {take_id!r}, section {section!r}, rank {rank!r} of the "
                "manifest (a leftover of another take?)")
    files, dtypes, tensors = header.get("files"), header.get("dtypes"), header.get("tensors")
    entries, sharded, columns = header.get("entries"), header.get("sharded"), header.get("columns")
    if type(files) is not list or not all(type(f) is list and len(f) == 2 and _is_count(f[1]) for f in files):
        return "files is not a list of [name, size] pairs"
    names = [f[0] for f in files]
    for name in names:
        if not is_safe_relative(name):
            return (f"data file name {name!r:.200} is not a normalised relative path inside the snapshot "
                    "(no '..', '.', empty or absolute parts, no backslashes)")
    if len(set(names)) != len(names):
        return "a data file is listed twice"
    if type(dtypes) is not list or not all(type(d) is list and len(d) == 2 and all(type(x) is str for x in d)
                                           for d in dtypes):
        return "dtypes is not a list of [kind, name] pairs"
    if type(tensors) is not list or not all(type(p) is str for p in tensors) or len(set(tensors)) != len(tensors):
        return "tensors is not a list of distinct paths"
    if type(entries) is not dict or any(p in entries for p in tensors):
        return "entries is not an object of paths other than the tensors'"
    if type(sharded) is not list or not all(
            type(s) is list and len(s) == 3 and type(s[0]) is str and type(s[1]) is str and type(s[2]) is list
            and all(_is_count(n) for n in s[2]) for s in sharded):
        return "sharded is not a list of [path, dtype, shape] triples"
    if type(columns) is not dict or set(columns) != set(COLUMNS) or not all(_is_count(n) for n in columns.values()):
        return f"columns is not an object of the counts of {sorted(COLUMNS)}"
    return None


def _columns_problem(header: dict[str, Any], cols: dict[str, np.ndarray], files: dict[str, int],
                     itemsizes: np.ndarray) -> str | None:
    n_tensors, n_chunks, n_shards = len(header["tensors"]), len(cols["chunk_file"]), len(cols["shard_tensor"])
    if not (len(cols["tensor_dtype"]) == len(cols["tensor_ndim"]) == len(cols["tensor_chunk_end"]) == n_tensors):
        return "its tensor columns do not have one row per tensor"
    if not (len(cols["chunk_offset"]) == len(cols["chunk_nbytes"]) == len(cols["chunk_checksum"]) == n_chunks):
        return "its chunk columns differ in length"
    if len(cols["shard_chunk_end"]) != n_shards:
        return "its shard columns differ in length"
    if n_tensors and (cols["tensor_dtype"] >= len(itemsizes)).any():
        return "a tensor names a dtype beyond the dtype table"
    if int(cols["tensor_ndim"].sum(dtype=np.int64)) != len(cols["dims"]):
        return "the tensors' numbers of dimensions do not add up to the dimensions listed"
    ends = np.concatenate((cols["tensor_chunk_end"], cols["shard_chunk_end"]))
    if len(ends) and ((np.diff(ends) < 0).any() or ends[0] < 0 or ends[-1] != n_chunks):
        return "the chunk ranges of its tensors and shards are not consecutive"
    if not len(ends) and n_chunks:
        return "it lists chunks of no entry"
    offset, nbytes = cols["chunk_offset"], cols["chunk_nbytes"]
    if n_chunks:
        if (cols["chunk_file"] >= len(files)).any():
            return "a chunk names a data file beyond the file table"
        if (offset < 0).any() or (nbytes < 0).any() or (offset >= _MAX_VALUE).any() or (nbytes >= _MAX_VALUE).any():
            return "a chunk's offset or size is negative or out of range"
        sizes = np.array(list(files.values()), dtype=np.int64)
        beyond = np.flatnonzero(offset + nbytes > sizes[cols["chunk_file"]])
        if len(beyond):
            i = int(beyond[0])
            return (f"a chunk claims bytes {int(offset[i])}..{int(offset[i] + nbytes[i])} of "
                    f"{list(files)[int(cols['chunk_file'][i])]}, beyond its recorded size")
    dims = cols["dims"]
    if len(dims) and ((dims < 0).any() or (dims >= _MAX_VALUE).any()):
        return "a tensor's shape holds a negative or out-of-range size"
    stored = np.concatenate(([0], np.cumsum(nbytes, dtype=np.int64)))
    if n_tensors:
        tensor_ends = cols["tensor_chunk_end"]
        held = stored[tensor_ends] - stored[np.concatenate(([0], tensor_ends[:-1]))]
        need = _segment_products(dims, cols["tensor_ndim"]) * itemsizes[cols["tensor_dtype"]]
        wrong = np.flatnonzero(held != need)
        if len(wrong):
            i = int(wrong[0])
            return (f"tensor {header['tensors'][i]!r:.200}: its chunks hold {int(held[i])} bytes, but its shape "
                    f"and dtype need {need[i]}")
    return _shards_problem(header, cols, stored) if n_shards or header["sharded"] else None


def _segment_products(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The product of each run of ``lengths[i]`` consecutive ``values`` (1 for an empty run); Python ints (an
    object array) where one could overflow 64 bits: a crafted shape must not wrap around to a small size."""
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64) if len(lengths) else \
        np.zeros(0, dtype=np.int64)
    bits = np.concatenate(([0.0], np.cumsum(np.log2(np.maximum(values, 1).astype(np.float64)))))
    if ((bits[starts + lengths] - bits[starts]) < 60).all():
        out = np.ones(len(lengths), dtype=np.int64)
        nonempty = lengths > 0
        if nonempty.any():
            s, n = starts[nonempty], lengths[nonempty].astype(np.int64)
            bounds = np.empty(2 * len(s), dtype=np.int64)
            bounds[0::2], bounds[1::2] = s, s + n  # reduceat multiplies from each bound up to the next
            out[nonempty] = np.multiply.reduceat(np.append(values, 1), bounds)[0::2]
        return out
    out = np.ones(len(lengths), dtype=object)
    for i, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        for v in values[s:s + n].tolist():
            out[i] *= v
    return out


def _shards_problem(header: dict[str, Any], cols: dict[str, np.ndarray], stored: np.ndarray) -> str | None:
    sharded = header["sharded"]
    if len(set(s[0] for s in sharded)) != len(sharded):
        return "a sharded tensor is listed twice"
    tensor = cols["shard_tensor"]
    if len(tensor) and (tensor >= len(sharded)).any():
        return "a shard names a sharded tensor beyond the table"
    try:
        itemsizes = [dtype_itemsize(Raw.TENSOR, s[1]) for s in sharded]
    except CorruptSnapshotError as e:
        return str(e)
    box, position = cols["shard_box"], 0
    first = len(cols["tensor_chunk_end"]) and int(cols["tensor_chunk_end"][-1])
    starts = np.concatenate(([first], cols["shard_chunk_end"][:-1])) if len(tensor) else []
    for i, (t, start, end) in enumerate(zip(tensor.tolist(), list(starts), cols["shard_chunk_end"].tolist())):
        path, dtype, shape = sharded[t]
        ndim = len(shape)
        if position + 2 * ndim > len(box):
            return "the shards' boxes run past the box column"
        offsets, sizes = box[position:position + ndim].tolist(), box[position + ndim:position + 2 * ndim].tolist()
        position += 2 * ndim
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape)):
            return f"{path!r:.200}: shard {i} (offsets {offsets}, sizes {sizes}) does not lie within {shape}"
        count = 1
        for s in sizes:
            count *= s
        if int(stored[end] - stored[int(start)]) != count * itemsizes[t]:
            return f"{path!r:.200}: shard {i}'s chunks do not hold its {sizes} elements of {dtype}"
    if position != len(box):
        return "the box column holds more than the shards' boxes"
    return None


class IndexTable(Mapping[str, Entry]):
    """The entries of one index file by path, built when looked up (the file was checked when decoded)."""

    def __init__(self, index: Index, where: str, replicated: bool) -> None:
        self._index, self._where, self._replicated = index, where, replicated
        self.index = index
        self._others: dict[str, Any] = index.header["entries"]
        self._decoded: dict[str, Entry] = {}
        self.files = index.files

    def get(self, path: str, default: Any = None) -> Any:  # type: ignore[override]
        entry = self._decoded.get(path)
        if entry is not None:
            return entry
        row = self._index.tensor_rows.get(path)
        if row is not None:
            entry = self._tensor(row)
        else:
            data = self._others.get(path)
            if data is None:
                return default
            try:
                check_entry(data, self._index.files)
            except CorruptSnapshotError as e:
                raise CorruptSnapshotError(f"{self._where}: entry {path!r} is malformed: {e}; the snapshot is "
                                           "damaged") from None
            entry = entry_from_json(data)
        self._decoded[path] = entry
        return entry

    def _tensor(self, row: int) -> TensorEntry:
        index, cols = self._index, self._index.cols
        kind, dtype = index.header["dtypes"][int(cols["tensor_dtype"][row])]
        start, end = int(index.tensor_chunk_start[row]), int(cols["tensor_chunk_end"][row])
        d0 = int(index.dims_start[row])
        shape = cols["dims"][d0:d0 + int(cols["tensor_ndim"][row])].tolist()
        return TensorEntry(dtype, shape, chunk_list(index, start, end), kind, self._replicated)

    def __getitem__(self, path: str) -> Entry:
        entry = self.get(path)
        if entry is None:
            raise KeyError(path)
        return entry

    def check_all(self) -> None:
        for path in self._others:
            self.get(path)

    def __contains__(self, path: object) -> bool:
        return path in self._index.tensor_rows or path in self._others

    def __iter__(self) -> Iterator[str]:
        yield from self._index.header["tensors"]
        yield from self._others

    def __len__(self) -> int:
        return len(self._index.tensor_rows) + len(self._others)


def chunk_list(index: Index, start: int, end: int) -> list[Chunk]:
    cols, names = index.cols, index.file_names
    return [Chunk(names[f], o, n, c) for f, o, n, c in zip(
        cols["chunk_file"][start:end].tolist(), cols["chunk_offset"][start:end].tolist(),
        cols["chunk_nbytes"][start:end].tolist(), _hex(cols["chunk_checksum"][start:end]))]


def shards_by_tensor(index: Index) -> dict[str, list[Shard]]:
    """The shards an index holds, by sharded tensor path (every tensor of its table, maybe with none)."""
    sharded, cols = index.header["sharded"], index.cols
    out: dict[str, list[Shard]] = {s[0]: [] for s in sharded}
    first = len(cols["tensor_chunk_end"]) and int(cols["tensor_chunk_end"][-1])
    box, position, start = cols["shard_box"].tolist(), 0, first
    for t, end in zip(cols["shard_tensor"].tolist(), cols["shard_chunk_end"].tolist()):
        ndim = len(sharded[t][2])
        out[sharded[t][0]].append(Shard(box[position:position + ndim], box[position + ndim:position + 2 * ndim],
                                        chunk_list(index, start, end)))
        position, start = position + 2 * ndim, end
    return out
