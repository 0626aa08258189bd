"""How an object store takes one object in parts sent in parallel (each store's own way lives in its profile,
``storage/stores/``: S3's multipart upload, Azure's staged blocks, Google Cloud Storage's composition of component
objects).

A :class:`PartStore` is the store's side of :class:`~ppe_snapshot.storage.multipart.MultipartWriter`: its
coroutines run on the fsspec file system's event loop, each request retried by the store's client (see
``storage/stores/`` for the policies). Whatever happens, nothing of an upload that did not complete is visible
as an object at its path:

* S3: the object appears at ``CompleteMultipartUpload``; :meth:`discard` aborts the upload (its parts go).
* Azure: the blob appears at ``Put Block List``; staged blocks that were never committed are not listed, and the
  service drops them.
* GCS: each part is a component object beside the target (``<name>.ppe-part-<token>-<n>``), composed into the
  target (32 per request; beyond 32 parts, in rounds whose requests run at once), then deleted; :meth:`discard`
  deletes those already stored.
"""
from __future__ import annotations

import io
from typing import Any

from ppe_snapshot.storage.stores import profile_of


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


def part_store_type(fs: Any) -> type[PartStore] | None:
    """The :class:`PartStore` of ``fs``'s object store (its profile's, ``storage/stores/``), or None where it has
    none (local, memory, HTTP, ...)."""
    profile = profile_of(fs)
    return profile.part_store(fs) if profile is not None and profile.part_store is not None else None
