"""The format versions: the version record that every other part of the engine asks, each version's steps,
reading any manifest, committing one, upgrading to a self-contained version 2.

The face of this subpackage: what the rest of the engine uses of it (modules here import each other directly).
"""
from ppe_snapshot.engine._versions.protocol import RankPart, abort, check_structure, merge, refuse_overwrite
from ppe_snapshot.engine._versions.referenced import referenced_bytes
from ppe_snapshot.engine._versions.table import (
    can_reference, clean_parts, commit, expected_shared, merge_and_commit, publish, read_manifest, upgrade,
    version_of, write_version,
)
from ppe_snapshot.engine._versions.version import FormatVersion, Shared

__all__ = [
    "abort", "can_reference", "check_structure", "clean_parts", "commit", "expected_shared", "FormatVersion",
    "merge", "merge_and_commit", "publish", "RankPart", "read_manifest", "referenced_bytes", "refuse_overwrite",
    "Shared", "upgrade", "version_of", "write_version",
]
