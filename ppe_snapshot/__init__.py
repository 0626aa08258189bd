"""ppe-snapshot: fast, atomic, resumable snapshots for PyTorch training loops."""
from ppe_snapshot.engine import PendingSnapshot, RNGState, Snapshot, StateDict, Stateful
from ppe_snapshot.errors import (
    CorruptSnapshotError, SnapshotError, SnapshotExistsError, SnapshotNotFoundError, StateMismatchError,
    UnsupportedFormatError, UnsupportedValueError,
)

__version__ = "0.1.0"

__all__ = [
    "CorruptSnapshotError", "PendingSnapshot", "RNGState", "Snapshot", "SnapshotError", "SnapshotExistsError",
    "SnapshotNotFoundError", "StateDict", "Stateful", "StateMismatchError", "UnsupportedFormatError",
    "UnsupportedValueError",
]
