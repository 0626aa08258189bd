"""The manifest: the JSON document that describes, and commits, a snapshot.

See ``docs/format.md`` for the layout. Entries are keyed by logical path
(``"model/layer.weight"``); per-rank entries live in ``ranks[r]``, state
written once for all ranks in ``replicated``, and tensors split over ranks
(DTensor, FSDP, ShardedTensor) in ``sharded``, one entry per tensor listing
every shard with its global offsets.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import operator
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Callable, NamedTuple, Union

import torch

from ppe_snapshot.engine._format import jsonio
from ppe_snapshot.engine._format.names import EntryType, Raw
from ppe_snapshot.engine._format.validation import (
    CHECKSUM_ALGORITHM, FORMAT_NAME, check_document, check_entry, tensor_chunks,
)
from ppe_snapshot.engine._util import gc_paused
from ppe_snapshot.errors import CorruptSnapshotError


class Chunk(NamedTuple):
    """A run of bytes in a data file with its checksum (hex xxh3_64).

    A named tuple: manifests hold thousands, and it is built in half a frozen dataclass's time.
    """
    file: str
    offset: int
    nbytes: int
    checksum: str


@dataclass(slots=True)
class TensorEntry:
    """A tensor (``kind="tensor"``) or numpy array (``kind="ndarray"``) stored as raw bytes."""
    dtype: str
    shape: list[int]
    chunks: list[Chunk]
    kind: str = Raw.TENSOR
    replicated: bool = False

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)


@dataclass(slots=True)
class Shard:
    """One piece of a sharded tensor: where it sits in the global tensor and its bytes."""
    offsets: list[int]
    sizes: list[int]
    chunks: list[Chunk]


@dataclass(slots=True)
class ShardedTensorEntry:
    """A tensor split over ranks (DTensor, ShardedTensor, FSDP); each shard is written once.

    As a restoring rank of a version-2 snapshot looks it up, ``shards`` may hold only the shards of its own
    rank's index; ``complete()`` then gives them all (reading the other ranks' indexes).
    """
    dtype: str
    shape: list[int]
    shards: list[Shard]
    replicated: bool = False
    complete: Callable[[], list[Shard]] | None = field(default=None, compare=False, repr=False)


@dataclass(slots=True)
class ObjectEntry:
    """A non-tensor value, encoded inline as tagged JSON (see serialization.py)."""
    value: Any
    replicated: bool = False


@dataclass(slots=True)
class PickleEntry:
    """A value saved with pickle (only with ``allow_pickle=True``)."""
    chunks: list[Chunk]
    replicated: bool = False


@dataclass(slots=True)
class BytesEntry:
    """Opaque bytes stored raw: a value serialized by a torch.distributed.checkpoint planner
    (by default a ``torch.save`` stream). Read back as ``bytes``, never unpickled."""
    chunks: list[Chunk]
    replicated: bool = False


@dataclass(slots=True)
class ContainerEntry:
    """A dict / OrderedDict (``keys``, encoded) or list / tuple (``length``); children follow by path."""
    kind: str
    keys: list[Any] = field(default_factory=list)
    length: int = 0
    replicated: bool = False


Entry = Union[TensorEntry, ShardedTensorEntry, ObjectEntry, PickleEntry, BytesEntry, ContainerEntry]

_TYPES: dict[str, type] = {
    EntryType.TENSOR: TensorEntry, EntryType.SHARDED: ShardedTensorEntry, EntryType.OBJECT: ObjectEntry,
    EntryType.PICKLE: PickleEntry, EntryType.BYTES: BytesEntry, EntryType.CONTAINER: ContainerEntry,
}
_NAMES = {cls: name for name, cls in _TYPES.items()}


_CHUNK_FIELDS = operator.itemgetter(*Chunk._fields)
_new_tuple = tuple.__new__  # skips the named tuple's Python-level __new__


def _chunks_from_json(chunks: list[dict[str, Any]]) -> list[Chunk]:
    return [_new_tuple(Chunk, _CHUNK_FIELDS(c)) for c in chunks]


def _chunks_json(chunks: list[Chunk]) -> list[dict[str, Any]]:
    return [{"file": c.file, "offset": c.offset, "nbytes": c.nbytes, "checksum": c.checksum} for c in chunks]


def _fields_json(entry: Entry) -> dict[str, Any]:
    # Hand-written rather than dataclasses.asdict: manifests hold thousands of entries.
    if isinstance(entry, TensorEntry):
        return {"dtype": entry.dtype, "shape": entry.shape, "chunks": _chunks_json(entry.chunks), "kind": entry.kind}
    if isinstance(entry, ObjectEntry):
        return {"value": entry.value}
    if isinstance(entry, ContainerEntry):
        return {"kind": entry.kind, "keys": entry.keys, "length": entry.length}
    if isinstance(entry, (PickleEntry, BytesEntry)):
        return {"chunks": _chunks_json(entry.chunks)}
    return {"dtype": entry.dtype, "shape": entry.shape,
            "shards": [{"offsets": s.offsets, "sizes": s.sizes, "chunks": _chunks_json(s.chunks)}
                       for s in entry.shards]}


def entry_to_json(entry: Entry) -> dict[str, Any]:
    if type(entry) is ContainerEntry:  # the most entries after tensors (an optimizer's dict per parameter)
        out = {"type": EntryType.CONTAINER, "kind": entry.kind, "keys": entry.keys, "length": entry.length}
    else:
        out = {"type": _NAMES[type(entry)], **_fields_json(entry)}
    if entry.replicated:
        out["replicated"] = True
    return out


def entry_from_json(data: dict[str, Any]) -> Entry:
    """The entry of well-formed JSON (a manifest's entries are checked first, see :class:`EntryTable`)."""
    if data["type"] == EntryType.TENSOR:  # most entries: the short way
        return TensorEntry(data["dtype"], data["shape"], _chunks_from_json(data["chunks"]),
                           data.get("kind", Raw.TENSOR), data.get("replicated", False))
    data = dict(data)
    cls = _TYPES.get(data.pop("type"))
    if cls is None:
        raise CorruptSnapshotError(f"manifest entry of unknown type: {data!r:.200}")
    if "chunks" in data:
        data["chunks"] = _chunks_from_json(data["chunks"])
    if "shards" in data:
        data["shards"] = [Shard(s["offsets"], s["sizes"], _chunks_from_json(s["chunks"]))
                          for s in data["shards"]]
    return cls(**data)


def entries_to_json(entries: Mapping[str, Entry]) -> dict[str, Any]:
    return {path: entry_to_json(e) for path, e in entries.items()}


def entries_from_json(data: dict[str, Any]) -> dict[str, Entry]:
    return {path: entry_from_json(e) for path, e in data.items()}


_ABSENT = object()


class LazyEntries(Mapping[str, Entry]):
    """Entries by path whose ``get`` (given by a subclass) may build the entry it is asked for."""

    def get(self, path: str, default: Any = None) -> Any:  # type: ignore[override]
        raise NotImplementedError

    def for_rank(self, rank: int, path: str) -> Entry | None:
        """The entry of ``path`` as rank ``rank`` restores it: a sharded entry with at least that rank's shards
        (``ShardedTensorEntry.complete`` then gives them all); by default the whole entry."""
        return self.get(path)

    def __getitem__(self, path: str) -> Entry:
        entry = self.get(path)
        if entry is None:
            raise KeyError(path)
        return entry


class EntryTable(LazyEntries):
    """A section of a parsed manifest's entries by path, each checked and decoded when first looked up.

    Decoding 5,000 entries up front took 25 ms, in which a restore read
    nothing; decoded lazily, a restore starts reading while most of them are
    still raw, and decodes each beside the reads. Each entry is checked
    (``validation.check_entry``) against ``files``, the manifest's data file
    sizes, before it is decoded; ``check_all`` checks the rest without
    decoding them.
    """

    def __init__(self, raw: dict[str, Any], where: str, files: dict[str, int], section: str,
                 only: str | None = None) -> None:
        self._raw = raw
        self._decoded: dict[str, Entry] = {}
        self._where, self._files, self._section, self._only = where, files, section, only

    def get(self, path: str, default: Any = None) -> Any:  # type: ignore[override]
        entry = self._decoded.get(path)
        if entry is not None:
            return entry
        data = self._raw.get(path, _ABSENT)
        if data is _ABSENT:
            return default
        # Most entries are tensors: checked and decoded in one pass; any other is checked, then decoded.
        chunks = tensor_chunks(data, self._files, Chunk) if self._only is None else None
        if chunks is not None:
            entry = TensorEntry(data["dtype"], data["shape"], chunks, data.get("kind", Raw.TENSOR),
                                data.get("replicated", False))
        else:
            try:
                check_entry(data, self._files, self._only)
            except CorruptSnapshotError as e:
                raise self._malformed(path, e) from None
            entry = entry_from_json(data)
        self._decoded[path] = entry
        return entry

    def _malformed(self, path: str, error: CorruptSnapshotError) -> CorruptSnapshotError:
        return CorruptSnapshotError(f"{self._where}: entry {path!r} is malformed: {error} (in {self._section}); "
                                    "the snapshot is damaged")

    def check_all(self) -> None:
        """Check every entry not decoded yet (decoded ones passed already)."""
        decoded, files, only = self._decoded, self._files, self._only
        for path, data in self._raw.items():
            if path not in decoded:
                try:
                    check_entry(data, files, only)
                except CorruptSnapshotError as e:
                    raise self._malformed(path, e) from None

    def __contains__(self, path: object) -> bool:
        return path in self._raw

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)


