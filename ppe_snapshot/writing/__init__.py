"""Writers: where a save runs (the caller, a thread, a worker process).

``SimpleWriter`` saves in the caller. ``ThreadWriter`` / ``ThreadQueueWriter``
and ``ProcessWriter`` / ``ProcessQueueWriter`` block the caller only while
the state is staged into host buffers they own and reuse, then write and
commit in the background. All of them are ``pytorch_pfn_extras`` writers,
and each is a :class:`SnapshotWriter`, the contract the snapshot extension
relies on (:mod:`ppe_snapshot.writing.contract`).

A name that already holds a snapshot is saved again beside it (its side
name, :mod:`ppe_snapshot.stored_snapshot`) and the new snapshot then takes
the name (``_replace``).

The classes are imported on first use: the ProcessWriter's worker imports
``ppe_snapshot.writing._worker``, and keeping this package lazy spares it the
import of ``pytorch_pfn_extras`` (seconds per worker start).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "SimpleWriter": "_ppe_writers",
    "ThreadWriter": "_ppe_writers",
    "ThreadQueueWriter": "_ppe_writers",
    "ProcessWriter": "_ppe_writers",
    "ProcessQueueWriter": "_ppe_writers",
    "BackgroundAbortError": "_errors",
    "BackgroundSaveError": "_errors",
    "ImageLoan": "contract",
    "SaveStats": "contract",
    "SnapshotWriter": "contract",
    "StagingBuffers": "_buffers",  # (not public: the local tier's saves keep their buffer the writers' way)
}

__all__ = ["BackgroundAbortError", "BackgroundSaveError", "ImageLoan", "ProcessQueueWriter", "ProcessWriter", "SaveStats",
           "SimpleWriter", "SnapshotWriter", "ThreadQueueWriter", "ThreadWriter"]

if TYPE_CHECKING:
    from ppe_snapshot.writing._errors import BackgroundAbortError, BackgroundSaveError
    from ppe_snapshot.writing._ppe_writers import (
        ProcessQueueWriter, ProcessWriter, SimpleWriter, ThreadQueueWriter, ThreadWriter,
    )
    from ppe_snapshot.writing._buffers import StagingBuffers
    from ppe_snapshot.writing.contract import ImageLoan, SaveStats, SnapshotWriter


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
