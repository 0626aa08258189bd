"""A snapshot's files held in one buffer in this process's memory, read as a storage (read-only).

The local tier receives a partner's copy of a part into memory and restores from it, without writing it to a file
and reading it back first (:mod:`ppe_snapshot.local_tier.transfer`).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ppe_snapshot.storage.base import BlobWriter, Storage

#: Copies at least this large go through numpy, which releases the GIL (the read pool's other thread goes on).
_GIL_FREE_COPY = 64 << 10


class MemoryFiles(Storage):
    """Files laid one after another in ``buffer``: ``files`` lists each one's name (relative) and size, in order.
    Reads copy out of the buffer; every write raises ``PermissionError``."""

    small_reads_cheap = True

    def __init__(self, url: str, buffer: memoryview, files: Sequence[tuple[str, int]]) -> None:
        self.url, self.buffer = url, buffer.cast("B")
        self.files: dict[str, tuple[int, int]] = {}
        at = 0
        for name, size in files:
            self.files[name] = (at, size)
            at += size
        if at > self.buffer.nbytes:
            raise ValueError(f"MemoryFiles: the files hold {at} bytes, the buffer {self.buffer.nbytes}")

    def view(self, rel: str) -> memoryview:
        """The bytes of file ``rel``; ``FileNotFoundError`` when there is none."""
        if rel not in self.files:
            raise FileNotFoundError(f"{self.url}/{rel}")
        at, size = self.files[rel]
        return self.buffer[at:at + size]

    def read_bytes(self, rel: str) -> bytes:
        return bytes(self.view(rel))

    def read_into(self, rel: str, offset: int, out: memoryview) -> None:
        data = self.view(rel)
        if offset + out.nbytes > data.nbytes:
            raise EOFError(f"{self.url}/{rel} holds {data.nbytes} bytes, expected at least {offset + out.nbytes}")
        if out.nbytes < _GIL_FREE_COPY:
            out[:] = data[offset:offset + out.nbytes]
        else:
            np.copyto(np.frombuffer(out, dtype=np.uint8), np.frombuffer(data[offset:offset + out.nbytes], np.uint8))

    def read_vectored(self, rel: str, offset: int, views: Sequence[memoryview]) -> None:
        for view in views:
            self.read_into(rel, offset, view)
            offset += view.nbytes

    def exists(self, rel: str) -> bool:
        rel = rel.rstrip("/")
        return not rel or rel in self.files or any(name.startswith(f"{rel}/") for name in self.files)

    def is_file(self, rel: str) -> bool:
        return rel in self.files

    def size(self, rel: str) -> int:
        return self.view(rel).nbytes

    def _read_only(self, rel: str) -> PermissionError:
        return PermissionError(f"{self.url}/{rel}: files held in memory are read-only")

    def open_writer(self, rel: str, size: int | None = None) -> BlobWriter:
        raise self._read_only(rel)

    def put_atomic(self, rel: str, data: bytes) -> None:
        raise self._read_only(rel)

    def remove(self, rel: str) -> None:
        raise self._read_only(rel)
