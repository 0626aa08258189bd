"""Format version 2: a small JSON manifest (the commit point) over per-rank index files (``docs/format.md``).

``manifest.json`` holds what every reader needs and nothing per entry or per rank: the take id, the world
size, the metadata. The entries are in index files (:mod:`~ppe_snapshot.engine._format.index`):
``index/rank<r>.idx`` (rank ``r``'s own entries and the shards of sharded tensors it wrote, written by that
rank) and ``index/shared.idx`` (the replicated entries and the table of sharded tensors, written by the
committing rank). A restoring rank reads the manifest, the shared index and its own rank's index; it reads
other ranks' indexes only for a sharded tensor whose shards in its own index do not cover what it restores
(a restore on another world size or mesh), or to list or verify everything.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Callable

from ppe_snapshot.engine._format import (
    CHECKSUM_ALGORITHM, FORMAT_NAME, INCREMENTAL_VERSION, MANIFEST_NAME, SHARED_INDEX, Entry, Index, IndexBuilder,
    IndexTable, LazyEntries, Manifest, Shard, ShardedTensorEntry, commit_stamp, data_file_rank, decode_index,
    dump_json, rank_index, read_stamp,
)
from ppe_snapshot.errors import CorruptSnapshotError
from ppe_snapshot.storage import Storage, split_reference


# -- writing ----------------------------------------------------------------------------------------

def rank_index_bytes(take_id: str, rank: int, entries: Mapping[str, Entry], shards: Mapping[str, ShardedTensorEntry],
                     files: Mapping[str, int], own_files: Sequence[str] = ()) -> bytes:
    """Rank ``rank``'s index: its entries, the shards it wrote (one entry per sharded tensor, maybe with none)
    and its data files (``own_files``, listed even when no chunk names them)."""
    builder = IndexBuilder()
    for name in own_files:
        builder.add_file(name, files)
    builder.add_entries(entries, files)
    for path, entry in shards.items():
        builder.add_shards(path, entry.dtype, entry.shape, entry.shards, files)
    return builder.to_bytes(take_id, "rank", rank)


def shared_index_bytes(take_id: str, replicated: Mapping[str, Entry], sharded: Mapping[str, tuple[str, list[int]]],
                       files: Mapping[str, int], other_files: Sequence[str] = ()) -> bytes:
    """The shared index: the replicated entries and the table of sharded tensors (dtype, global shape)."""
    builder = IndexBuilder()
    for name in other_files:
        builder.add_file(name, files)
    builder.add_entries(replicated, files)
    builder.sharded = [[path, dtype, list(shape)] for path, (dtype, shape) in sharded.items()]
    return builder.to_bytes(take_id, "shared")


def referenced_snapshots(files: Iterable[str]) -> list[str]:
    """The sibling snapshots whose data files ``files`` name (an incremental snapshot's references), sorted."""
    return sorted({reference[0] for reference in map(split_reference, files) if reference is not None})


def top_bytes(world_size: int, take_id: str, metadata: dict[str, Any], files: Iterable[str]) -> bytes:
    """``manifest.json`` over index files naming ``files``: version 2, or version 3 (with ``references``) when
    some of them lie in sibling snapshots."""
    references = referenced_snapshots(files)
    extra = {"version": INCREMENTAL_VERSION, "references": references} if references else {"version": 2}
    doc = {"format": FORMAT_NAME, **extra, "checksum_algorithm": CHECKSUM_ALGORITHM,
           "world_size": world_size, "take_id": take_id, "metadata": metadata, **commit_stamp()}
    return dump_json(doc, free_form=metadata)


def writer_rank(shard: Shard, world_size: int) -> int:
    """The rank whose index lists a shard of a manifest built in one process: the rank of its data file."""
    rank = data_file_rank(shard.chunks[0].file) if shard.chunks else None
    return rank if rank is not None and rank < world_size else 0


def write_manifest(storage: Storage, manifest: Manifest) -> None:
    """Write a complete manifest built in one process (a one-rank take, the DCP adapter, an upgrade) as
    version 2: every index file, then ``manifest.json`` last."""
    world_size, files = manifest.world_size, dict(manifest.files)
    shards: list[dict[str, ShardedTensorEntry]] = [{} for _ in range(world_size)]
    for path, entry in manifest.sharded.items():
        for part in shards:
            part[path] = ShardedTensorEntry(entry.dtype, entry.shape, [])
        for shard in entry.shards:
            shards[writer_rank(shard, world_size)][path].shards.append(shard)
    owned: list[list[str]] = [[] for _ in range(world_size)]
    unowned = []
    for name in files:
        rank = data_file_rank(name)
        (owned[rank] if rank is not None and rank < world_size else unowned).append(name)
    for rank in range(world_size):
        data = rank_index_bytes(manifest.take_id, rank, manifest.ranks[rank], shards[rank], files, owned[rank])
        storage.put_atomic(rank_index(rank), data)
    sharded = {path: (e.dtype, e.shape) for path, e in manifest.sharded.items()}
    storage.put_atomic(SHARED_INDEX, shared_index_bytes(manifest.take_id, manifest.replicated, sharded, files,
                                                        unowned))
    storage.put_atomic(MANIFEST_NAME, top_bytes(world_size, manifest.take_id, manifest.metadata, files))


# -- reading ----------------------------------------------------------------------------------------

class _Indexes:
    """The index files of one snapshot, each read, checked and decoded once, when first needed."""

    def __init__(self, storage: Storage, where: str, take_id: str, world_size: int,
                 references: Sequence[str] = ()) -> None:
        self.storage, self.where, self.take_id, self.world_size = storage, where, take_id, world_size
        self.references = frozenset(references)
        self._shared: Index | None = None
        self._ranks: dict[int, Index] = {}
        #: Bytes of index files read so far (the metadata-scale benchmark reports it).
        self.bytes_read = 0

    def _read(self, name: str, section: str, rank: int | None) -> Index:
        try:
            data = self.storage.read_bytes(name)
        except FileNotFoundError:
            raise CorruptSnapshotError(f"{self.where}: index file {name} is missing; the snapshot is damaged"
                                       ) from None
        self.bytes_read += len(data)
        return decode_index(data, f"{self.storage.url}/{name}", self.take_id, section, rank, self.references)

    def shared(self) -> Index:
        if self._shared is None:
            self._shared = self._read(SHARED_INDEX, "shared", None)
        return self._shared

    def rank(self, rank: int) -> Index:
        index = self._ranks.get(rank)
        if index is None:
            index = self._ranks[rank] = self._read(rank_index(rank), "rank", rank)
        return index


class _LazyTable(Mapping[str, Entry]):
    """An :class:`IndexTable` whose index file is read when first used."""

    def __init__(self, load: Callable[[], IndexTable]) -> None:
        self._load, self._table = load, None

    @property
    def table(self) -> IndexTable:
        if self._table is None:
            self._table = self._load()
        return self._table

    def get(self, path: str, default: Any = None) -> Any:  # type: ignore[override]
        return self.table.get(path, default)

    def __getitem__(self, path: str) -> Entry:
        return self.table[path]

    def __contains__(self, path: object) -> bool:
        return path in self.table

    def __iter__(self) -> Iterator[str]:
        return iter(self.table)

    def __len__(self) -> int:
        return len(self.table)

    def check_all(self) -> None:
        self.table.check_all()

    def non_tensor_paths(self) -> Iterator[str]:
        return self.table.non_tensor_paths()


class _Ranks(Sequence[Mapping[str, Entry]]):
    """Every rank's entries; a rank's table is made when first asked for (nothing per rank up front)."""

    def __init__(self, indexes: _Indexes) -> None:
        self._indexes = indexes
        self._tables: dict[int, _LazyTable] = {}

    def _table(self, rank: int) -> _LazyTable:
        table = self._tables.get(rank)
        if table is None:
            indexes = self._indexes
            table = self._tables[rank] = _LazyTable(
                lambda: IndexTable(indexes.rank(rank), f"{indexes.where} (rank {rank})", False))
        return table

    def __getitem__(self, rank):  # type: ignore[override]
        if isinstance(rank, slice):
            return [self._table(r) for r in range(len(self))[rank]]
        if rank < 0:
            rank += len(self)
        if not 0 <= rank < len(self):
            raise IndexError(rank)
        return self._table(rank)

    def __len__(self) -> int:
        return self._indexes.world_size


class ShardedTable(LazyEntries):
    """The sharded tensors of a version-2 manifest: their table is in the shared index, their shards in the
    index of the rank that wrote each. ``get`` assembles every shard (reads every rank's index, once);
    :meth:`for_rank` gives a restoring rank the shards of its own index first."""

    def __init__(self, indexes: _Indexes) -> None:
        self._indexes = indexes
        self._full: dict[str, ShardedTensorEntry] | None = None

    def _table(self) -> dict[str, list[Any]]:
        return self._indexes.shared().sharded_rows

    def _assemble(self) -> dict[str, ShardedTensorEntry]:
        if self._full is None:
            full = {path: ShardedTensorEntry(dtype, shape, [], True) for path, dtype, shape in self._table().values()}
            for rank in range(self._indexes.world_size):
                index = self._indexes.rank(rank)
                for path, shards in index.shards().items():
                    self._add(full, path, index, shards)
            for path, entry in full.items():
                unique = {(tuple(s.offsets), tuple(s.sizes)): s for s in entry.shards}
                entry.shards[:] = [unique[key] for key in sorted(unique)]
                covered, total = sum(math.prod(s.sizes) for s in entry.shards), math.prod(entry.shape)
                if covered != total:
                    raise CorruptSnapshotError(f"{self._indexes.where}: sharded tensor {path!r}: its shards hold "
                                               f"{covered} of its {total} elements; the snapshot is damaged")
            self._full = full
        return self._full

    def _add(self, full: dict[str, ShardedTensorEntry], path: str, index: Index, shards: list[Shard]) -> None:
        entry = full.get(path)
        _, dtype, shape = index.sharded_rows[path]
        if entry is None or (entry.dtype, entry.shape) != (dtype, shape):
            raise CorruptSnapshotError(f"{self._indexes.where}: rank index lists shards of {path!r} as {dtype} "
                                       f"{shape}, which the shared index does not; the snapshot is damaged")
        entry.shards.extend(shards)

    def for_rank(self, rank: int, path: str) -> ShardedTensorEntry | None:
        """The entry of ``path`` with the shards of rank ``rank``'s own index; ``complete`` gives all of them."""
        row = self._table().get(path)
        if row is None:
            return None
        own: list[Shard] = []
        if rank < self._indexes.world_size:
            index = self._indexes.rank(rank)
            mine = index.sharded_rows.get(path)
            if mine is not None:
                if (mine[1], mine[2]) != (row[1], row[2]):
                    raise CorruptSnapshotError(f"{self._indexes.where}: rank {rank}'s index lists {path!r} as "
                                               f"{mine[1]} {mine[2]}, the shared index as {row[1]} {row[2]}")
                own = index.shards().get(path, [])
        return ShardedTensorEntry(row[1], row[2], list(own), True, complete=lambda: self._assemble()[path].shards)

    def get(self, path: str, default: Any = None) -> Any:  # type: ignore[override]
        if path not in self._table():
            return default
        return self._assemble()[path]

    def __contains__(self, path: object) -> bool:
        return path in self._table()

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def check_all(self) -> None:
        self._assemble()


class _AllFiles(Mapping[str, int]):
    """Every data file of a version-2 snapshot with its size: the union of the index files' tables (reads
    every index)."""

    def __init__(self, indexes: _Indexes) -> None:
        self._indexes, self._files = indexes, None

    def _all(self) -> dict[str, int]:
        if self._files is None:
            files: dict[str, int] = dict(self._indexes.shared().files)
            for rank in range(self._indexes.world_size):
                for name, size in self._indexes.rank(rank).files.items():
                    if files.setdefault(name, size) != size:
                        raise CorruptSnapshotError(f"{self._indexes.where}: index files disagree on the size of "
                                                   f"{name}; the snapshot is damaged")
            self._files = files
        return self._files

    def __getitem__(self, name: str) -> int:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


def read(storage: Storage, doc: dict[str, Any], where: str) -> Manifest:
    """The manifest of a checked version-2 or -3 document; index files are read when first needed."""
    # (version 2 is self-contained: a ``references`` field there, which it does not have, counts for nothing)
    references = tuple(doc["references"]) if doc["version"] == INCREMENTAL_VERSION else ()
    indexes = _Indexes(storage, where, doc["take_id"], doc["world_size"], references)
    shared = _LazyTable(lambda: IndexTable(indexes.shared(), f"{where} (replicated)", True))
    manifest = Manifest(
        world_size=doc["world_size"], ranks=_Ranks(indexes), replicated=shared, files=_AllFiles(indexes),
        take_id=doc["take_id"], metadata=doc.get("metadata", {}), sharded=ShardedTable(indexes),
        version=doc["version"], references=references, **read_stamp(doc))
    manifest.indexes = indexes
    return manifest

