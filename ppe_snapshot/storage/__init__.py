"""The ground floor: where snapshot bytes go (a local fast path, fsspec for everything else).

Imports nothing of ours but :mod:`ppe_snapshot.errors` and :mod:`ppe_snapshot.settings`.
``open_storage`` picks the backend from the path. Floors above use only the names exported here.
(The DCP adapters' old names here, ``SnapshotStorageWriter`` / ``SnapshotStorageReader``, are a deprecation
shim of ``ppe_snapshot/__init__.py``: this package names nothing above it.)
"""
from __future__ import annotations

from typing import Any

from ppe_snapshot.storage.base import (
    BlobWriter, Storage, forget_listings, is_safe_relative, split_reference,
)
from ppe_snapshot.storage.fsspec import FsspecStorage, fsspec_storage, open_url, url_to_fs
from ppe_snapshot.storage.local import LocalStorage
from ppe_snapshot.storage.pools import shared_pool
from ppe_snapshot.storage.swap import exchange, sync_directory
from ppe_snapshot.storage.tuning import Tuning, split_tuning


def is_local(path: str) -> bool:
    """Whether ``path`` names the local file system (a plain path or ``file://``)."""
    return "://" not in path or path.startswith("file://")


def local_path(location: str, storage_options: dict[str, Any] | None = None) -> str | None:
    """The path on the local file system that ``location`` names (``file://`` stripped), or None where it is
    another file system's or ``storage_options`` ask for fsspec (the object-store knobs alone do not)."""
    location = str(location)
    if not is_local(location) or split_tuning(storage_options)[1]:
        return None
    return location.removeprefix("file://")


def open_storage(path: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """The storage rooted at snapshot location ``path`` (a local path or any fsspec URL)."""
    path = str(path)
    local = local_path(path, storage_options)
    return LocalStorage(local, url=path) if local is not None else fsspec_storage(path, storage_options)


def join(base: str, name: str) -> str:
    """``base/name`` for both local paths and URLs."""
    return f"{base.rstrip('/')}/{name}" if base else name


__all__ = ["BlobWriter", "FsspecStorage", "LocalStorage", "Storage", "Tuning", "exchange", "forget_listings",
           "is_local", "is_safe_relative", "join", "local_path", "open_storage", "open_url",
           "shared_pool", "split_reference", "split_tuning", "sync_directory", "url_to_fs"]
