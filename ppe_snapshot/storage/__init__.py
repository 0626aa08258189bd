"""Where snapshot bytes go: a local fast path and fsspec for everything else.

``open_storage`` picks the backend from the path; the DCP adapters in
:mod:`ppe_snapshot.storage.protocol` build on the same classes.
"""
from __future__ import annotations

from typing import Any

from ppe_snapshot.storage.base import BlobWriter, Storage
from ppe_snapshot.storage.fsspec import FsspecStorage, fsspec_storage
from ppe_snapshot.storage.local import LocalStorage


def is_local(path: str) -> bool:
    """Whether ``path`` names the local file system (a plain path or ``file://``)."""
    return "://" not in path or path.startswith("file://")


def open_storage(path: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """The storage rooted at snapshot location ``path`` (a local path or any fsspec URL)."""
    path = str(path)
    if is_local(path) and not storage_options:
        return LocalStorage(path[len("file://"):] if path.startswith("file://") else path, url=path)
    return fsspec_storage(path, storage_options)


def join(base: str, name: str) -> str:
    """``base/name`` for both local paths and URLs."""
    return f"{base.rstrip('/')}/{name}" if base else name


def __getattr__(name: str) -> Any:
    # The DCP adapters import the engine, which imports this package: load them on first use.
    if name in ("SnapshotStorageReader", "SnapshotStorageWriter"):
        from ppe_snapshot.storage import protocol
        return getattr(protocol, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BlobWriter", "FsspecStorage", "LocalStorage", "SnapshotStorageReader", "SnapshotStorageWriter", "Storage",
           "is_local", "join", "open_storage"]
