"""Retention: which snapshots under an output directory to remove, and removing them."""
from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from ppe_snapshot.run_dir.listing import Candidate, list_snapshots
from ppe_snapshot.run_dir.names import FilenameFormat
from ppe_snapshot.writing import remove_snapshot

logger = logging.getLogger(__name__)


def select_prunable(candidates: list[Candidate], n_retains: int,
                    rejected: Collection[str] = ()) -> list[Candidate]:
    """What retention removes from ``candidates`` (oldest first, as :func:`list_snapshots` gives them).

    Keeps the ``n_retains`` newest complete snapshots; removes older complete
    ones, and incomplete or damaged ones known to be older than the newest
    complete one whose directory holds no take in progress. Never the newest
    complete one, nor anything newer (a save may be writing it). Names in
    ``rejected`` (those autoload could not restore, though they pass the
    quick check) count as damaged: they are never kept in place of a good one.
    """
    complete = [c for c in candidates if c.complete and c.name not in rejected]
    if n_retains <= 0 or not complete:
        return []
    newest = complete[-1]
    stale = set(id(c) for c in complete[:-n_retains])
    for c in candidates:
        if c not in complete and not c.busy and c.is_older_than(newest):
            stale.add(id(c))
    return [c for c in candidates if id(c) in stale]


def remove(candidate: Candidate, storage_options: dict[str, Any] | None = None) -> None:
    """Delete one snapshot; an engine snapshot loses its manifest first, so it is never seen half-removed."""
    remove_snapshot(candidate.url, storage_options)


def prune(out_dir: str, fmt: str | FilenameFormat, n_retains: int,
          storage_options: dict[str, Any] | None = None, *, rejected: Collection[str] = ()) -> list[str]:
    """Apply retention to ``out_dir``: see :func:`select_prunable`. Returns the removed locations."""
    removed = []
    for c in select_prunable(list_snapshots(out_dir, fmt, storage_options), n_retains, rejected):
        remove(c, storage_options)
        logger.info("removed %s: %s (keeping the %d newest)", c.describe(), c.kind, n_retains)
        removed.append(c.url)
    return removed
