"""What a format version is: the record every other part of the engine asks, never a version number.

One :class:`FormatVersion` per version (``v1.py``, ``v2.py``, ``v3.py``), one row each in ``table.VERSIONS``. The
steps (``problem`` ... ``clean``) are the ones that differ between versions when a manifest is read, written or
committed by several ranks; the questions (``indexed`` ... ``more_shards``) are what the read paths ask of the
manifest at hand instead of testing its types or attributes, which only the version modules know.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from ppe_snapshot.engine._format import Entry, Index, Manifest, Shard, ShardedTensorEntry
from ppe_snapshot.engine._versions.protocol import RankPart
from ppe_snapshot.storage import Storage

#: What a rank of a multi-rank take expects of the state written once for all (see ``commit_v2.expected_shared``).
Shared = tuple[list[str], dict[str, Any]]


class FormatVersion:
    """The steps and answers of one format version (the defaults: version 1's answers, entries in memory)."""

    #: The number in ``manifest.json``'s ``version``.
    number: int
    #: Whether ``PPE_SNAPSHOT_FORMAT_VERSION`` may ask takes to write it.
    written: bool = False
    #: Whether a take writing it may reference a base's data files (an incremental take).
    references: bool = False
    #: Whether the ranks of a multi-rank take publish the :data:`Shared` state they expect.
    shares: bool = False
    #: Whether its entries are stored as index files' columns (the bulk restore path reads them so).
    indexed: bool = False

    def problem(self, doc: dict[str, Any]) -> str | None:
        """What is wrong with a manifest's fields beyond ``parse_document``'s (None: nothing)."""
        raise NotImplementedError

    def read(self, storage: Storage, doc: dict[str, Any], where: str) -> Manifest:
        """The manifest of a checked document."""
        raise NotImplementedError

    def write(self, storage: Storage, manifest: Manifest) -> None:
        """Write a manifest built in one process (checked to restore already), its ``manifest.json`` last."""
        raise NotImplementedError

    def publish(self, storage: Storage, take_id: str, part: RankPart, shared: Shared) -> None:
        """A rank of a multi-rank take publishes its part, once its data is durable."""
        raise NotImplementedError

    def merge_and_commit(self, storage: Storage, take_id: str, world_size: int, metadata: dict[str, Any],
                         timeout: float | None) -> None:
        """Rank 0 of a multi-rank take: merge the parts every rank published and commit."""
        raise NotImplementedError

    def clean(self, storage: Storage, take_id: str, world_size: int) -> None:
        """Remove what a committed take left under ``.parts/``."""
        raise NotImplementedError

    # -- what the read paths ask ---------------------------------------------------------------------------
    def columns(self, table: Mapping[str, Entry]) -> Index | None:
        """The index file holding one table of the manifest (a rank's entries, the replicated ones) as columns;
        None where its entries are held one by one."""
        return None

    def own_shards(self, manifest: Manifest, rank: int, path: str) -> ShardedTensorEntry | None:
        """Sharded tensor ``path`` with at least the shards rank ``rank`` wrote (all of them, where that costs
        no more); None when the manifest has none of that path."""
        return manifest.sharded.get(path)

    def more_shards(self, entry: ShardedTensorEntry) -> Callable[[], list[Shard]] | None:
        """Where a sharded entry looked up with ``own_shards`` may lack other ranks' shards: what gives every
        shard (it may read every rank's index); None when the entry holds them all."""
        return None

    def file_sizes(self, manifest: Manifest, rank: int) -> dict[str, int]:
        """The sizes of the data files rank ``rank``'s entries and the shared ones may name."""
        return dict(manifest.files)
