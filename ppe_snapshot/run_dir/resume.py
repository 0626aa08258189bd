"""Choosing what to resume from: the newest candidate that restores, the others skipped with a warning.

What restoring one candidate means is the caller's (the extension restores
its target and the RNG states); here is the order they are tried in, what
counts as skipped before any state was touched (:class:`Unusable`) and
what makes starting fresh unsafe (a restore that failed part way).
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from ppe_snapshot.engine import LOCAL, Snapshot
from ppe_snapshot.errors import AutoloadSkipWarning, SnapshotError, StateMismatchError
from ppe_snapshot.run_dir.listing import Candidate

logger = logging.getLogger(__name__)


class Unusable(Exception):
    """A candidate that cannot be restored, found before any state was touched."""


def cannot_start_fresh(what: str) -> SnapshotError:
    return SnapshotError(
        f"autoload: restoring {what} failed part way, so the target's state may be partly overwritten, and no "
        "older snapshot could be restored; training cannot start fresh safely. Repair or remove the damaged "
        "snapshots, or start with autoload=False.")


def skip(candidate: Candidate, reason: str) -> None:
    """Say (at WARNING) that autoload does not use ``candidate``; see :class:`AutoloadSkipWarning`."""
    message = f"autoload: skipping snapshot {candidate.url}: {reason}"
    logger.warning(message)
    warnings.warn(f"ppe_snapshot {message}", AutoloadSkipWarning, stacklevel=4)


def holds_iteration(location: str, storage_options: dict[str, Any] | None, iteration: int) -> bool:
    """Whether a committed snapshot at ``location`` records training position ``iteration``."""
    try:
        metadata = Snapshot(location, pg=LOCAL, storage_options=storage_options).metadata
    except Exception:  # noqa: BLE001 - absent or unreadable: not a committed snapshot
        return False
    return metadata.get("iteration") == iteration


def opened(candidate: Candidate, pg: Any, storage_options: dict[str, Any] | None,
           allow_pickle: bool) -> tuple[Snapshot, dict[str, Any]]:
    """The engine snapshot of ``candidate`` and its metadata; :class:`Unusable` when its manifest is not sound."""
    snap = Snapshot(candidate.url, pg=pg, storage_options=storage_options, allow_pickle=allow_pickle)
    try:
        metadata = snap.metadata
    except Exception as e:  # noqa: BLE001 - CorruptSnapshotError, UnsupportedFormatError, I/O: nothing touched yet
        raise Unusable(f"{type(e).__name__}: {e}") from e
    return snap, metadata


@dataclass(frozen=True)
class Failure:
    """Why one candidate could not be restored: ``error`` is None when nothing was touched (:class:`Unusable`)."""
    reason: str
    error: Exception | None
    #: The snapshot is sound but the target does not fit it (a changed model): not damage, so no older snapshot
    #: is tried (:func:`target_changed`).
    mismatch: bool = False


def attempt(restore: Callable[[], None]) -> Failure | None:
    """Run ``restore()``; None when it restored, else why not."""
    try:
        restore()
    except Unusable as e:
        return Failure(str(e), None)
    except StateMismatchError as e:
        return Failure(str(e), e, mismatch=True)
    except Exception as e:  # noqa: BLE001 - a damaged snapshot is skipped, the next older one tried
        return Failure(f"{type(e).__name__}: {e}", e)
    return None


def target_changed(url: str, reason: str) -> StateMismatchError:
    """The error of an autoload whose target does not fit the newest snapshot (the model or optimizer changed)."""
    return StateMismatchError(
        f"autoload: the model, optimizer or other state being restored does not fit snapshot {url}, so it was not "
        f"resumed from (was the model changed since that run?): {reason}. Resume with the state that was saved, or "
        "start with autoload=False or another output directory.")


def restore_newest(candidates: list[Candidate], restore: Callable[[Candidate], None],
                   skip_one: Callable[[Candidate, str], None]) -> Candidate | None:
    """Restore the newest of ``candidates`` (oldest first) that ``restore`` restores; ``skip_one`` each that
    fails. None when none is left; :func:`cannot_start_fresh` when one failed part way and none restored."""
    touched: tuple[Candidate, Exception] | None = None
    for candidate in reversed(candidates):
        failure = attempt(lambda: restore(candidate))
        if failure is None:
            return candidate
        if failure.mismatch:
            raise target_changed(candidate.url, failure.reason) from failure.error
        skip_one(candidate, failure.reason)
        if failure.error is not None:
            touched = (candidate, failure.error)
    if touched is not None:
        raise cannot_start_fresh(f"{touched[0].url} ({touched[1]})") from touched[1]
    return None
