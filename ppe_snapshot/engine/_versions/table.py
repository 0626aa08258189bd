"""The format versions' table, one row per version, and what the rest of the engine calls with the version at hand.

``FORMAT_VERSION`` (``_format/names.py``) is the newest: this code reads every version up to it. Takes write
``DEFAULT_VERSION`` unless ``PPE_SNAPSHOT_FORMAT_VERSION`` says otherwise. Each version is one module (``v1.py``,
``v2.py``, ``v3.py``) defining its :class:`FormatVersion`; :func:`version_of` gives a manifest's, and the rest of the
engine asks it (or calls the functions below) and never compares version numbers nor tests a version's types.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ppe_snapshot.engine._format import (
    DEFAULT_VERSION, INCREMENTAL_VERSION, MANIFEST_NAME, Chunk, Manifest, Shard, ShardedTensorEntry, parse_document,
)
from ppe_snapshot.engine._util import gc_paused
from ppe_snapshot.engine._versions import commit_v2, v1, v2, v3
from ppe_snapshot.engine._versions import protocol as commit_protocol
from ppe_snapshot.engine._versions.referenced import copy_spans, referenced_spans
from ppe_snapshot.engine._versions.version import FormatVersion, Shared
from ppe_snapshot.errors import CorruptSnapshotError, SnapshotNotFoundError
from ppe_snapshot.settings import SETTINGS
from ppe_snapshot.storage import Storage, split_reference

#: Every format version this code reads, by number: one row each.
VERSIONS: dict[int, FormatVersion] = {version.number: version for version in (v1.VERSION, v2.VERSION, v3.VERSION)}
#: The versions ``PPE_SNAPSHOT_FORMAT_VERSION`` may ask takes to write (version 3 is written by incremental takes).
_WRITTEN = tuple(number for number, version in VERSIONS.items() if version.written)


def version_of(number: int | None) -> FormatVersion:
    """The record of format version ``number`` (a manifest's ``version``); None, a manifest built in memory, is
    asked as version 1 is: every entry in memory, whole."""
    return VERSIONS[number or 1]


def write_version() -> int:
    """The version takes write: ``PPE_SNAPSHOT_FORMAT_VERSION``, by default :data:`DEFAULT_VERSION` (an
    incremental take writes version 3 where it references a base, see :func:`can_reference`)."""
    version = DEFAULT_VERSION if SETTINGS.format_version is None else SETTINGS.format_version
    if version not in _WRITTEN:
        raise ValueError(f"PPE_SNAPSHOT_FORMAT_VERSION={version}: this ppe-snapshot writes format versions "
                         f"{', '.join(map(str, _WRITTEN))} (and {INCREMENTAL_VERSION} for incremental snapshots)")
    return version


def can_reference(version: int) -> bool:
    """Whether a take writing ``version`` can reference a base's data files (index files: version 2 and up)."""
    return VERSIONS[version].references


def read_manifest(storage: Storage) -> Manifest:
    """The committed manifest of the snapshot at ``storage``, of any version (entries checked when decoded;
    a version-2 manifest reads its index files when first needed).

    Raises :class:`SnapshotNotFoundError` when there is none (never taken, being written, or crashed).
    """
    try:
        data = storage.read_bytes(MANIFEST_NAME)
    except (FileNotFoundError, NotADirectoryError):  # the latter: a file on the way
        if storage.is_file(""):
            raise SnapshotNotFoundError(f"no snapshot at {storage.url}: it is a file, not a snapshot directory "
                                        "(ppe's single-file snapshots are read by load_snapshot or torch.load)"
                                        ) from None
        raise SnapshotNotFoundError(f"no snapshot at {storage.url}: {MANIFEST_NAME} is missing (never taken, still "
                                    "being written, or its save crashed before the commit)") from None
    where = f"{storage.url}/{MANIFEST_NAME}"
    with gc_paused():
        doc = parse_document(data, where)
        version = VERSIONS[doc["version"]]
        problem = version.problem(doc)
        if problem:
            raise CorruptSnapshotError(f"{where} is malformed: {problem}; the snapshot is damaged")
        return version.read(storage, doc, where)


def commit(storage: Storage, manifest: Manifest, version: int | None = None) -> None:
    """Make a manifest built in one process visible: check it restores and every data file's size, then write it
    as format ``version`` (by default :func:`write_version`), ``manifest.json`` last."""
    record = VERSIONS[version or write_version()]
    commit_protocol.check_commit(storage, manifest)
    record.write(storage, manifest)


def expected_shared(items: dict[str, Any], world_size: int, version: int) -> Shared:
    """What this rank of a take of ``items`` expects of the state written once for all (nothing to say for one
    rank, or where ``version`` does not check it)."""
    return commit_v2.expected_shared(items) if VERSIONS[version].shares and world_size > 1 else ([], {})


def publish(storage: Storage, take_id: str, part: commit_protocol.RankPart, shared: Shared, version: int) -> None:
    """A rank's share of a multi-rank take's commit, once its data is durable."""
    VERSIONS[version].publish(storage, take_id, part, shared)


def merge_and_commit(storage: Storage, take_id: str, world_size: int, metadata: dict[str, Any],
                     timeout: float | None, version: int) -> None:
    """Rank 0, once every rank said its part is published: merge the parts, check them and commit (waiting for
    them at most ``timeout``, None: the settings')."""
    VERSIONS[version].merge_and_commit(storage, take_id, world_size, metadata, timeout)


def clean_parts(storage: Storage, take_id: str, world_size: int, version: int) -> None:
    """Remove what the ranks of committed take ``take_id`` published under ``.parts/``."""
    VERSIONS[version].clean(storage, take_id, world_size)


def upgrade(source: Storage, dest: Storage) -> None:
    """Write the version-1 or incremental (version-3) snapshot at ``source`` as a self-contained version-2
    snapshot at ``dest`` (where nothing is): its own data files copied byte for byte, and of each file of another
    snapshot it references only the chunks it reads, one after another, to ``refs/<that snapshot>/<file>``
    (its chunks renamed); then its index files and the manifest, last. The source is checked first (every
    entry, every file's size)."""
    manifest = read_manifest(source)
    if manifest.version == DEFAULT_VERSION:
        raise ValueError(f"{source.url} is already a self-contained version-{manifest.version} snapshot")
    manifest.check_entries()
    commit_protocol.refuse_overwrite(dest)
    spans = referenced_spans(manifest)
    moves: dict[str, tuple[str, dict[int, int] | None]] = {}
    files: dict[str, int] = {}
    for name, size in manifest.files.items():
        inside = _inside(name)
        if name in spans:
            moved, files[inside] = copy_spans(source, name, spans[name], dest, inside)
            moves[name] = (inside, moved)
        else:
            _copy_file(source, name, size, dest)
            moves[name], files[inside] = (inside, None), size
    if manifest.references:
        manifest = _renamed(manifest, moves, files)
    commit(dest, manifest, version=2)


def _copy_file(source: Storage, name: str, size: int, dest: Storage) -> None:
    """Data file ``name`` of ``source`` (``size`` bytes) copied to ``dest`` as it is."""
    block = bytearray(max(1, min(size, 64 << 20)))
    writer = dest.open_writer(name, size)
    try:
        for start in range(0, size, len(block)):
            view = memoryview(block)[: min(len(block), size - start)]
            source.read_into(name, start, view)
            writer.write([view])
        writer.close()
    except BaseException:
        writer.abort()
        raise


def _inside(name: str) -> str:
    """Where a self-contained copy keeps data file ``name``: a file of a referenced snapshot under ``refs/``."""
    reference = split_reference(name)
    return name if reference is None else f"refs/{reference[0]}/{reference[1]}"


#: Per data file of the source: its name in the copy, and where its chunks went (None: where they were).
_Moves = dict[str, tuple[str, "dict[int, int] | None"]]


def _renamed(manifest: Manifest, moves: _Moves, files: dict[str, int]) -> Manifest:
    """``manifest`` with every chunk moved as ``moves`` says and data files ``files`` (a built manifest: every
    entry in memory)."""
    def chunks(entry: Any) -> Any:
        if isinstance(entry, ShardedTensorEntry):
            return ShardedTensorEntry(entry.dtype, entry.shape, [Shard(s.offsets, s.sizes, _moved(s.chunks, moves))
                                                                 for s in entry.shards], entry.replicated)
        if getattr(entry, "chunks", None) is None:
            return entry
        return dataclasses.replace(entry, chunks=_moved(entry.chunks, moves))

    def table(entries: Any) -> dict[str, Any]:
        return {path: chunks(entry) for path, entry in entries.items()}

    return Manifest(manifest.world_size, [table(rank) for rank in manifest.ranks], table(manifest.replicated),
                    files, manifest.take_id, dict(manifest.metadata), table(manifest.sharded))


def _moved(chunks: list[Chunk], moves: _Moves) -> list[Chunk]:
    out = []
    for chunk in chunks:
        name, offsets = moves[chunk.file]
        out.append(chunk._replace(file=name, offset=chunk.offset if offsets is None else offsets[chunk.offset]))
    return out
