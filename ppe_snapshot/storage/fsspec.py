"""Storage on any fsspec file system (``s3://``, ``gs://``, ``memory://``, ...)."""
from __future__ import annotations

from typing import Any, Sequence

import fsspec

from ppe_snapshot.storage.base import BlobWriter, Storage

_DIRECTORY_PROTOCOLS = {"file", "local", "sftp", "ssh", "smb", "hdfs", "arrow_hdfs", "webhdfs"}


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


# Object stores upload in parts; buffering this much per part keeps requests few.
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
        self._fs.invalidate_cache(self._path)
        stored = self._fs.size(self._path)
        if stored != self._size:
            raise OSError(f"{self._path}: stored size {stored} differs from the {self._size} bytes written")
        return self._size

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

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url

    def _abs(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def _make_parent(self, path: str) -> None:
        # Only file systems with real directories need them; on object stores makedirs
        # would create a missing bucket, hiding a mistyped name.
        if set(_protocols(self.fs)) & _DIRECTORY_PROTOCOLS:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)

    def open_writer(self, rel: str, size: int | None = None) -> BlobWriter:
        path = self._abs(rel)
        self._make_parent(path)
        return _FsspecBlobWriter(self.fs, path)

    def put_atomic(self, rel: str, data: bytes) -> None:
        # One PUT on object stores: the object appears whole or not at all.
        path = self._abs(rel)
        self._make_parent(path)
        self.fs.pipe_file(path, data)
        self.fs.invalidate_cache(path)

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self._abs(rel))

    def read_into(self, rel: str, offset: int, out: memoryview) -> None:
        path = self._abs(rel)
        try:
            data = self.fs.cat_file(path, start=offset, end=offset + out.nbytes)
        except FileNotFoundError:
            raise
        except OSError:  # object stores refuse a range that starts past the end of the object
            if offset < self.fs.size(path):
                raise
            data = b""
        if len(data) < out.nbytes:
            raise EOFError(f"{path} ends at byte {offset + len(data)}, expected at least {offset + out.nbytes}")
        out[:] = data

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self._abs(rel))

    def size(self, rel: str) -> int:
        return self.fs.size(self._abs(rel))

    def list(self, rel: str = "") -> list[str]:
        base = self._abs(rel)
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        prefix = self.root.lstrip("/") + "/"
        return sorted(p.lstrip("/")[len(prefix):] for p in found if p.lstrip("/").startswith(prefix))

    def remove(self, rel: str) -> None:
        try:
            self.fs.rm_file(self._abs(rel))
        except FileNotFoundError:
            pass

    def remove_all(self) -> None:
        try:
            self.fs.rm(self.root, recursive=True)
        except FileNotFoundError:
            pass


def fsspec_storage(url: str, storage_options: dict[str, Any] | None) -> FsspecStorage:
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return FsspecStorage(fs, root, url)
