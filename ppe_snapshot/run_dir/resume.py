"""What the outcome of restoring one candidate means for resuming: skipped, fatal, or starting fresh unsafe.

The extension tries its candidates newest first and restores its target and
RNG states (``extension/saved_state.py``); here is what counts as skipped
before any state was touched (:class:`Unusable`), a target that does not fit
(:func:`target_changed`: never fall back), and what makes starting fresh
unsafe (:func:`cannot_start_fresh`: a restore that failed part way).
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Callable

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
