"""Reads from object stores as ranged requests in parallel, straight into the destination memory.

One read (``Storage.read_vectored``: consecutive bytes into a list of views) is cut into pieces of at most
``Tuning.read_part_size`` bytes (fewer bytes, down to 1 MiB, where that gives every reader a piece), fetched at
once on a shared pool of ``Tuning.read_workers`` threads. Where the store's profile can (S3, GCS: ``stores/``) each
response body is streamed into its destination views (no intermediate bytes object of the piece), and a piece
whose body breaks off is requested again; other file systems get ``cat_file`` of each range, copied into place.
"""
from __future__ import annotations

import bisect
from concurrent.futures import Future, wait
from typing import Any, Sequence

import fsspec.asyn

from ppe_snapshot.storage.multipart import byte_view
from ppe_snapshot.storage.pools import shared_pool
from ppe_snapshot.storage.stores import profile_of
from ppe_snapshot.storage.tuning import Tuning

#: Attempts at one piece whose response body breaks off (the request itself is retried by the store's policy).
STREAM_ATTEMPTS = 3

#: Smallest range a read is split into: below it a request's round trip costs more than its transfer.
MIN_RANGE = 1 << 20

def _targets(views: list[memoryview], starts: list[int], start: int, end: int) -> list[memoryview]:
    """The parts of ``views`` (laid end to end; ``starts`` their offsets) that cover bytes ``start..end``."""
    out = []
    index = bisect.bisect_right(starts, start) - 1
    while start < end:
        view, base = views[index], starts[index]
        piece = view[start - base:min(end - base, view.nbytes)]
        out.append(piece)
        start += piece.nbytes
        index += 1
    return out


def short_read(path: str, start: int, got: int, wanted: int) -> EOFError:
    return EOFError(f"{path} ends at byte {start + got}, expected at least {start + wanted}")


def _raise_if_past_the_end(fs: Any, path: str, start: int, wanted: int) -> None:
    """On a failed ranged request: EOFError where the range starts past the end of the object (object stores
    refuse such a range rather than answer it short); otherwise the caller re-raises its error."""
    if start >= fs.size(path):
        raise short_read(path, start, 0, wanted) from None


def read_range(fs: Any, path: str, start: int, targets: Sequence[memoryview]) -> None:
    """Fill ``targets`` in order from the consecutive bytes of ``path`` at ``start``: one ``cat_file`` of the
    range on any fsspec file system. A short object is EOFError."""
    wanted = sum(t.nbytes for t in targets)
    try:
        data = memoryview(fs.cat_file(path, start=start, end=start + wanted))
    except FileNotFoundError:
        raise
    except OSError:
        _raise_if_past_the_end(fs, path, start, wanted)
        raise
    if data.nbytes < wanted:
        raise short_read(path, start, data.nbytes, wanted)
    if data.nbytes > wanted:  # an HTTP server that ignores Range answers with the whole file
        raise OSError(f"{path}: asked for {wanted} bytes at {start}, got {data.nbytes}: the store ignored the "
                      "range request")
    position = 0
    for target in targets:
        target[:] = data[position:position + target.nbytes]
        position += target.nbytes


class RangedReader:
    """Parallel ranged reads of the objects of one fsspec file system (see the module docstring)."""

    def __init__(self, fs: Any, tuning: Tuning) -> None:
        self._fs, self._tuning = fs, tuning
        # responses streamed into place (a coroutine filling one piece), where the store allows it
        profile = profile_of(fs)
        self._stream = profile.stream(fs) if profile is not None and profile.stream is not None else None

    def read(self, path: str, offset: int, views: Sequence[memoryview]) -> None:
        """Fill ``views`` in order from the consecutive bytes of ``path`` at ``offset``."""
        flat = [byte_view(v) for v in views if v.nbytes]
        starts, total = [], 0
        for view in flat:
            starts.append(total)
            total += view.nbytes
        # ranges of at most read_part_size, smaller (down to MIN_RANGE) where that keeps every reader busy
        step = min(self._tuning.read_part_size, max(MIN_RANGE, -(-total // self._tuning.read_workers)))
        pieces = [(offset + s, _targets(flat, starts, s, min(s + step, total))) for s in range(0, total, step)]
        if len(pieces) <= 1:
            for start, targets in pieces:
                self._fetch(path, start, targets)
            return
        pool = shared_pool("ppe-snapshot-ranged-read", self._tuning.read_workers)
        futures: list[Future[None]] = [pool.submit(self._fetch, path, start, targets) for start, targets in pieces]
        wait(futures)  # every piece ends before the caller may reuse the memory, even when one failed
        for future in futures:
            error = future.exception()
            if error is not None:
                raise error

    def _fetch(self, path: str, start: int, targets: list[memoryview]) -> None:
        if self._stream is None:
            read_range(self._fs, path, start, targets)
            return
        try:
            fsspec.asyn.sync(self._fs.loop, self._stream, path, start, targets)
        except (EOFError, FileNotFoundError):
            raise
        except OSError:
            _raise_if_past_the_end(self._fs, path, start, sum(t.nbytes for t in targets))
            raise
