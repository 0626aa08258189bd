"""Ranged reads from Google Cloud Storage streamed into their destination views.

gcsfs answers a ranged read (``cat_file``) with one bytes object of the whole range, which the reader then
copies into place: every byte is copied twice and a reader holds its whole piece meanwhile. Here the response
body is copied into the views as it arrives, through gcsfs's own session, authorization headers and URL, under
gcsfs's own retry policy (``gcsfs.retry.retry_request``: at most 6 attempts, on HTTP 408 / 429 / 500-504 and
connection errors, a body that breaks off included; 2^(n-1) s plus up to 1 s before retry n). A retried piece
is read again from its start.
"""
from __future__ import annotations

import functools
from typing import Any, Callable


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
