"""Local-disk storage: O_DIRECT (or buffered) writes, fsync, atomic renames."""
from __future__ import annotations

import errno
import mmap
import os
import queue
import stat
import threading
from typing import Callable, Sequence

import numpy as np

from ppe_snapshot.errors import CorruptSnapshotError
from ppe_snapshot.settings import SETTINGS
from ppe_snapshot.storage.base import (
    AfterRead, BlobWriter, Storage, is_readable_name, naming_missing_base, split_reference,
)
from ppe_snapshot.storage.local_reads import read_addresses, read_views

# One syscall writes at most this much (Linux caps a single write near 2 GiB).
_MAX_WRITE = 1 << 30
# O_DIRECT needs buffers, lengths and offsets aligned to the logical block size; a page covers all disks.
_BLOCK = 4096
# Copies at least this large go through numpy, which releases the GIL.
_GIL_FREE_COPY = 64 << 10
# put_atomic writes files at least this large like data files (O_DIRECT where the file system has it): the index
# file of 10^5 tensors (6.5 MB) took 21 ms through the page cache and its fsync, 8 ms so (measured here).
_DIRECT_PUT_BYTES = 1 << 20


def fsync_dir(path: str) -> None:
    """Make a directory entry (a create or rename inside ``path``) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def address(view: memoryview) -> int:
    """The memory address of a buffer's first byte."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if view.nbytes else 0


class _BufferedBlobWriter(BlobWriter):
    """Plain writes through the page cache, fsync at close (file systems without O_DIRECT)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._size = 0

    def write(self, buffers: Sequence[memoryview]) -> None:
        for view in buffers:
            _pwrite_all(self._fd, view, self._size)
            self._size += view.nbytes

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


class _DirectBlobWriter(BlobWriter):
    """O_DIRECT writes: the data goes from user memory to the disk, not through the page cache.

    Page-aligned runs of the input are written as they are (the staged file image of an async take). Everything
    else is copied into one of two page-aligned bounce buffers, written by a helper thread while the caller fills
    the other. The tail is padded to a block and the file truncated back to its size before the fsync.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._size = 0  # bytes accepted so far = the file offset of the next byte
        # Size and number of the bounce buffers, and threads writing them out: see ppe_snapshot.settings.
        self._bounce_bytes = SETTINGS.bounce_buffer_bytes
        self._free: queue.Queue[mmap.mmap] = queue.Queue()
        for _ in range(SETTINGS.bounce_buffers):
            self._free.put(mmap.mmap(-1, self._bounce_bytes))
        self._full: queue.Queue[tuple[mmap.mmap, int, int] | None] = queue.Queue()
        self._current: mmap.mmap | None = None
        self._fill = 0  # bytes in the current bounce buffer
        self._error: BaseException | None = None
        self._threads = [threading.Thread(target=self._drain, name="ppe-snapshot-direct-io", daemon=True)
                         for _ in range(SETTINGS.drain_threads)]
        for thread in self._threads:
            thread.start()

    def _drain(self) -> None:
        while (item := self._full.get()) is not None:
            buf, length, offset = item
            try:
                if self._error is None:
                    _pwrite_all(self._fd, memoryview(buf)[:length], offset)
            except BaseException as e:  # raised in the caller by _check()
                self._error = e
            self._free.put(buf)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _flush_bounce(self, pad: bool = False) -> None:
        if self._current is None or not self._fill:
            return
        length = self._fill
        if pad:
            length = (self._fill + _BLOCK - 1) // _BLOCK * _BLOCK
            self._current[self._fill:length] = bytes(length - self._fill)
        self._full.put((self._current, length, self._size - self._fill))
        self._current, self._fill = None, 0

    def write(self, buffers: Sequence[memoryview]) -> None:
        self._check()
        for view in buffers:
            while view.nbytes:
                if not self._fill and self._size % _BLOCK == 0 and address(view) % _BLOCK == 0:
                    direct = view.nbytes // _BLOCK * _BLOCK
                    if direct:
                        _pwrite_all(self._fd, view[:direct], self._size)
                        self._size += direct
                        view = view[direct:]
                        continue
                if self._current is None:
                    self._current = self._free.get()
                    self._check()
                take = min(self._bounce_bytes - self._fill, view.nbytes)
                _copy(self._current, self._fill, view[:take])
                self._fill += take
                self._size += take
                view = view[take:]
                if self._fill == self._bounce_bytes:
                    self._flush_bounce()

    def _stop(self) -> None:
        for thread in self._threads:
            if thread.is_alive():
                self._full.put(None)
        for thread in self._threads:
            thread.join()

    def close(self) -> int:
        try:
            self._flush_bounce(pad=True)
            self._stop()
            self._check()
            os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
        finally:
            self.abort()
        return self._size

    def abort(self) -> None:
        self._stop()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _copy(dest: mmap.mmap, offset: int, view: memoryview) -> None:
    """Copy ``view`` into ``dest`` at ``offset``; large copies release the GIL (numpy), so the
    thread writing the other bounce buffer out keeps the disk busy meanwhile."""
    if view.nbytes < _GIL_FREE_COPY:
        dest[offset:offset + view.nbytes] = view
    else:
        np.copyto(np.frombuffer(dest, dtype=np.uint8, count=view.nbytes, offset=offset),
                  np.frombuffer(view, dtype=np.uint8))


