"""Format version 2: a small ``manifest.json`` over index files (``docs/format.md``, section 11).

Its tables (``manifest_v2``) hold their entries as an index file's columns; a sharded tensor looked up for a
restoring rank holds that rank's own shards first, the rest read from every rank's index when needed.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from ppe_snapshot.engine._format import (
    Entry, Index, IndexTable, Manifest, Shard, ShardedTensorEntry, document_v2_problem,
)
from ppe_snapshot.engine._versions import commit_v2, manifest_v2
from ppe_snapshot.engine._versions.protocol import RankPart, remove_parts
from ppe_snapshot.engine._versions.version import FormatVersion, Shared
from ppe_snapshot.storage import Storage


class Version2(FormatVersion):
    number = 2
    written = True
    references = True
    shares = True
    indexed = True

    def problem(self, doc: dict[str, Any]) -> str | None:
        return document_v2_problem(doc)

    def read(self, storage: Storage, doc: dict[str, Any], where: str) -> Manifest:
        return manifest_v2.read(storage, doc, where)

    def write(self, storage: Storage, manifest: Manifest) -> None:
        manifest_v2.write_manifest(storage, manifest)

    def publish(self, storage: Storage, take_id: str, part: RankPart, shared: Shared) -> None:
        commit_v2.publish(storage, take_id, part, shared)

    def merge_and_commit(self, storage: Storage, take_id: str, world_size: int, metadata: dict[str, Any],
                         timeout: float | None) -> None:
        commit_v2.merge_and_commit(storage, take_id, world_size, metadata, timeout)

    def clean(self, storage: Storage, take_id: str, world_size: int) -> None:
        remove_parts(storage, take_id, world_size)
        commit_v2.clean_details(storage, take_id, world_size)

    def columns(self, table: Mapping[str, Entry]) -> Index | None:
        table = getattr(table, "table", table)  # a rank's or the shared table, its index file read now
        return table.index if isinstance(table, IndexTable) else None

    def own_shards(self, manifest: Manifest, rank: int, path: str) -> ShardedTensorEntry | None:
        sharded = manifest.sharded
        if isinstance(sharded, manifest_v2.ShardedTable):  # the shards of the rank's own index only
            return sharded.for_rank(rank, path)
        return sharded.get(path)  # a manifest built in memory: every shard in its entry

    def more_shards(self, entry: ShardedTensorEntry) -> Callable[[], list[Shard]] | None:
        return entry.complete

    def file_sizes(self, manifest: Manifest, rank: int) -> dict[str, int]:
        indexes = manifest.indexes
        if indexes is None:
            return dict(manifest.files)
        sizes = dict(indexes.shared().files)
        if rank < manifest.world_size:
            sizes.update(indexes.rank(rank).files)
        return sizes


VERSION = Version2()
