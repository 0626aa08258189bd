"""Local-disk storage: plain ``os`` calls, vectored writes and fsync."""
from __future__ import annotations

import os
import shutil
import threading
from typing import Sequence

from ppe_snapshot.storage.base import BlobWriter, Storage

# os.writev takes at most IOV_MAX buffers per call.
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
# One syscall writes at most this much (Linux caps a single write near 2 GiB).
_MAX_WRITE = 1 << 30


def fsync_dir(path: str) -> None:
    """Make a directory entry (a create or rename inside ``path``) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _LocalBlobWriter(BlobWriter):
    def __init__(self, path: str) -> None:
        self._path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._size = 0

    def write(self, buffers: Sequence[memoryview]) -> None:
        pending = [b for b in buffers if b.nbytes]
        while pending:
            batch, total = [], 0
            while pending and len(batch) < _IOV_MAX and total < _MAX_WRITE:
                b = pending[0]
                if total + b.nbytes > _MAX_WRITE:
                    take = _MAX_WRITE - total
                    batch.append(b[:take])
                    pending[0] = b[take:]
                    total += take
                    break
                batch.append(pending.pop(0))
                total += b.nbytes
            written = os.writev(self._fd, batch)
            self._size += written
            if written < total:  # short write: put back what did not go out
                rest = []
                for b in batch:
                    if written >= b.nbytes:
                        written -= b.nbytes
                        continue
                    rest.append(b[written:])
                    written = 0
                pending = rest + pending

    def close(self) -> int:
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1
        return self._size

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class LocalStorage(Storage):
    """A snapshot directory on a local (POSIX) file system."""

    def __init__(self, root: str, url: str | None = None) -> None:
        self.root = os.path.abspath(root)
        self.url = url if url is not None else root
        self._made_dirs: set[str] = set()
        self._readers: dict[str, int] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"root": self.root, "url": self.url}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["root"], state["url"])

    def _abs(self, rel: str) -> str:
        return os.path.join(self.root, *rel.split("/")) if rel else self.root

    def _ensure_parent(self, path: str) -> None:
        parent = os.path.dirname(path)
        if parent in self._made_dirs:
            return
        created = not os.path.isdir(parent)
        os.makedirs(parent, exist_ok=True)
        if created:  # make the new directory entries durable too
            d = parent
            while d != self.root and d.startswith(self.root):
                fsync_dir(os.path.dirname(d))
                d = os.path.dirname(d)
            fsync_dir(parent)
        self._made_dirs.add(parent)

    def open_writer(self, rel: str) -> BlobWriter:
        path = self._abs(rel)
        self._ensure_parent(path)
        return _LocalBlobWriter(path)

    def put_atomic(self, rel: str, data: bytes) -> None:
        path = self._abs(rel)
        self._ensure_parent(path)
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path))

    def read_bytes(self, rel: str) -> bytes:
        with open(self._abs(rel), "rb") as f:
            return f.read()

    def _reader_fd(self, rel: str) -> int:
        with self._lock:
            fd = self._readers.get(rel)
            if fd is None:
                fd = os.open(self._abs(rel), os.O_RDONLY)
                self._readers[rel] = fd
            return fd

    def read_into(self, rel: str, offset: int, out: memoryview) -> None:
        fd = self._reader_fd(rel)
        done = 0
        while done < out.nbytes:
            n = os.preadv(fd, [out[done:done + _MAX_WRITE]], offset + done)
            if n == 0:
                raise EOFError(f"{self._abs(rel)} ends at byte {offset + done}, "
                               f"expected at least {offset + out.nbytes}")
            done += n

    def exists(self, rel: str) -> bool:
        return os.path.exists(self._abs(rel))

    def size(self, rel: str) -> int:
        return os.path.getsize(self._abs(rel))

    def list(self, rel: str = "") -> list[str]:
        base = self._abs(rel)
        found = []
        for dirpath, _, files in os.walk(base):
            for name in files:
                found.append(os.path.relpath(os.path.join(dirpath, name), self.root).replace(os.sep, "/"))
        return sorted(found)

    def remove(self, rel: str) -> None:
        try:
            os.remove(self._abs(rel))
        except FileNotFoundError:
            pass

    def remove_all(self) -> None:
        self.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def close(self) -> None:
        with self._lock:
            for fd in self._readers.values():
                os.close(fd)
            self._readers.clear()

    def drop_cache(self, rel: str) -> None:
        """Ask the kernel to drop the cached pages of a file (benchmarks use this)."""
        fd = os.open(self._abs(rel), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
