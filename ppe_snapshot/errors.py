"""Exceptions raised by ppe-snapshot, and the category of its one warning that is also logged.

Each exception also derives from the built-in exception a caller would naturally
catch (``FileNotFoundError``, ``ValueError``, ...), so generic handlers keep
working.
"""
import warnings


class SnapshotError(Exception):
    """Base class of every error raised by ppe-snapshot."""


class SnapshotNotFoundError(SnapshotError, FileNotFoundError):
    """No committed snapshot (no manifest) exists at the given path."""


class SnapshotAbortedError(SnapshotError, RuntimeError):
    """A snapshot taken by several ranks was not committed because a rank failed; the message names it and why."""


class SnapshotExistsError(SnapshotError, FileExistsError):
    """A committed snapshot already exists where a new one was to be taken."""


class CorruptSnapshotError(SnapshotError, ValueError):
    """The snapshot's manifest or data is damaged: truncated, checksum mismatch, unparsable."""


class MissingBaseError(CorruptSnapshotError):
    """An incremental snapshot reads bytes from another snapshot of its run directory that is not there (moved
    or copied without it); the message names it."""


class UnsupportedFormatError(SnapshotError, ValueError):
    """The manifest was written by a newer (or unknown) format version, or the path holds a file of no kind that
    ppe-snapshot reads (neither a snapshot, a torch.save file, a DCP directory nor a safetensors file)."""


class StateMismatchError(SnapshotError, ValueError):
    """The restore target does not match the saved state (missing key, shape or dtype)."""


class UnsupportedValueError(SnapshotError, TypeError):
    """A value can only be saved with pickle, and pickle was not allowed."""


class Preempted(SystemExit):
    """Raised by the snapshot extension (``save_on_signals``) once the snapshot a preemption signal asked for
    is durable. A ``SystemExit``: uncaught, the process exits with ``code``, by default ``128 + signal number``
    (143 for SIGTERM, as a process killed by it), or the extension's ``preempted_exit_code``."""

    def __init__(self, code: int, signum: int, iteration: int, snapshot: str | None) -> None:
        super().__init__(code)
        #: The signal that asked for it, the iteration saved, and the snapshot's name (None if none was taken).
        self.signum = signum
        self.iteration = iteration
        self.snapshot = snapshot

    def __str__(self) -> str:
        return (f"preempted by signal {self.signum} at iteration {self.iteration}; saved {self.snapshot}; "
                f"exit status {self.code}")


class AutoloadSkipWarning(UserWarning):
    """Autoload passed over a snapshot (the message names it and why).

    Reported once to the operator, through the ``ppe_snapshot`` loggers at WARNING level. It is also issued as
    this warning, which Python ignores unless asked for (``pytest.warns``, ``warnings.simplefilter("always")``,
    ``-W always::ppe_snapshot.AutoloadSkipWarning``), so that a test can catch it without the log line being
    printed twice.
    """


warnings.filterwarnings("ignore", category=AutoloadSkipWarning)
