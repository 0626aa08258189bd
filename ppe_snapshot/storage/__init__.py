"""The ground floor: where snapshot bytes go (a local fast path, fsspec for everything else), and every file operation
of the floors above (:func:`open_tree`).

Imports nothing of ours but :mod:`ppe_snapshot.errors` and :mod:`ppe_snapshot.settings`.
``open_storage`` picks the backend from the path; each object store's particulars are its profile
(``stores/``, :func:`register_store`). Floors above use only the names exported here.
(The DCP adapters' old names here, ``SnapshotStorageWriter`` / ``SnapshotStorageReader``, are a deprecation
shim of ``ppe_snapshot/__init__.py``: this package names nothing above it.)
"""
from __future__ import annotations

from typing import Any

from ppe_snapshot.storage.base import (
    AfterRead, BlobWriter, Storage, is_safe_relative, snapshot_location, split_reference,
)
from ppe_snapshot.storage.fsspec import FsspecStorage, fsspec_storage, open_url, url_to_fs
from ppe_snapshot.storage.local import LocalStorage
from ppe_snapshot.storage.pages import mapped
from ppe_snapshot.storage.pools import shared_pool
from ppe_snapshot.storage.stores import StoreProfile, register_store
from ppe_snapshot.storage.trees import (
    LocalTree, Tree, absolute, anchored, in_one_process, is_known_location, local_path, memory_backed_dir, open_tree,
    remove_local_shadow,
)
from ppe_snapshot.storage.tuning import Tuning, split_tuning
from ppe_snapshot.storage.unchanged import UnchangedFiles, open_unchanged, record_files


def open_storage(path: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """The storage rooted at snapshot location ``path`` (a local path or any fsspec URL)."""
    path = snapshot_location(path)
    local = local_path(path, storage_options)
    return LocalStorage(local, url=path) if local is not None else fsspec_storage(path, storage_options)


def join(base: str, name: str) -> str:
    """``base/name`` for both local paths and URLs."""
    return f"{base.rstrip('/')}/{name}" if base else name


__all__ = ["AfterRead", "BlobWriter", "FsspecStorage", "LocalStorage", "LocalTree", "Storage", "StoreProfile", "Tree",
           "Tuning", "UnchangedFiles", "absolute", "anchored", "in_one_process", "is_known_location",
           "is_safe_relative", "join", "mapped", "memory_backed_dir", "open_storage", "open_tree", "open_unchanged",
           "open_url", "record_files", "register_store", "remove_local_shadow", "shared_pool", "snapshot_location",
           "split_reference", "split_tuning", "url_to_fs"]
