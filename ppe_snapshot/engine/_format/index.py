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
from typing import Any, Collection

import numpy as np
import xxhash

from ppe_snapshot.engine._format import jsonio
from ppe_snapshot.engine._format.entry_columns import EntryColumns, ShapeColumns
from ppe_snapshot.engine._format.index_checks import COLUMNS, columns_problem, header_problem
from ppe_snapshot.engine._format.manifest import (
    Chunk, ContainerEntry, Entry, LazyEntries, ObjectEntry, Shard, ShardedTensorEntry, TensorEntry, entry_from_json,
    entry_to_json,
)
from ppe_snapshot.engine._format.validation import check_entry, dtype_itemsize
from ppe_snapshot.errors import CorruptSnapshotError

MAGIC = b"PPESIDX2"
_HEAD = struct.Struct("<8sQ")


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
        #: Each column as its values so far: arrays (a section's tensor rows, see :meth:`add_entries`), then a
        #: list that entry by entry additions extend.
        self._sealed: dict[str, list[np.ndarray]] = {name: [] for name in COLUMNS}
        self._cols: dict[str, list[int]] = {name: [] for name in COLUMNS}
        self._chunks_sealed = 0

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
        cols["tensor_chunk_end"].append(self._chunk_count())

    def add_entries(self, entries: Mapping[str, Entry], files: Mapping[str, int]) -> None:
        """Every entry of ``entries``; the tensor rows of :class:`EntryColumns` go to the columns as they are."""
        if not isinstance(entries, EntryColumns):
            for path, entry in entries.items():
                self.add(path, entry, files)
            return
        for path, entry in entries.objects.items():
            self.add(path, entry, files)
        count = len(entries.paths)
        if not count:
            return
        fid = self.add_file(entries.file, files)
        ids = {dtype: self._dtypes.setdefault(key, len(self._dtypes)) for dtype, key in entries.dtype_keys().items()}
        self.paths += entries.paths
        first = self._chunk_count()
        self._add_arrays(tensor_dtype=np.fromiter(map(ids.__getitem__, entries.dtypes), np.uint32, count),
                         tensor_ndim=entries.shapes.ndims, dims=entries.shapes.dims,
                         chunk_file=np.full(count, fid, dtype=np.uint32), chunk_offset=entries.offsets,
                         chunk_nbytes=entries.nbytes, chunk_checksum=entries.checksums,
                         tensor_chunk_end=np.arange(first + 1, first + count + 1, dtype=np.int64))

    def _chunk_count(self) -> int:
        return self._chunks_sealed + len(self._cols["chunk_file"])

    def _add_arrays(self, **arrays: np.ndarray) -> None:
        """Whole arrays onto the end of columns (after what the lists hold so far)."""
        for name, values in self._cols.items():
            if values:
                self._sealed[name].append(np.asarray(values, dtype=COLUMNS[name]))
                self._cols[name] = []
        for name, array in arrays.items():
            self._sealed[name].append(array)
        self._chunks_sealed = sum(map(len, self._sealed["chunk_file"]))

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
            cols["shard_chunk_end"].append(self._chunk_count())

    def to_bytes(self, take_id: str, section: str, rank: int | None = None, extra: dict[str, Any] | None = None
                 ) -> bytes:
        arrays = {name: np.concatenate([*self._sealed[name], np.asarray(values, dtype=COLUMNS[name])])
                  for name, values in self._cols.items()}
        header = {"take_id": take_id, "section": section, "rank": rank,
                  "files": [[n, s] for n, s in self.files.items()],
                  "dtypes": [list(k) for k in self._dtypes], "tensors": self.paths, "entries": self.others,
                  "sharded": self.sharded, "columns": {name: len(a) for name, a in arrays.items()}, **(extra or {})}
        return encode(header, arrays)


def _entry_chunks(entry: Entry) -> list[Chunk]:
    if isinstance(entry, (ContainerEntry, ObjectEntry)):
        return []
    if isinstance(entry, ShardedTensorEntry):
        return [c for s in entry.shards for c in s.chunks]
    return entry.chunks


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
        self.tensor_rows = dict(zip(header["tensors"], range(len(header["tensors"]))))  # (a C-level pass)
        ends = cols["tensor_chunk_end"]
        self.tensor_chunk_start = np.concatenate(([0], ends[:-1])) if len(ends) else ends
        self.shapes = ShapeColumns(cols["tensor_ndim"], cols["dims"])
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


def decode_index(data: bytes, where: str, take_id: str, section: str, rank: int | None = None,
                 references: Collection[str] = ()) -> Index:
    """Parse and check an index file: everything a reader must refuse (docs/format.md, section 8) that can be
    seen in the file alone. Entries of version-1 JSON are checked when looked up (:class:`IndexTable`).
    ``references``: the sibling snapshots whose data files it may name (the manifest's)."""
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
    problem = header_problem(header, take_id, section, rank, references)
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
    problem = columns_problem(header, cols, files, itemsizes)
    if problem:
        raise _bad(where, problem)
    return Index(header, cols, files, itemsizes)


_ABSENT = object()


class IndexTable(LazyEntries):
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
            data = self._others.get(path, _ABSENT)
            if data is _ABSENT:  # (an entry that is JSON null is listed, and malformed)
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
        return TensorEntry(dtype, index.shapes.shape(row), chunk_list(index, start, end), kind, self._replicated)

    def check_all(self) -> None:
        for path in self._others:
            self.get(path)

    def non_tensor_paths(self) -> Iterator[str]:
        """The paths of the entries that are no tensor rows (containers, values, pickles...)."""
        return iter(self._others)

    def __contains__(self, path: object) -> bool:
        return path in self._index.tensor_rows or path in self._others

    def __iter__(self) -> Iterator[str]:
        yield from self._index.header["tensors"]
        yield from self._others

    def __len__(self) -> int:
        return len(self._index.tensor_rows) + len(self._others)


def chunk_list(index: Index, start: int, end: int, names: list[str] | None = None) -> list[Chunk]:
    """Chunks ``start`` to ``end`` of the index's chunk columns; ``names``: the data file names to give them, by
    their position in the index's file table (by default the names it holds)."""
    cols, names = index.cols, index.file_names if names is None else names
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
