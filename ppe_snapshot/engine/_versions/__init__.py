"""The format versions: the version record that every other part of the engine asks, each version's steps,
reading any manifest, committing one, upgrading to a self-contained version 2.

The face of this subpackage: what the rest of the engine uses of it (modules here import each other directly).
"""
from ppe_snapshot.engine._versions.protocol import RankPart, abort, merge, refuse_overwrite
from ppe_snapshot.engine._versions.referenced import referenced_bytes
from ppe_snapshot.engine._versions.table import (
    Shared, can_reference, clean_parts, commit, expected_shared, merge_and_commit, publish, read_manifest, upgrade,
    write_version,
)

__all__ = [
    "abort", "can_reference", "clean_parts", "commit", "expected_shared", "merge", "merge_and_commit", "publish",
    "RankPart", "read_manifest", "referenced_bytes", "refuse_overwrite", "Shared", "upgrade", "write_version",
]
