"""A data file on an object store uploaded in parts, several in flight (S3's multipart upload, Azure's staged
blocks, GCS's composed objects: the store's side is ``part_stores``).

The stores' own file objects upload each part inside ``write()``, one at a time, on one connection. This writer
cuts the stream into parts of ``Tuning.part_size`` and sends up to ``Tuning.upload_concurrency`` of them at
once on the file system's event loop, while the caller goes on (hashing, staging, copying the next part):

``write()`` copies the bytes into the part being filled before it returns (the caller may reuse its memory
at once); a part takes one of ``upload_concurrency`` slots when it begins to fill and gives it back once sent,
so a writer holds at most ``upload_concurrency x part_size`` bytes of parts. A part is an ``io.BytesIO``:
aiohttp sends it in 64 KiB pieces under the socket's back-pressure, where a ``bytes`` or ``bytearray`` body
would be copied whole once more on its way out (measured: twice the memory).

Every request goes through the store's client, so each part is retried on its own by the store's retry policy
(``storage/fsspec.py``). Any failure, or ``abort()``, cancels the parts in flight and discards the upload:
nothing of it is left visible (see ``part_stores``). A file smaller than one part is one request at ``close()``.
"""
from __future__ import annotations

import asyncio
import io
import threading
from functools import partial
from typing import Any, Sequence

import fsspec.asyn

from ppe_snapshot.storage.base import BlobWriter, check_stored_size
from ppe_snapshot.storage.part_stores import PartStore, part_store_type
from ppe_snapshot.storage.tuning import Tuning

#: No part is made smaller than this to give every connection one (a request costs a round trip).
SMALLEST_PART = 5 << 20


def supports_multipart(fs: Any) -> bool:
    """Whether ``fs`` takes an object in parts sent in parallel (its store's profile has a part store)."""
    return part_store_type(fs) is not None


def check_part_size(fs: Any, part_size: int, store: type[PartStore] | None = None) -> None:
    """A part size the store of ``fs`` (or ``store``, already looked up) takes; ValueError otherwise."""
    store = store or part_store_type(fs)
    if store is not None and part_size < store.min_part:
        raise ValueError(f"ppe_part_size {part_size} is below {store.name}'s minimum part size of {store.min_part} "
                         f"bytes ({store.min_part >> 20} MiB); give at least that")


def part_size_for(tuning: Tuning, size: int | None, store: type[PartStore]) -> int:
    """``tuning.part_size``; for a file of known ``size``: smaller (down to 5 MiB, or the part size asked for
    where that is smaller) where that gives every connection a part, larger where the file would need more parts
    than the store takes."""
    if not size:
        return tuning.part_size
    floor = max(min(SMALLEST_PART, tuning.part_size), store.min_part)
    part = max(floor, min(tuning.part_size, -(-size // tuning.upload_concurrency)))
    return max(part, -(-size // store.max_parts))


def byte_view(view: memoryview) -> memoryview:
    """``view`` as a flat view of unsigned bytes."""
    view = memoryview(view)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class MultipartWriter(BlobWriter):
    """Writes one object at ``path`` in parts sent in parallel (see the module docstring)."""

    def __init__(self, fs: Any, path: str, tuning: Tuning, size: int | None = None) -> None:
        store_type = part_store_type(fs)
        if store_type is None:
            raise ValueError(f"{path}: {type(fs).__name__} has no parallel upload")
        check_part_size(fs, tuning.part_size, store_type)
        self._fs, self._path = fs, path
        self._store = store_type(fs, path)
        self._part_size = part_size_for(tuning, size, store_type)
        self._slots = threading.Semaphore(tuning.upload_concurrency)  # parts in flight
        self._lock = threading.Lock()
        self._part: io.BytesIO | None = None  # the part being filled
        self._fill = 0
        self._size = 0  # bytes accepted so far
        self._begun = False
        self._next_part = 1
        self._parts: dict[int, Any] = {}  # what the store needs of each part sent, by number
        self._done_parts = threading.Condition(self._lock)  # notified as each part ends
        self._pending = 0  # parts submitted and not yet ended
        self._futures: list[Any] = []  # the caller's handles of submitted parts (to cancel those not started)
        self._tasks: set[asyncio.Task] = set()  # parts being sent, on the event loop
        self._error: BaseException | None = None
        self._done = False

    # -- the caller's side
    def write(self, buffers: Sequence[memoryview]) -> None:
        for view in buffers:
            self._copy_in(byte_view(view))

    def close(self) -> int:
        try:
            self._check()
            if not self._begun:  # smaller than one part: one request
                body = self._take_part().getvalue() if self._part is not None else b""
                self._sync(self._store.put_whole, body)
            else:
                if self._fill:
                    self._submit(self._take_part())
                with self._done_parts:
                    self._done_parts.wait_for(lambda: self._pending == 0)
                self._check()
                self._sync(self._store.complete, [self._parts[n] for n in sorted(self._parts)])
            self._done = True
        except BaseException:
            self.abort()
            raise
        return check_stored_size(self._fs, self._path, self._size)

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._sync(self._cancel_and_discard)
        except Exception:  # giving up anyway; without a manifest nothing here is visible as a snapshot
            pass
        self._part = None

    # -- parts
    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _sync(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        return fsspec.asyn.sync(self._fs.loop, function, *args, **kwargs)

    def _copy_in(self, view: memoryview) -> None:
        while view.nbytes:
            if self._part is None:  # a part begins: it holds a slot until it has been sent
                self._slots.acquire()
                if self._error is not None:  # a part failed while this one waited: send no more
                    self._slots.release()
                    raise self._error
                self._part = self._store.part_type()
            take = min(self._part_size - self._fill, view.nbytes)
            self._part.write(view[:take])
            self._fill += take
            self._size += take
            view = view[take:]
            if self._fill == self._part_size:
                self._submit(self._take_part())

    def _take_part(self) -> io.BytesIO:
        part, self._part, self._fill = self._part, None, 0
        assert part is not None
        part.seek(0)
        return part

    def _submit(self, body: io.BytesIO) -> None:
        """Send one part (its slot was taken when it began to fill)."""
        self._check()
        if not self._begun:
            self._sync(self._store.begin)
            self._begun = True
        number = self._next_part
        if number > self._store.max_parts:
            raise OSError(f"{self._path}: more than {self._store.max_parts} parts of {self._part_size} bytes; give "
                          "a larger ppe_part_size in storage_options")
        self._next_part += 1
        with self._lock:
            self._pending += 1
            future = asyncio.run_coroutine_threadsafe(self._upload_part(number, body), self._fs.loop)
            self._futures.append(future)
        future.add_done_callback(partial(self._part_done, number))

    async def _upload_part(self, number: int, body: io.BytesIO) -> Any:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            return await self._store.put_part(number, body)
        finally:
            self._tasks.discard(task)

    def _part_done(self, number: int, future: Any) -> None:
        with self._done_parts:
            if not future.cancelled():
                if future.exception() is not None:
                    self._error = self._error or future.exception()
                else:
                    self._parts[number] = future.result()
            self._pending -= 1
            self._done_parts.notify_all()
        self._slots.release()

    async def _cancel_and_discard(self) -> None:
        """On the event loop: stop every part (those not started and those being sent), then discard the upload."""
        with self._lock:
            futures = list(self._futures)
        for future in futures:
            future.cancel()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._begun:
            await self._store.discard()
