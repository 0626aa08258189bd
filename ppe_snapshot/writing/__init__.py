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
    "SimpleWriter": "_base",
    "ThreadWriter": "_thread",
    "ThreadQueueWriter": "_thread",
    "ProcessWriter": "_process",
    "ProcessQueueWriter": "_process",
    "BackgroundAbortError": "_async",
    "BackgroundSaveError": "_async",
    "SaveStats": "contract",
    "SnapshotWriter": "contract",
    "is_ppe_default_fs": "_base",
}

__all__ = sorted(_HOMES)

if TYPE_CHECKING:
    from ppe_snapshot.writing._async import BackgroundAbortError, BackgroundSaveError
    from ppe_snapshot.writing._base import SimpleWriter, is_ppe_default_fs
    from ppe_snapshot.writing._process import ProcessQueueWriter, ProcessWriter
    from ppe_snapshot.writing._thread import ThreadQueueWriter, ThreadWriter
    from ppe_snapshot.writing.contract import SaveStats, SnapshotWriter


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
