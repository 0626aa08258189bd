"""How each object store takes one object in parts sent in parallel: S3's multipart upload, Azure's staged blocks,
Google Cloud Storage's composition of component objects.

A :class:`PartStore` is the store's side of :class:`~ppe_snapshot.storage.multipart.MultipartWriter`: its
coroutines run on the fsspec file system's event loop, each request retried by the store's client (see
``storage/fsspec.py`` for the policies). Whatever happens, nothing of an upload that did not complete is visible
as an object at its path:

* S3: the object appears at ``CompleteMultipartUpload``; :meth:`discard` aborts the upload (its parts go).
* Azure: the blob appears at ``Put Block List``; staged blocks that were never committed are not listed, and the
  service drops them.
* GCS: each part is a component object beside the target (``<name>.ppe-part-<token>-<n>``), composed into the
  target (32 per request; beyond 32 parts, in rounds whose requests run at once), then deleted; :meth:`discard`
  deletes those already stored.
"""
from __future__ import annotations

import asyncio
import io
import logging
import uuid
from typing import Any, Callable

logger = logging.getLogger(__name__)


class PartStore:
    """One object at ``path`` on ``fs``, uploaded as numbered parts (1, 2, ...) that may be sent in any order."""

    #: What a part is filled into (an ``io.BytesIO``: the client streams it in small pieces under the socket's
    #: back-pressure, where a bytes-like body would be buffered whole by the transport).
    part_type: type[io.BytesIO] = io.BytesIO
    #: The store, as messages name it.
    name = "the store"
    #: The smallest part the store takes (all but the last part).
    min_part = 1
    #: The most parts one object may have.
    max_parts = 10_000

    def __init__(self, fs: Any, path: str) -> None:
        self.fs, self.path = fs, path

    async def begin(self) -> None:
        """Before the first part."""

    async def put_part(self, number: int, body: io.BytesIO) -> Any:
        """Store part ``number``; what :meth:`complete` needs of it."""
        raise NotImplementedError

    async def complete(self, parts: list[Any]) -> None:
        """Make the object of ``parts`` (in part order) appear at the path."""
        raise NotImplementedError

    async def discard(self) -> None:
        """Give up after :meth:`begin`: leave nothing of the upload visible."""

    async def put_whole(self, data: bytes) -> None:
        """A file smaller than one part, in one request."""
        await self.fs._pipe_file(self.path, data)


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


class AzureBlocks(PartStore):
    """An Azure block blob through adlfs's client: blocks staged in parallel, then one block list committed."""

    max_parts = 50_000

    def __init__(self, fs: Any, path: str) -> None:
        super().__init__(fs, path)
        container, blob, _ = fs.split_path(path)
        self._blob = fs.service_client.get_blob_client(container, blob)

    async def put_part(self, number: int, body: io.BytesIO) -> Any:
        block_id = f"ppe-{number:08d}"  # one length for every block (the client sends it base64-encoded)
        await self._blob.stage_block(block_id, body, length=body.getbuffer().nbytes)
        return block_id

    async def complete(self, parts: list[Any]) -> None:
        from azure.storage.blob import BlobBlock

        await self._blob.commit_block_list([BlobBlock(block_id=block_id) for block_id in parts])


class _RewoundPart(io.BytesIO):
    """A part that survives its request: aiohttp closes a file body once sent, and gcsfs sends the same body
    again on a retry (rewinding it first); closing rewinds it instead."""

    def close(self) -> None:
        self.seek(0)


class GcsComposite(PartStore):
    """A Google Cloud Storage object composed of component objects uploaded in parallel through gcsfs."""

    part_type = _RewoundPart
    #: GCS composes at most 32 objects per request.
    FAN_IN = 32

    def __init__(self, fs: Any, path: str) -> None:
        super().__init__(fs, path)
        self._bucket, self._key, _ = fs.split_path(path)
        self._prefix = f"{self._key}.ppe-part-{uuid.uuid4().hex[:12]}-"
        self._stored: set[str] = set()  # component keys that exist, or may (their request was sent)

    async def put_part(self, number: int, body: io.BytesIO) -> Any:
        key = f"{self._prefix}{number:05d}"
        self._stored.add(key)  # before the request: one cancelled after the store took it must still go
        # A media upload of the part as a stream (gcsfs's pipe_file would copy it into a multipart body; a
        # memoryview body is copied into the transport's buffer as far as the socket has not taken it).
        await self.fs._call("POST", f"{self.fs._location}/upload/storage/v1/b/{self._bucket}/o",
                            uploadType="media", name=key, data=body,
                            headers={"Content-Type": "application/octet-stream"}, json_out=True)
        return key

    async def complete(self, parts: list[Any]) -> None:
        round_ = 0
        while len(parts) > self.FAN_IN:  # compose in rounds: groups of 32 into intermediate components, at once
            groups = [parts[i:i + self.FAN_IN] for i in range(0, len(parts), self.FAN_IN)]
            parts = [f"{self._prefix}r{round_}-{index:05d}" for index in range(len(groups))]
            self._stored.update(parts)
            await asyncio.gather(*(self._compose(key, group) for key, group in zip(parts, groups)))
            round_ += 1
        await self._compose(self._key, parts)
        await self._remove_components(logger.warning)

    async def discard(self) -> None:
        await self._remove_components(logger.debug)

    async def _compose(self, key: str, sources: list[str]) -> None:
        await self.fs._merge(f"{self._bucket}/{key}", [f"{self._bucket}/{s}" for s in sources])

    async def _remove_components(self, report: Callable[..., None]) -> None:
        stored, self._stored = sorted(self._stored), set()
        if not stored:
            return
        try:
            await self.fs._rm([f"{self._bucket}/{key}" for key in stored])
        except FileNotFoundError:  # none of them was stored
            pass
        except Exception as e:  # noqa: BLE001 - the object (or its absence) is what counts
            report("could not remove %d upload components of %s: %s", len(stored), self.path, e)


def part_store_type(fs: Any) -> type[PartStore] | None:
    """The :class:`PartStore` of ``fs``'s object store, or None where it has none (local, memory, HTTP, ...)."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if callable(getattr(fs, "_call_s3", None)) and callable(getattr(fs, "split_path", None)):
        return S3Parts
    if protocols & {"az", "abfs", "abfss"} and hasattr(fs, "service_client"):
        return AzureBlocks
    if protocols & {"gs", "gcs"} and callable(getattr(fs, "_merge", None)):
        return GcsComposite
    return None


def is_s3fs(fs: Any) -> bool:
    """Whether ``fs`` is s3fs (its responses can be streamed into place)."""
    return part_store_type(fs) is S3Parts
