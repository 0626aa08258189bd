"""Storage on any fsspec file system (``s3://``, ``gs://``, ``memory://``, ...)."""
from __future__ import annotations

import uuid
from typing import Any, Callable, Sequence, TypeVar

import fsspec

from ppe_snapshot.storage.base import BlobWriter, Storage, check_stored_size, naming_missing_base, split_reference
from ppe_snapshot.storage.multipart import MultipartWriter, byte_view, check_part_size, supports_multipart
from ppe_snapshot.storage.ranged import RangedReader, read_range
from ppe_snapshot.storage.stores import profile_of, profile_of_url
from ppe_snapshot.storage.tuning import Tuning, split_tuning

T = TypeVar("T")


# File systems without S3's multipart protocol stream through fsspec's file object, in blocks of this size.
_BLOCK_SIZE = 64 << 20


class _FsspecBlobWriter(BlobWriter):
    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        self._fs = fs
        self._path = path
        self._file = fs.open(path, "wb", block_size=_BLOCK_SIZE)
        self._size = 0

    def write(self, buffers: Sequence[memoryview]) -> None:
        for b in buffers:
            if b.nbytes:
                self._file.write(b)
                self._size += b.nbytes

    def close(self) -> int:
        self._file.close()
        return check_stored_size(self._fs, self._path, self._size)

    def abort(self) -> None:
        discard = getattr(self._file, "discard", None)
        try:
            if discard is not None:
                discard()  # object stores: never complete the upload
                self._file.closed = True  # else close(), or __del__, flushes into the discarded buffer
            else:
                self._file.close()
        except Exception:  # giving up anyway; the missing manifest keeps it invisible
            pass


class FsspecStorage(Storage):
    """A snapshot directory (a key prefix on object stores) on an fsspec file system."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str, tuning: Tuning | None = None) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.tuning = tuning or split_tuning(None)[0]
        self._multipart = supports_multipart(fs)
        self._profile = profile_of(fs)
        self._ranged = RangedReader(fs, self.tuning) if self._profile is not None and self._profile.remote else None
        if self._ranged is not None:
            self.read_workers = self.tuning.read_workers

    def _abs(self, rel: str) -> str:
        reference = split_reference(rel)
        if reference is not None:  # a key of a sibling snapshot (incremental snapshots read only)
            return f"{self.root.rpartition('/')[0]}/{reference[0]}/{reference[1]}"
        return f"{self.root}/{rel}" if rel else self.root

    def _is_object_store(self) -> bool:
        """Keys rather than directories (the store's profile says): nothing to create, and there ``makedirs``
        would create a missing bucket, hiding a mistyped name. Every other file system gets a file's parent
        directories created when opening the file fails for want of them (SFTP, HDFS, ``LocalFileSystem``)."""
        return self._profile is not None and self._profile.object_store

    def _with_parent(self, path: str, create: Callable[[], T]) -> T:
        """``create()``; where it fails for a missing parent directory, make the directories and retry."""
        try:
            return create()
        except FileNotFoundError:
            if self._is_object_store():
                raise
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        return create()

    def open_writer(self, rel: str, size: int | None = None) -> BlobWriter:
        path = self._abs(rel)
        if self._multipart:  # object stores: parts in parallel
            return MultipartWriter(self.fs, path, self.tuning, size)
        return self._with_parent(path, lambda: _FsspecBlobWriter(self.fs, path))

    def put_atomic(self, rel: str, data: bytes) -> None:
        # One PUT on object stores: the object appears whole or not at all. Elsewhere a file is
        # visible, empty, as soon as it is created: write it beside, then rename it into place.
        path = self._abs(rel)
        if self._is_object_store():
            self._with_parent(path, lambda: self.fs.pipe_file(path, data))
        else:
            temporary = f"{rel}.tmp-{uuid.uuid4().hex[:12]}"
            self._with_parent(self._abs(temporary), lambda: self.fs.pipe_file(self._abs(temporary), data))
            try:
                self.fs.mv(self._abs(temporary), path)
            except BaseException:
                self.remove(temporary)
                raise
        self.fs.invalidate_cache(path)

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self._abs(rel))

    def read_into(self, rel: str, offset: int, out: memoryview) -> None:
        self.read_vectored(rel, offset, [out])

    def read_vectored(self, rel: str, offset: int, views: Sequence[memoryview]) -> None:
        with naming_missing_base(self.url, rel):
            if self._ranged is not None:  # ranged requests in parallel, into the views
                self._ranged.read(self._abs(rel), offset, views)
            else:
                read_range(self.fs, self._abs(rel), offset, [byte_view(v) for v in views])

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self._abs(rel))

    def is_file(self, rel: str) -> bool:
        # An object store's key does not stand in the way of keys under it: no requests to ask (a take's first).
        return not self._is_object_store() and self.fs.isfile(self._abs(rel))

    def size(self, rel: str) -> int:
        with naming_missing_base(self.url, rel):
            return self.fs.size(self._abs(rel))

    def remove(self, rel: str) -> None:
        try:
            remove_file(self.fs, self._abs(rel))
        except FileNotFoundError:
            pass


def remove_file(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Remove the file at ``path``: ``fs.rm_file``, else ``fs.rm`` where the file system has no ``rm_file`` of its
    own (adlfs before 2026.2 has none, and fsspec's raises NotImplementedError)."""
    try:
        fs.rm_file(path)
    except NotImplementedError:
        fs.rm(path)


def url_to_fs(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec file system of ``url`` and the path there, as every part of ppe-snapshot opens it: the knobs of
    ``storage/tuning.py`` taken out of ``storage_options``, the options of the URL's store profile added (S3's
    retry policy and connection pool), so every user of one URL shares fsspec's cached file system instance,
    and the profile's set-up of the opened file system done (Azure's retry policy).

    A URL whose file system is not installed raises an ``ImportError`` naming the extra that installs it.
    """
    url = str(url)
    tuning, options = split_tuning(storage_options, url)
    profile = profile_of_url(url)
    if profile is not None and profile.options is not None:
        options = profile.options(url, options, tuning)
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as e:
        if profile is None or profile.extra is None:
            raise
        scheme = url.split("://", 1)[0]
        raise ImportError(f"{url}: {scheme}:// needs {profile.package}, which is not installed: "
                          f"pip install 'ppe-snapshot[{profile.extra}]'") from e
    if profile is not None and profile.opened is not None:
        profile.opened(fs)
    return fs, path


def open_url(url: str, mode: str, storage_options: dict[str, Any] | None = None) -> Any:
    """The file at ``url`` opened in ``mode`` (a file object of the URL's file system, see :func:`url_to_fs`)."""
    fs, path = url_to_fs(url, storage_options)
    return fs.open(path, mode)


def fsspec_storage(url: str, storage_options: dict[str, Any] | None) -> FsspecStorage:
    """The snapshot directory at ``url`` (see :func:`url_to_fs`)."""
    tuning = split_tuning(storage_options, url)[0]
    fs, root = url_to_fs(url, storage_options)
    check_part_size(fs, tuning.part_size)
    return FsspecStorage(fs, root, url, tuning)