def _remove_quietly(path: str, remove: Callable[[str], None] = os.unlink, quiet: type[OSError] = OSError) -> None:
    try:
        remove(path)
    except quiet:
        pass


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:done + _MAX_WRITE], offset + done)


def open_blob_writer(path: str, size: int | None = None) -> BlobWriter:
    """An O_DIRECT writer where the file system supports it, else a buffered one.

    With ``size``, the file's space is reserved first: O_DIRECT writes get no delayed allocation, so ranks writing
    side by side would otherwise get their files' extents interleaved on disk (measured here: 16-17 extents per
    128 MiB file), and reading a file back would seek. A file already there is cut to ``size``, not emptied.
    """
    flags = os.O_WRONLY | os.O_CREAT  # not O_TRUNC: a file there (a local tier's spare) keeps its tmpfs pages
    fd = -1
    if SETTINGS.direct_io and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: this file system refuses O_DIRECT
                raise
    direct = fd >= 0
    fd = fd if direct else os.open(path, flags, 0o644)
    if os.fstat(fd).st_size > (size or 0):  # the pages below ``size`` are written over
        os.ftruncate(fd, size or 0)
    if size:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:  # only an optimization, but no space is worth saying at once
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                os.close(fd)
                raise
    return _DirectBlobWriter(fd) if direct else _BufferedBlobWriter(fd)


