"""ppe-snapshot: fast, atomic, resumable snapshots for PyTorch training loops."""
from ppe_snapshot.engine import OptimizerState, PendingSnapshot, RNGState, Snapshot, StateDict, Stateful
from ppe_snapshot.errors import (
    AutoloadSkipWarning, CorruptSnapshotError, Preempted, SnapshotAbortedError, SnapshotError, SnapshotExistsError,
    SnapshotNotFoundError, StateMismatchError, UnsupportedFormatError, UnsupportedValueError,
)

# The subpackages are usable after ``import ppe_snapshot`` alone. None of them imports
# pytorch_pfn_extras here (``writing`` loads its writers on first use), so the
# ProcessWriter's worker process, which imports this package, stays light.
from ppe_snapshot import retention, storage, writing  # noqa: E402,F401

__version__ = "0.1.0"

__all__ = [
    "AutoloadSkipWarning", "CorruptSnapshotError", "OptimizerState", "PendingSnapshot", "Preempted", "RNGState",
    "Snapshot", "SnapshotAbortedError", "SnapshotError", "SnapshotExistsError", "SnapshotMode", "SnapshotNotFoundError",
    "StateDict", "Stateful", "StateMismatchError", "UnsupportedFormatError", "UnsupportedValueError", "retention",
    "epoch_batches", "load_snapshot", "snapshot", "snapshot_object", "storage", "writing",
]

_EXTENSION = ("SnapshotMode", "epoch_batches", "load_snapshot", "snapshot", "snapshot_object")


def __getattr__(name: str):
    # The extension imports pytorch_pfn_extras; loading it on first use keeps
    # processes that need only the engine (the ProcessWriter's worker) light.
    if name in _EXTENSION:
        from ppe_snapshot import extension
        return getattr(extension, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXTENSION})
