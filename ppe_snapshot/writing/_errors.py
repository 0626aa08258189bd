"""How a save that failed in the background reaches the caller."""
from __future__ import annotations

import sys
import traceback

from ppe_snapshot.errors import SnapshotAbortedError, SnapshotError


class BackgroundSaveError(SnapshotError, RuntimeError):
    """A save that ran in the background failed; raised at the writer's next call, ``wait()`` or ``finalize()``.

    A ``RuntimeError``, as ppe's writers raise for a failed worker. The
    original exception is the ``__cause__``; the message holds its traceback
    from the thread or worker process that ran the save.
    """
    __module__ = "ppe_snapshot.writing"  # where users import it from, as tracebacks name it


class BackgroundAbortError(BackgroundSaveError, SnapshotAbortedError):
    """A save of several ranks that ran in the background was aborted because another rank failed or died:
    both a :class:`BackgroundSaveError` and a :class:`~ppe_snapshot.errors.SnapshotAbortedError`."""
    __module__ = "ppe_snapshot.writing"


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)``; on Python 3.10 the note is kept in ``__notes__`` but not printed."""
    if sys.version_info >= (3, 11):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]


def surfaced(error: BaseException) -> BackgroundSaveError:
    """The error to raise in the caller for a background ``error``; raise it ``from error``."""
    if isinstance(error, BackgroundSaveError):
        return error
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip()
    if sys.version_info < (3, 11):  # the notes (the worker's traceback among them) are not printed there
        text = "\n".join([text, *getattr(error, "__notes__", [])])
    kind = BackgroundAbortError if isinstance(error, SnapshotAbortedError) else BackgroundSaveError
    return kind(f"a snapshot save failed in the background: {type(error).__name__}: {error}\n{text}")
