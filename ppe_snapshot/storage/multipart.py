"""A data file as an S3 multipart upload with several parts in flight (s3fs and S3-compatible stores).

s3fs's own file object uploads each part inside ``write()``, one at a time, on one connection. This writer
cuts the stream into parts of ``Tuning.part_size`` and sends up to ``Tuning.upload_concurrency`` of them at
once on s3fs's event loop, while the caller goes on (hashing, staging, copying the next part):

``write()`` copies the bytes into the part being filled before it returns (the caller may reuse its memory
at once); a part takes one of ``upload_concurrency`` slots when it begins to fill and gives it back once sent,
so a writer holds at most ``upload_concurrency x part_size`` bytes of parts. A part is an ``io.BytesIO``:
aiohttp sends it in 64 KiB pieces under the socket's back-pressure, where a ``bytes`` or ``bytearray`` body
would be copied whole once more on its way out (measured: twice the memory).

Every request goes through ``S3FileSystem._call_s3``, so each part is retried on its own by the store's retry
policy (``storage/fsspec.py``'s ``S3_RETRIES``) and s3fs's. Any failure, or ``abort()``, cancels the parts in
flight and aborts the upload: neither an object nor an open multipart upload is left. A file smaller than one
part is one PUT at ``close()``.
"""
from __future__ import annotations

import asyncio
import io
import threading
from typing import Any, Sequence

import fsspec.asyn

from ppe_snapshot.storage.base import BlobWriter, check_stored_size
from ppe_snapshot.storage.tuning import Tuning

#: S3's limits: every part but the last at least 5 MiB, at most 10,000 parts.
MIN_PART = 5 << 20
MAX_PARTS = 10_000


def supports_multipart(fs: Any) -> bool:
    """Whether ``fs`` speaks S3's multipart protocol through s3fs (``_call_s3`` on an event loop)."""
    return callable(getattr(fs, "_call_s3", None)) and callable(getattr(fs, "split_path", None))


def check_part_size(part_size: int) -> None:
    if part_size < MIN_PART:
        raise ValueError(f"ppe_part_size {part_size} is below S3's minimum part size of {MIN_PART} bytes (5 MiB); "
                         "give at least 5 MiB")


def part_size_for(tuning: Tuning, size: int | None) -> int:
    """``tuning.part_size``; for a file of known ``size``: smaller (down to 5 MiB) where that gives every
    connection a part, larger where the file would need more than 10,000 parts."""
    if not size:
        return tuning.part_size
    part = max(MIN_PART, min(tuning.part_size, -(-size // tuning.upload_concurrency)))
    return max(part, -(-size // MAX_PARTS))


def byte_view(view: memoryview) -> memoryview:
    """``view`` as a flat view of unsigned bytes."""
    view = memoryview(view)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class MultipartWriter(BlobWriter):
    """Writes one object at ``path`` on an s3fs file system (see the module docstring)."""

    def __init__(self, fs: Any, path: str, tuning: Tuning, size: int | None = None) -> None:
        check_part_size(tuning.part_size)
        self._fs, self._path = fs, path
        self._bucket, self._key, _ = fs.split_path(path)
        self._part_size = part_size_for(tuning, size)
        self._slots = threading.Semaphore(tuning.upload_concurrency)  # parts in flight
        self._lock = threading.Lock()
        self._part: io.BytesIO | None = None  # the part being filled
        self._fill = 0
        self._size = 0  # bytes accepted so far
        self._upload_id: str | None = None
        self._next_part = 1
        self._parts: list[dict[str, Any]] = []
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
            if self._upload_id is None:  # smaller than one part: one PUT
                body = self._take_part() if self._part is not None else b""
                self._sync(self._fs._call_s3, "put_object", Bucket=self._bucket, Key=self._key, Body=body)
            else:
                if self._fill:
                    self._submit(self._take_part())
                with self._done_parts:
                    self._done_parts.wait_for(lambda: self._pending == 0)
                self._check()
                parts = sorted(self._parts, key=lambda p: p["PartNumber"])
                self._sync(self._fs._call_s3, "complete_multipart_upload", Bucket=self._bucket, Key=self._key,
                           UploadId=self._upload_id, MultipartUpload={"Parts": parts})
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
            self._sync(self._cancel_and_abort)
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
                self._part = io.BytesIO()
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
        if self._upload_id is None:
            self._upload_id = self._sync(self._fs._call_s3, "create_multipart_upload", Bucket=self._bucket,
                                         Key=self._key)["UploadId"]
        number = self._next_part
        if number > MAX_PARTS:
            raise OSError(f"{self._path}: more than {MAX_PARTS} parts of {self._part_size} bytes; give a larger "
                          "ppe_part_size in storage_options")
        self._next_part += 1
        with self._lock:
            self._pending += 1
            future = asyncio.run_coroutine_threadsafe(self._upload_part(number, body), self._fs.loop)
            self._futures.append(future)
        future.add_done_callback(self._part_done)

    async def _upload_part(self, number: int, body: io.BytesIO) -> dict[str, Any]:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            out = await self._fs._call_s3("upload_part", Bucket=self._bucket, Key=self._key, PartNumber=number,
                                          UploadId=self._upload_id, Body=body)
        finally:
            self._tasks.discard(task)
        part = {"PartNumber": number, "ETag": out["ETag"]}
        if "ChecksumSHA256" in out:  # the bucket asked for SHA-256 checksums: the completion must list them
            part["ChecksumSHA256"] = out["ChecksumSHA256"]
        return part

    def _part_done(self, future: Any) -> None:
        with self._done_parts:
            if not future.cancelled():
                if future.exception() is not None:
                    self._error = self._error or future.exception()
                else:
                    self._parts.append(future.result())
            self._pending -= 1
            self._done_parts.notify_all()
        self._slots.release()

    async def _cancel_and_abort(self) -> None:
        """On the event loop: stop every part (those not started and those being sent), then abort the upload."""
        with self._lock:
            futures = list(self._futures)
        for future in futures:
            future.cancel()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._upload_id is not None:
            await self._fs._call_s3("abort_multipart_upload", Bucket=self._bucket, Key=self._key,
                                    UploadId=self._upload_id)