class LocalStorage(Storage):
    """A snapshot directory on a local (POSIX) file system."""

    small_reads_cheap = True

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
        reference = split_reference(rel)
        if reference is not None:  # a file of a sibling snapshot (incremental snapshots read only)
            return os.path.join(os.path.dirname(self.root), reference[0], *reference[1].split("/"))
        return os.path.join(self.root, *rel.split("/")) if rel else self.root

    def _ensure_parent(self, path: str) -> None:
        parent = os.path.dirname(path)
        if parent in self._made_dirs:
            return
        existing = parent
        while not os.path.isdir(existing):
            existing = os.path.dirname(existing)
        os.makedirs(parent, exist_ok=True)
        d = parent
        while d != existing:  # make the new directory entries durable too, the root's own included
            fsync_dir(os.path.dirname(d))
            d = os.path.dirname(d)
        self._made_dirs.add(parent)

    def open_writer(self, rel: str, size: int | None = None) -> BlobWriter:
        path = self._abs(rel)
        self._ensure_parent(path)
        writer = open_blob_writer(path, size)
        fsync_dir(os.path.dirname(path))  # the new file's directory entry; close() makes its data durable
        return writer

    def put_atomic(self, rel: str, data: bytes) -> None:
        path = self._abs(rel)
        self._ensure_parent(path)
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            if len(data) >= _DIRECT_PUT_BYTES:
                writer = open_blob_writer(tmp, len(data))
                try:
                    writer.write([memoryview(data)])
                    writer.close()
                except BaseException:
                    writer.abort()
                    raise
            else:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    _pwrite_all(fd, memoryview(data), 0)
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except BaseException:
            _remove_quietly(tmp)
            raise
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path))

    def read_bytes(self, rel: str) -> bytes:
        """A whole small file of the snapshot (the manifest, index files, parts), read like a data file: a
        regular file whose real place is inside the snapshot directory."""
        with os.fdopen(self._open_contained(rel, self._abs(rel)), "rb") as f:
            return f.read()

    def _open_regular(self, rel: str, path: str) -> int:
        """Open a file to read, refusing anything but a regular file (a FIFO would block the open, a
        directory fail the reads)."""
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CorruptSnapshotError(f"{self.url}: refusing to read {rel!r}: it is not a regular file")
        return fd

    def _data_path(self, rel: str) -> str:
        """The absolute path of a data file to read; refuses a name that would leave the snapshot."""
        if not is_readable_name(rel):
            raise CorruptSnapshotError(f"{self.url}: refusing to read {rel!r}: a data file name must be a "
                                       "normalised relative path inside the snapshot, or ../<snapshot>/<path> "
                                       "in a snapshot beside it")
        return self._abs(rel)

    def _check_resolved(self, rel: str, real: str) -> None:
        """Refuse a file that resolves (through a symbolic link, of the file or of a directory on the
        way) to a place outside the snapshot directory; for a reference, outside the sibling snapshot it names,
        or a sibling that itself resolves outside the run directory."""
        reference = split_reference(rel)
        if reference is None:
            root = os.path.realpath(self.root)
        else:
            run_dir = os.path.realpath(os.path.dirname(self.root))
            root = os.path.realpath(os.path.join(os.path.dirname(self.root), reference[0]))
            if os.path.commonpath([run_dir, root]) != run_dir:
                raise CorruptSnapshotError(f"{self.url}: refusing to read {rel!r}: snapshot {reference[0]!r} "
                                           f"resolves to {root}, outside the run directory (a symbolic link?)")
        if os.path.commonpath([root, real]) != root:
            raise CorruptSnapshotError(f"{self.url}: refusing to read {rel!r}: it resolves to {real}, outside the "
                                       "snapshot directory (a symbolic link?)")

    def _open_data(self, rel: str) -> int:
        with naming_missing_base(self.url, rel):
            return self._open_contained(rel, self._data_path(rel))

    def _open_contained(self, rel: str, path: str) -> int:
        """Open a regular file to read, refusing one whose real place is outside the snapshot directory."""
        fd = self._open_regular(rel, path)
        try:
            try:  # where the open file really is, immune to a link swapped after the open
                real = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                real = os.path.realpath(path)
            self._check_resolved(rel, real)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _reader_fd(self, rel: str) -> int:
        with self._lock:
            fd = self._readers.get(rel)
            if fd is None:
                fd = self._readers[rel] = self._open_data(rel)
            return fd

    def read_into(self, rel: str, offset: int, out: memoryview) -> None:
        self.read_vectored(rel, offset, [out])

    def read_vectored(self, rel: str, offset: int, views: Sequence[memoryview]) -> None:
        read_views(self._reader_fd(rel), offset, views, lambda: self._abs(rel))  # (the path only for an error)

    def read_scattered(self, rel: str, offset: int, iov: np.ndarray) -> None:
        if not read_addresses(self._reader_fd(rel), offset, iov, lambda: self._abs(rel)):
            super().read_scattered(rel, offset, iov)

    def read_scattered_then(self, rel: str, offset: int, iov: np.ndarray, then: AfterRead) -> None:
        if not read_addresses(self._reader_fd(rel), offset, iov, lambda: self._abs(rel), then):
            super().read_scattered_then(rel, offset, iov, then)

    def exists(self, rel: str) -> bool:
        return os.path.exists(self._abs(rel))

    def is_file(self, rel: str) -> bool:
        return os.path.isfile(self._abs(rel))

    def size(self, rel: str) -> int:
        path = self._data_path(rel)
        self._check_resolved(rel, os.path.realpath(path))
        with naming_missing_base(self.url, rel):
            return os.path.getsize(path)

    def remove(self, rel: str) -> None:
        _remove_quietly(self._abs(rel), os.remove, FileNotFoundError)

    def remove_empty_dir(self, rel: str) -> None:
        _remove_quietly(self._abs(rel), os.rmdir)  # not empty (another rank's or take's files), or not there

    def close(self) -> None:
        with self._lock:
            for fd in self._readers.values():
                os.close(fd)
            self._readers.clear()

