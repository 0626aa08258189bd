"""S3 (s3fs, ``s3://`` / ``s3a://``): its retry policy and connection pool, its multipart upload, its ranged reads
streamed into place."""
from __future__ import annotations

import asyncio
import io
import os
from functools import partial
from typing import Any, Awaitable, Callable

from ppe_snapshot.storage.part_stores import PartStore
from ppe_snapshot.storage.ranged import STREAM_ATTEMPTS, short_read
from ppe_snapshot.storage.stores import StoreProfile
from ppe_snapshot.storage.tuning import Tuning

#: The retry policy of every S3 request (data PUTs, each multipart part, the manifest PUT, reads), as botocore's
#: ``retries`` config: up to 5 attempts per request, retrying throttling, timeouts, connection errors and HTTP
#: 500 / 502 / 503 / 504, waiting a random 0..2**n s (at most 20 s) before retry n. A request that keeps
#: failing thus gives up after 5 attempts and at most 1 + 2 + 4 + 8 = 15 s of waiting (plus the requests' own
#: timeouts). Override it with ``storage_options={"config_kwargs": {"retries": {...}}}`` (botocore's keys:
#: ``mode``, ``total_max_attempts`` / ``max_attempts``), or with botocore's ``AWS_RETRY_MODE`` /
#: ``AWS_MAX_ATTEMPTS`` environment variables, which this default then leaves alone.
S3_RETRIES: dict[str, Any] = {"mode": "standard", "total_max_attempts": 5}


def options(url: str, storage_options: dict[str, Any], tuning: Tuning) -> dict[str, Any]:
    """``storage_options`` with :data:`S3_RETRIES` unless the caller chose a policy, and a connection pool as
    large as the parts and reads in flight (botocore keeps 10 by default) unless the caller chose
    ``config_kwargs["max_pool_connections"]``."""
    return _with_connections(_with_retry_policy(storage_options), tuning)


def _with_retry_policy(storage_options: dict[str, Any]) -> dict[str, Any]:
    options = dict(storage_options)
    if "AWS_RETRY_MODE" in os.environ or "AWS_MAX_ATTEMPTS" in os.environ:
        return options
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", dict(S3_RETRIES))
    options["config_kwargs"] = config
    return options


def _with_connections(options: dict[str, Any], tuning: Tuning) -> dict[str, Any]:
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("max_pool_connections", tuning.connections)
    return {**options, "config_kwargs": config}


class S3Parts(PartStore):
    """S3's multipart upload through s3fs (``_call_s3``: retried by botocore's policy)."""

    name = "S3"
    min_part = 5 << 20

    def __init__(self, fs: Any, path: str) -> None:
        super().__init__(fs, path)
        self._bucket, self._key, _ = fs.split_path(path)
        self._upload_id: str | None = None

    async def begin(self) -> None:
        reply = await self.fs._call_s3("create_multipart_upload", Bucket=self._bucket, Key=self._key)
        self._upload_id = reply["UploadId"]

    async def put_part(self, number: int, body: io.BytesIO) -> Any:
        out = await self.fs._call_s3("upload_part", Bucket=self._bucket, Key=self._key, PartNumber=number,
                                     UploadId=self._upload_id, Body=body)
        part = {"PartNumber": number, "ETag": out["ETag"]}
        if "ChecksumSHA256" in out:  # the bucket asked for SHA-256 checksums: the completion must list them
            part["ChecksumSHA256"] = out["ChecksumSHA256"]
        return part

    async def complete(self, parts: list[Any]) -> None:
        await self.fs._call_s3("complete_multipart_upload", Bucket=self._bucket, Key=self._key,
                               UploadId=self._upload_id, MultipartUpload={"Parts": parts})

    async def discard(self) -> None:
        if self._upload_id is not None:
            await self.fs._call_s3("abort_multipart_upload", Bucket=self._bucket, Key=self._key,
                                   UploadId=self._upload_id)

    async def put_whole(self, data: bytes) -> None:
        await self.fs._call_s3("put_object", Bucket=self._bucket, Key=self._key, Body=data)


def _readinto_of(body: Any) -> Callable[[memoryview], Awaitable[int]]:
    """How to read what the response ``body`` has next into a view (at most its size; the bytes read): its
    ``readinto``, or, in aiobotocore before 2.23, which has none, a ``read`` copied into place."""
    readinto = getattr(body, "readinto", None)
    if readinto is not None:
        return readinto

    async def read_copied(target: memoryview) -> int:
        chunk = await body.read(target.nbytes)
        target[:len(chunk)] = chunk
        return len(chunk)
    return read_copied


def _part_store(fs: Any) -> type[PartStore] | None:
    return S3Parts if callable(getattr(fs, "_call_s3", None)) and callable(getattr(fs, "split_path", None)) else None


def _stream(fs: Any) -> Any:
    return partial(stream_into, fs) if _part_store(fs) is S3Parts else None


async def stream_into(fs: Any, path: str, start: int, targets: list[memoryview]) -> None:
    """Fill ``targets`` from the bytes of ``path`` at ``start``, each response body streamed into place (a body
    that breaks off: the piece is requested again, :data:`STREAM_ATTEMPTS` times in all)."""
    from aiohttp import ClientPayloadError
    from botocore.exceptions import ResponseStreamingError

    bucket, key, version = fs.split_path(path)
    wanted = sum(t.nbytes for t in targets)
    extra = {"VersionId": version} if version else {}
    for attempt in range(STREAM_ATTEMPTS):
        response = await fs._call_s3("get_object", Bucket=bucket, Key=key,
                                            Range=f"bytes={start}-{start + wanted - 1}", **extra)
        body, got = response["Body"], 0
        readinto = _readinto_of(body)
        try:
            for target in targets:
                filled = 0
                while filled < target.nbytes:
                    n = await readinto(target[filled:])
                    if not n:
                        raise short_read(path, start, got, wanted)
                    filled += n
                    got += n
            return
        except (ResponseStreamingError, ClientPayloadError, ConnectionError, asyncio.TimeoutError):
            if attempt + 1 == STREAM_ATTEMPTS:
                raise
        finally:
            body.close()


PROFILE = StoreProfile("S3", ("s3", "s3a"), extra="s3", package="s3fs", options=options, part_store=_part_store,
                       stream=_stream)
