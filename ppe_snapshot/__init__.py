"""ppe-snapshot: fast, atomic, resumable snapshots for PyTorch training loops."""
import warnings

from ppe_snapshot.engine import OptimizerState, PendingSnapshot, RNGState, Snapshot, StateDict, Stateful
from ppe_snapshot.errors import (
    AutoloadSkipWarning, CorruptSnapshotError, MissingBaseError, Preempted, SnapshotAbortedError, SnapshotError,
    SnapshotExistsError, SnapshotNotFoundError, StateMismatchError, UnsupportedFormatError, UnsupportedValueError,
)

# The subpackages are usable after ``import ppe_snapshot`` alone. None of them imports
# pytorch_pfn_extras here (``writing`` loads its writers on first use), so the
# ProcessWriter's worker process, which imports this package, stays light.
from ppe_snapshot import retention, storage, writing  # noqa: E402,F401

__version__ = "0.1.0"

__all__ = [
    "AutoloadSkipWarning", "CorruptSnapshotError", "LocalTier", "MissingBaseError", "OptimizerState", "PendingSnapshot",
    "Preempted", "RNGState",
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
    if name == "LocalTier":  # with the extension it serves
        from ppe_snapshot.local_tier import LocalTier
        return LocalTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXTENSION, "LocalTier"})


#: The DCP adapters' old import path, ``ppe_snapshot.storage.<name>``: kept working, with a DeprecationWarning.
_MOVED_FROM_STORAGE = ("SnapshotStorageReader", "SnapshotStorageWriter")


def _moved_from_storage(name: str):
    if name in _MOVED_FROM_STORAGE:
        warnings.warn(f"ppe_snapshot.storage.{name} is deprecated: import it from ppe_snapshot.dcp",
                      DeprecationWarning, stacklevel=2)
        from ppe_snapshot import dcp
        return getattr(dcp, name)
    raise AttributeError(f"module 'ppe_snapshot.storage' has no attribute {name!r}")


# The shim lives here, above both packages, so that storage names nothing above it.
storage.__getattr__ = _moved_from_storage  # type: ignore[attr-defined]