@dataclass
class Manifest:
    world_size: int
    ranks: list[Mapping[str, Entry]]
    replicated: Mapping[str, Entry]
    files: dict[str, int]
    take_id: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    #: Tensors split over ranks, seen by every rank (of any world size).
    sharded: Mapping[str, Entry] = field(default_factory=dict)
    #: When the manifest was written (the commit), UTC ISO 8601; None for snapshots written before it was recorded.
    committed_at: str | None = None
    #: The versions that wrote it (``{"ppe_snapshot": ..., "torch": ...}``); empty for older snapshots.
    written_by: dict[str, str] = field(default_factory=dict)
    #: The format version it was read from (None: a manifest being written, in the version its commit says).
    version: int | None = None
    #: Version 3 (incremental): the sibling snapshots of its run directory whose data files it reads.
    references: tuple[str, ...] = ()
    #: Version 2: the snapshot's index files, read when first needed (``bytes_read`` counts them).
    indexes: Any = field(default=None, repr=False, compare=False)

    def lookup(self, rank: int, path: str, own_shards: bool = False) -> Entry | None:
        """The entry of ``path`` as seen by ``rank``: its own, else the replicated or sharded one.

        ``own_shards``: a sharded entry of a version-2 manifest may list only the shards of ``rank``'s own
        index (its ``complete()`` gives all): what a restore needs first, without reading every rank's index.
        """
        own = self.ranks[rank].get(path) if rank < len(self.ranks) else None
        if own is not None:
            return own
        shared = self.replicated.get(path)
        if shared is not None:
            return shared
        sharded = self.sharded  # a read manifest's table, or a dict being built
        if own_shards and isinstance(sharded, LazyEntries):
            return sharded.for_rank(rank, path)
        return sharded.get(path)

    def tables(self) -> Iterator[Mapping[str, Entry]]:
        """Each section once: every rank's own entries, then the replicated and the sharded ones. One table at a
        time: a crafted world size sizes no list, and the first index file missing raises."""
        return chain(self.ranks, (self.replicated, self.sharded))

    def check_entries(self) -> None:
        """Check every entry now: raises :class:`CorruptSnapshotError` for a malformed one."""
        for table in self.tables():
            check_all = getattr(table, "check_all", None)  # a parsed manifest's; a new one's are built by the take
            if check_all is not None:
                check_all()

    def paths_for(self, rank: int) -> dict[str, Entry]:
        merged = {**self.sharded, **self.replicated}
        if rank < len(self.ranks):
            merged.update(self.ranks[rank])
        return merged

    @gc_paused()
    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "version": 1,
            "checksum_algorithm": CHECKSUM_ALGORITHM,
            "world_size": self.world_size,
            "take_id": self.take_id,
            "metadata": self.metadata,
            "files": dict(self.files),
            "replicated": entries_to_json(self.replicated),
            "sharded": entries_to_json(self.sharded),
            "ranks": [entries_to_json(r) for r in self.ranks],
            **commit_stamp(),
        }
        return jsonio.dumps(doc, free_form=self.metadata)

    @classmethod
    def from_doc(cls, doc: dict[str, Any], where: str) -> "Manifest":
        """The manifest of a checked version-1 document."""
        files = doc["files"]
        return cls(
            world_size=doc["world_size"],
            ranks=[EntryTable(r, where, files, f"ranks[{i}]") for i, r in enumerate(doc["ranks"])],
            replicated=EntryTable(doc["replicated"], where, files, "replicated"),
            files=files,
            take_id=doc.get("take_id", ""),
            metadata=doc.get("metadata", {}),
            sharded=EntryTable(doc.get("sharded", {}), where, files, "sharded", only=EntryType.SHARDED),
            version=doc["version"], **read_stamp(doc),
        )


