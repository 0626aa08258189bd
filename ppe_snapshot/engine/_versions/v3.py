"""Format version 3: an incremental snapshot, version 2 whose index files also name data files of sibling
snapshots, listed in the manifest's ``references`` (``docs/format.md``, section 12).

Version 2's steps write it whenever a take's files include such references (``manifest_v2.top_bytes``); it reads
with a check of its own, and answers the read paths as version 2 does.
"""
from __future__ import annotations

from typing import Any

from ppe_snapshot.engine._format import document_v3_problem
from ppe_snapshot.engine._versions.v2 import Version2


class Version3(Version2):
    number = 3
    written = False  # written by incremental takes, never asked for by PPE_SNAPSHOT_FORMAT_VERSION

    def problem(self, doc: dict[str, Any]) -> str | None:
        return document_v3_problem(doc)


VERSION = Version3()
