"""Retention: which snapshots under an output directory to remove, and removing them."""
from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from ppe_snapshot.run_dir.listing import Candidate, CandidateKind, list_snapshots
from ppe_snapshot.run_dir.names import FilenameFormat
from ppe_snapshot.run_dir.policies import Policy, as_policy
from ppe_snapshot.stored_snapshot import remove_snapshot, retire_snapshot

logger = logging.getLogger(__name__)


def select_prunable(candidates: list[Candidate], keep: int | Policy, rejected: Collection[str] = (),
                    protect: Collection[str] = (), own: Collection[str] = ()) -> list[Candidate]:
    """What retention removes from ``candidates`` (oldest first, as :func:`list_snapshots` gives them).

    ``keep``: an int (``n_retains``: the newest complete snapshots to keep; 0 or less keeps all) or a
    policy of :mod:`ppe_snapshot.retention` (``KeepLatest``, ``KeepEvery``, ``KeepBest``, ``a | b``),
    which decides among the complete snapshots. Whatever it says, never removed: the newest complete
    snapshot and anything newer (a save may be writing it), unless it is a leftover whose writers are
    provably gone (``Candidate.abandoned``); incomplete names whose directory holds a take in progress;
    names in ``protect`` (the snapshot autoload resumed from) until a complete snapshot newer than them
    exists; the newest complete snapshot among ``own`` (the names this run saved: a run started without
    autoload where an earlier run went further is outranked by that run's snapshots). Incomplete or damaged
    names older than the newest complete one are removed. Names in ``rejected`` (those autoload could not
    restore, though they pass the quick check) count as damaged: they are never kept in place of a good
    one. Retired names (a removed snapshot's data files, kept while incremental snapshots read them) are
    removed once no snapshot that stays references them; :func:`needed` says which a removed snapshot must
    leave its data files for.
    """
    policy = as_policy(keep)
    complete = [c for c in candidates if c.complete and c.name not in rejected]
    if not complete or not isinstance(keep, Policy) and keep <= 0:  # n_retains <= 0: retention is off (ppe)
        return []
    newest = complete[-1]
    kept = set(policy.keep(complete)) | {newest.name}
    kept |= {c.name for c in complete if c.name in protect and not any(c.is_older_than(o) for o in complete)}
    kept |= set([c.name for c in complete if c.name in own][-1:])
    stale = {id(c) for c in complete if c.name not in kept}
    for c in candidates:
        if c.abandoned or (c not in complete and c.kind != CandidateKind.RETIRED and not c.busy
                           and c.is_older_than(newest)):
            stale.add(id(c))
    referenced = needed(candidates, stale)
    stale |= {id(c) for c in candidates if c.kind == CandidateKind.RETIRED and c.name not in referenced}
    return [c for c in candidates if id(c) in stale]


def needed(candidates: list[Candidate], removed: Collection[int] = ()) -> set[str]:
    """The names whose data files the snapshots among ``candidates`` that stay (those whose ``id`` is not in
    ``removed``) read: an incremental snapshot's references."""
    return {name for c in candidates if id(c) not in removed for name in c.references}


def remove(candidate: Candidate, storage_options: dict[str, Any] | None = None, keep_data: bool = False) -> None:
    """Delete one snapshot; an engine snapshot loses its manifest first, so it is never seen half-removed.
    ``keep_data``: incremental snapshots that stay read its data files (it may even be damaged itself): it is
    retired, its data files kept."""
    if keep_data:
        retire_snapshot(candidate.url, storage_options)
    else:
        remove_snapshot(candidate.url, storage_options)


def prune(out_dir: str, fmt: str | FilenameFormat, keep: int | Policy,
          storage_options: dict[str, Any] | None = None, *, rejected: Collection[str] = (),
          protect: Collection[str] = (), own: Collection[str] = (), dry_run: bool = False,
          listed: list[Candidate] | None = None) -> list[str]:
    """Apply retention to ``out_dir``: see :func:`select_prunable`. Returns the removed locations (with
    ``dry_run``, those that would be removed; nothing is removed). ``listed``: what :func:`list_snapshots`
    gave for ``out_dir`` and ``fmt`` just now, when the caller has it (else it is listed here)."""
    policy = as_policy(keep)
    removed = []
    candidates = list_snapshots(out_dir, fmt, storage_options) if listed is None else listed
    prunable = select_prunable(candidates, policy, rejected, protect, own)
    referenced = needed(candidates, {id(c) for c in prunable})
    for c in prunable:
        if not dry_run:
            keep_data = c.name in referenced
            remove(c, storage_options, keep_data)
            logger.info("%s %s: %s (retention: %r)", "retired (data files kept for the incremental snapshots "
                        "that read them)" if keep_data else "removed",
                        c.describe(), c.kind, policy)
        removed.append(c.url)
    return removed
