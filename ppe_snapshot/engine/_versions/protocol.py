"""The commit protocol: data first, manifest last.

Every rank makes its data files durable, then publishes a small *part*
(its entries and file sizes) under ``.parts/``. Rank 0 reads all parts once
every rank said (through the take's rank channel, ``_ranks/rank_channel.py``) that
its part is published, checks them and writes the manifest, the commit
point; when the take fails the ranks write an abort marker instead, so
that a listing does not take it for a take in progress.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from itertools import chain
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ppe_snapshot.engine._format import (
    MANIFEST_NAME, RETIRED_NAME, Chunk, Container, ContainerEntry, Entry, EntryColumns, Manifest, ObjectEntry,
    ShardedTensorEntry, TensorEntry, abort_name, decode_value, dump_json, entries_from_json, entries_to_json,
    load_json, part_name,
)
from ppe_snapshot.engine._state import child_path, child_paths, merge_sharded
from ppe_snapshot.errors import CorruptSnapshotError, SnapshotError, SnapshotExistsError
from ppe_snapshot.settings import SETTINGS
from ppe_snapshot.storage import Storage


@dataclass
class RankPart:
    rank: int
    #: This rank's own entries (a take's: :class:`EntryColumns`, most tensors as columns).
    entries: Mapping[str, Entry] = field(default_factory=dict)
    replicated: dict[str, Entry] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    #: This rank's shards of each sharded tensor (an entry, maybe with no shard, per tensor).
    sharded: dict[str, Entry] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return dump_json({
            "rank": self.rank, "error": self.error, "files": self.files,
            "entries": entries_to_json(self.entries), "replicated": entries_to_json(self.replicated),
            "sharded": entries_to_json(self.sharded),
        })

    @classmethod
    def from_doc(cls, doc: dict) -> "RankPart":
        return cls(doc["rank"], entries_from_json(doc["entries"]), entries_from_json(doc["replicated"]),
                   doc["files"], doc["error"], entries_from_json(doc.get("sharded", {})))


def publish_part(storage: Storage, take_id: str, part: RankPart) -> None:
    storage.put_atomic(part_name(take_id, part.rank), part.to_bytes())


def _poll(what: Callable[[], str], ready, timeout: float):
    """Call ``ready`` until it returns a result; on timeout, raise naming ``what()`` (evaluated then)."""
    deadline, delay = time.monotonic() + timeout, 0.002
    while True:
        result = ready()
        if result is not None:
            return result
        if time.monotonic() > deadline:
            raise SnapshotError(f"gave up after {timeout:.0f} s waiting for {what()}")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def gather_parts(storage: Storage, take_id: str, world_size: int, timeout: float | None = None) -> list[RankPart]:
    """Rank 0: wait until every rank has published its part (at most ``timeout``, default the settings')."""
    return [RankPart.from_doc(doc) for doc in gather_documents(storage, take_id, world_size, timeout)]


def gather_documents(storage: Storage, take_id: str, world_size: int, timeout: float | None = None) -> list[dict]:
    """Rank 0: every rank's part as parsed JSON, once all are published (at most ``timeout``)."""
    parts: dict[int, dict] = {}

    def ready():
        for r in range(world_size):
            if r not in parts:
                try:  # no exists() first: one call per rank and poll, thousands of ranks
                    doc = load_json(storage.read_bytes(part_name(take_id, r)))
                    if type(doc) is dict and "rank" in doc and "error" in doc:
                        parts[r] = doc
                except (ValueError, OSError):  # not there yet, or still being written: read it again later
                    pass
        return [parts[r] for r in range(world_size)] if len(parts) == world_size else None

    def missing() -> str:
        return f"the parts of ranks {sorted(set(range(world_size)) - set(parts))} of snapshot {storage.url}"

    return _poll(missing, ready, SETTINGS.commit_timeout if timeout is None else timeout)


def merge(parts: list[RankPart], take_id: str, metadata: dict) -> Manifest:
    replicated: dict[str, Entry] = {}
    files: dict[str, int] = {}
    for part in parts:
        replicated.update(part.replicated)
        files.update(part.files)
    return Manifest(len(parts), [p.entries for p in parts], replicated, files, take_id, metadata,
                    sharded=merge_sharded([p.sharded for p in parts]))


def _children(path: str, entry: ContainerEntry, entries: int) -> list[str]:
    """The paths of the container's children; of a list or tuple's, at most one more than the manifest's
    ``entries`` (a crafted length sizes nothing: the child past them is missing, and refused as such)."""
    if entry.kind in Container.KEYED:  # string keys are stored as they are; others encoded
        keys = entry.keys
        if not set(map(type, keys)) <= {str}:
            keys = [key if type(key) is str else decode_value(key) for key in keys]
        return child_paths(path, keys)
    return [child_path(path, i) for i in range(min(entry.length, entries + 1))]


def _check_chunks(path: str, chunks: list[Chunk], files: dict[str, int]) -> None:
    for chunk in chunks:
        size = files.get(chunk.file)
        if size is None or chunk.offset + chunk.nbytes > size:
            raise SnapshotError(f"entry {path!r} refers to bytes {chunk.offset}..{chunk.offset + chunk.nbytes} "
                                f"of {chunk.file}, which the take did not write")


def _check_rows(columns: EntryColumns, files: dict[str, int]) -> None:
    """The tensor rows' chunks lie inside their data file."""
    end = columns.end()
    if columns.paths and end > files.get(columns.file, -1):
        row = int(np.argmax(columns.offsets + columns.nbytes))
        _check_chunks(columns.paths[row], columns[columns.paths[row]].chunks, files)


def check_restorable(manifest: Manifest, read: bool = False) -> None:
    """Raise :class:`SnapshotError` unless every rank can restore everything the manifest lists for it.

    Every child a container refers to must be an entry the same rank sees,
    and every chunk must lie inside a data file the manifest lists.
    ``read``: the manifest is a committed snapshot's, its entries already checked (``Snapshot.verify``): every
    value is decoded too, and a child missing or a value that does not decode is :class:`CorruptSnapshotError`,
    the snapshot damaged, not a take's ranks disagreeing.
    """
    replicated, sharded, files = manifest.replicated, manifest.sharded, manifest.files
    # (the ranks' tables one at a time: a crafted world size sizes no list, and the first missing index raises)
    entries = sum(map(len, manifest.tables()))
    tables = chain([(None, replicated), (None, sharded)], enumerate(manifest.ranks))
    for rank, table in tables:
        own = table if rank is not None else {}
        if isinstance(table, EntryColumns):
            _check_rows(table, files)
            own, table = table.path_set(), table.objects
        for path, entry in table.items():
            if type(entry) is TensorEntry:  # most entries: the short way
                for chunk in entry.chunks:
                    if chunk.offset + chunk.nbytes > files.get(chunk.file, -1):
                        _check_chunks(path, entry.chunks, files)
            elif isinstance(entry, ContainerEntry):
                children = _children(path, entry, entries)
                if type(own) is set and own.issuperset(children):  # most containers: one C-level pass
                    continue
                for child in children:
                    if child in own or child in replicated or child in sharded:
                        continue
                    ranks = [rank] if rank is not None else range(manifest.world_size)
                    missing = [r for r in ranks if manifest.lookup(r, child) is None]
                    if missing and read:
                        raise CorruptSnapshotError(f"{path!r} refers to {child!r}, which the manifest lists no "
                                                   f"entry of for rank(s) {missing}")
                    if missing:
                        raise SnapshotError(
                            f"{path!r} refers to {child!r}, which no rank wrote for rank(s) {missing}; the ranks "
                            "disagree on this state (replicated globs matching different entries on different "
                            "ranks?)")
            elif isinstance(entry, ShardedTensorEntry):
                for shard in entry.shards:
                    _check_chunks(path, shard.chunks, files)
            elif isinstance(entry, ObjectEntry):
                if read:  # (a take's values were encoded by it; a read one's are decoded when first used)
                    _check_value(path, entry)
            else:
                _check_chunks(path, entry.chunks, files)


def check_structure(manifest: Manifest) -> None:
    """Raise :class:`CorruptSnapshotError` unless a committed snapshot's manifest, its entries checked one by one
    already, rebuilds: every child a container names has an entry, every value decodes, and every entry but an
    app state key's lies in a container that each rank seeing it sees and that names it (an entry no container
    names would be lost to a restore without a word)."""
    check_restorable(manifest, read=True)
    entries = sum(map(len, manifest.tables()))
    shared = set(manifest.replicated) | set(manifest.sharded)
    named_shared = _named(manifest.replicated, entries)
    # (the shared entries whose container is not shared, found once: each rank must list it)
    unhoused = []
    for path in shared:
        parent = path.rpartition("/")[0]
        if parent and parent not in shared:
            unhoused.append((path, parent))
        elif parent and path not in named_shared:
            raise _unnamed(path, parent, "the shared entries")
    for rank, table in enumerate(manifest.ranks):  # (what rank r sees: its own entries and the shared ones)
        own = set(table)
        for path, parent in chain(unhoused, ((path, path.rpartition("/")[0]) for path in own)):
            if parent and parent not in own and parent not in shared:
                raise CorruptSnapshotError(f"{path!r} is listed for rank {rank}, but not {parent!r}, the container "
                                           "it would be in")
        named = _named(table, entries)
        # (set differences, in C: a model's state is a dict of thousands of entries)
        for path in own.difference(named, named_shared).union(p for p, _ in unhoused if p not in named):
            if "/" in path:  # (an app state key's entry lies in no container)
                raise _unnamed(path, path.rpartition("/")[0], f"rank {rank}")


def _named(table: Mapping[str, Entry], entries: int) -> set[str]:
    """The paths the containers of ``table`` name as their children."""
    if isinstance(table, EntryColumns):
        objects: Iterable[tuple[str, Entry]] = table.objects.items()
    else:  # (an index file's table lists its tensor rows apart: most entries, none a container)
        paths = getattr(table, "non_tensor_paths", None)
        objects = table.items() if paths is None else ((path, table[path]) for path in paths())
    named: set[str] = set()
    for path, entry in objects:
        if isinstance(entry, ContainerEntry):
            named.update(_children(path, entry, entries))
    return named


def _unnamed(path: str, parent: str, seen_by: str) -> CorruptSnapshotError:
    return CorruptSnapshotError(f"{path!r} is listed for {seen_by}, but {parent!r}, the container it lies in, "
                                "does not name it as a child")


def _check_value(path: str, entry: ObjectEntry) -> None:
    try:
        decode_value(entry.value)
    except CorruptSnapshotError as e:
        raise CorruptSnapshotError(f"entry {path!r}: {e}") from None


def check_commit(storage: Storage, manifest: Manifest) -> None:
    """Before a manifest built in one process is written: it restores (:func:`check_restorable`) and every data
    file has its recorded size."""
    try:
        check_restorable(manifest)
    except SnapshotError as e:
        raise SnapshotError(f"snapshot {storage.url} not committed, it would not restore: {e}") from None
    check_sizes(storage, manifest.files)


def check_sizes(storage: Storage, files: dict[str, int]) -> None:
    """Raise unless every data file holds the bytes its manifest will record."""
    for name, size in files.items():
        stored = storage.size(name)
        if stored != size:
            raise SnapshotError(f"{storage.url}/{name} holds {stored} bytes, expected {size}; not committing")


def refuse_overwrite(storage: Storage) -> None:
    """Raise :class:`SnapshotExistsError` when a committed snapshot, or a file, is at ``storage`` (a take never
    writes over one)."""
    if storage.is_file(""):
        raise SnapshotExistsError(f"{storage.url} is a file; a snapshot is a directory: choose a new path or remove "
                                  "the file first")
    if storage.exists(MANIFEST_NAME):
        raise SnapshotExistsError(f"a snapshot already exists at {storage.url}; choose a new path or remove it first")
    if storage.exists(RETIRED_NAME):
        raise SnapshotExistsError(
            f"{storage.url} holds the data files of a removed snapshot that incremental snapshots beside it still "
            "read (retention keeps them until none does); choose a new path")


def abort(storage: Storage, take_id: str, reason: str) -> None:
    storage.put_atomic(abort_name(take_id), reason.encode())


def remove_parts(storage: Storage, take_id: str, world_size: int) -> None:
    """Remove the parts the ranks of take ``take_id`` published, and its abort marker."""
    for r in range(world_size):
        storage.remove(part_name(take_id, r))
    storage.remove(abort_name(take_id))
