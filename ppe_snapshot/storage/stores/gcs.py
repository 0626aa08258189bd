"""Google Cloud Storage (gcsfs, ``gs://`` / ``gcs://``): its upload in parts composed into one object, its
ranged reads streamed into place, 64 readers by default.

Ranged reads: gcsfs answers a ranged read (``cat_file``) with one bytes object of the whole range, which the
reader then copies into place: every byte is copied twice and a reader holds its whole piece meanwhile. Here the
response body is copied into the views as it arrives, through gcsfs's own session, authorization headers and URL,
under gcsfs's own retry policy (``gcsfs.retry.retry_request``: at most 6 attempts, on HTTP 408 / 429 / 500-504 and
connection errors, a body that breaks off included; 2^(n-1) s plus up to 1 s before retry n). A retried piece
is read again from its start.
"""
from __future__ import annotations

import asyncio
import functools
import io
import logging
import uuid
from typing import Any, Callable

from ppe_snapshot.storage.part_stores import PartStore
from ppe_snapshot.storage.stores import StoreProfile

logger = logging.getLogger(__name__)


def is_gcsfs(fs: Any) -> bool:
    """Whether ``fs`` is gcsfs, with the session and URL this module reads through."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    return bool(protocols & {"gs", "gcs"}) and all(
        callable(getattr(fs, name, None)) for name in ("_set_session", "_get_headers", "url"))


async def stream_range(fs: Any, path: str, start: int, targets: list[memoryview]) -> None:
    """Fill ``targets`` in order from the consecutive bytes of ``path`` at ``start``: FileNotFoundError for a
    missing object, EOFError for one that ends before the range does (neither is retried)."""
    await _retried()(fs, path, start, targets)


@functools.cache
def _retried() -> Callable[..., Any]:
    from gcsfs.retry import retry_request
    return retry_request(_get_into)


async def _get_into(fs: Any, path: str, start: int, targets: list[memoryview]) -> None:
    from gcsfs.retry import validate_response

    wanted = sum(t.nbytes for t in targets)
    await fs._set_session()
    headers = fs._get_headers({"Range": f"bytes={start}-{start + wanted - 1}"})
    timeout = {"timeout": fs.requests_timeout} if hasattr(fs, "requests_timeout") else {}
    async with fs.session.get(fs.url(path), headers=headers, **timeout) as r:
        if r.status >= 400:
            if r.status == 416:  # the range starts past the end of the object
                raise EOFError(f"{path} ends before byte {start}, expected at least {start + wanted}")
            validate_response(r.status, await r.read(), path)
        index, filled, got = 0, 0, 0
        async for chunk in r.content.iter_any():
            data = memoryview(chunk)
            if got + data.nbytes > wanted:  # a server that ignores Range answers with the whole object
                raise OSError(f"{path}: asked for {wanted} bytes at {start}, got more: the store ignored the "
                              "range request")
            got += data.nbytes
            while data.nbytes:
                target = targets[index]
                n = min(data.nbytes, target.nbytes - filled)
                target[filled:filled + n] = data[:n]
                data, filled = data[n:], filled + n
                if filled == target.nbytes:
                    index, filled = index + 1, 0
        if got < wanted:
            raise EOFError(f"{path} ends at byte {start + got}, expected at least {start + wanted}")


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


def _part_store(fs: Any) -> type[PartStore] | None:
    return GcsComposite if callable(getattr(fs, "_merge", None)) else None


def _stream(fs: Any) -> Any:
    return functools.partial(stream_range, fs) if is_gcsfs(fs) else None


PROFILE = StoreProfile("Google Cloud Storage", ("gs", "gcs", "gcsfs"), extra="gcs", package="gcsfs",
                       read_workers=64, part_store=_part_store, stream=_stream)
