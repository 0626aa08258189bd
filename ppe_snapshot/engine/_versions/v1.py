"""Format version 1: one JSON manifest holding every entry (``docs/format.md``, sections 1-10).

Its entries are held one by one (``EntryTable``), every shard of a sharded tensor in its one entry: the read
paths' questions get :class:`FormatVersion`'s default answers.
"""
from __future__ import annotations

from typing import Any

from ppe_snapshot.engine._format import MANIFEST_NAME, Manifest, document_problem
from ppe_snapshot.engine._versions.protocol import (
    RankPart, check_commit, gather_parts, merge, publish_part, remove_parts,
)
from ppe_snapshot.engine._versions.version import FormatVersion, Shared
from ppe_snapshot.storage import Storage


class Version1(FormatVersion):
    number = 1
    written = True

    def problem(self, doc: dict[str, Any]) -> str | None:
        return document_problem(doc)

    def read(self, storage: Storage, doc: dict[str, Any], where: str) -> Manifest:
        return Manifest.from_doc(doc, where)

    def write(self, storage: Storage, manifest: Manifest) -> None:
        storage.put_atomic(MANIFEST_NAME, manifest.to_bytes())

    def publish(self, storage: Storage, take_id: str, part: RankPart, shared: Shared) -> None:
        publish_part(storage, take_id, part)

    def merge_and_commit(self, storage: Storage, take_id: str, world_size: int, metadata: dict[str, Any],
                         timeout: float | None) -> None:
        manifest = merge(gather_parts(storage, take_id, world_size, timeout), take_id, metadata)
        check_commit(storage, manifest)
        self.write(storage, manifest)

    def clean(self, storage: Storage, take_id: str, world_size: int) -> None:
        remove_parts(storage, take_id, world_size)


VERSION = Version1()