def parse_document(data: bytes, where: str) -> dict[str, Any]:
    """The checked top level of a manifest of any version (``CorruptSnapshotError`` / ``UnsupportedFormatError``)."""
    try:
        doc = jsonio.loads(data)
    except ValueError as e:  # not JSON, not UTF-8, or nested too deeply
        raise CorruptSnapshotError(f"{where} is not valid JSON ({e}); the snapshot is damaged") from e
    check_document(doc, where)
    return doc


def commit_stamp() -> dict[str, Any]:
    """The informative fields of a manifest of any version (readers ignore keys they do not know): the commit
    time and the versions that wrote it."""
    return {"committed_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "written_by": writer_versions()}


def read_stamp(doc: dict[str, Any]) -> dict[str, Any]:
    """:func:`commit_stamp`'s fields of a read manifest as :class:`Manifest` keeps them (absent or malformed:
    None and ``{}``; they are informative, never required)."""
    written_by = doc.get("written_by")
    return {"committed_at": doc["committed_at"] if isinstance(doc.get("committed_at"), str) else None,
            "written_by": {k: v for k, v in written_by.items() if isinstance(v, str)}
            if isinstance(written_by, dict) else {}}


def writer_versions() -> dict[str, str]:
    """The versions recorded in a manifest as ``written_by``."""
    try:
        ours = importlib.metadata.version("ppe-snapshot")
    except importlib.metadata.PackageNotFoundError:
        ours = "unknown"
    return {"ppe_snapshot": ours, "torch": torch.__version__}
