"""A partner's copy of a part, read by the part's rank over the side group at restore, on request: the bytes go
straight into the rank's tensors (no file written first, no buffer of the part's size).

The holder (:func:`serve_copy`, in a thread of its own while its own part is restored) sends a header (the copy's
files and their sizes, the copy's path, which small files follow at once) and the small files' bytes (the
manifest and index files: read before any tensor, they would cost a round trip each), then answers requests until
told that the restore ended. The rank restores from :class:`PeerFiles`, a read-only storage whose every read is
one request: the file, an offset and the sizes of the consecutive ranges wanted; the holder checks that they lie
inside one of the copy's files, answers yes or no, and sends the bytes in messages of at most
:data:`~.transfer.CHUNK` bytes, reading the next while the one before is on the wire. Reads from several threads
are pipelined, answered in the order they were asked. Each chunk is checked against its checksum by the engine as
it is restored, as from a file.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Sequence

import numpy as np
import torch

from ppe_snapshot.engine import new_staging_buffer
from ppe_snapshot.errors import SnapshotAbortedError
from ppe_snapshot.local_tier.transfer import CHUNK, check_header, files_of, receive_doc, send_doc
from ppe_snapshot.storage import BlobWriter, Storage, mapped, open_storage

_YES, _NO = 0, 1

#: Files of at most this many bytes, and at most :data:`INLINE_TOTAL` of them in all, are sent with the header.
INLINE_FILE = 256 << 10
INLINE_TOTAL = 4 << 20


def _pieces(offset: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``(offset, bytes)`` of the messages that carry the consecutive ranges of ``sizes`` from ``offset``: each
    range in pieces of at most ``CHUNK`` bytes (a message never spans two ranges; empty ranges send nothing)."""
    pieces = []
    for size in sizes:
        pieces += [(offset + at, min(CHUNK, size - at)) for at in range(0, size, CHUNK)]
        offset += size
    return pieces


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def _memory_at(address: int, nbytes: int) -> memoryview:
    """The ``nbytes`` of this process's memory at ``address``, as a writable view (its owner keeps them alive)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _joined(views: list[memoryview]) -> list[memoryview]:
    """``views`` with each run of neighbours in memory (one view's end the next one's start) made one view."""
    joined: list[tuple[int, int]] = []  # (address, bytes)
    for view in views:
        if not view.nbytes:
            continue
        at = _address(view)
        if joined and joined[-1][0] + joined[-1][1] == at:
            joined[-1] = (joined[-1][0], joined[-1][1] + view.nbytes)
        else:
            joined.append((at, view.nbytes))
    return [_memory_at(at, n) for at, n in joined]


class PeerFiles(Storage):
    """The files of a part that rank ``holder`` holds a copy of, read on request over ``group`` (see the module's
    docstring); :meth:`end` tells the holder that the restore ended.

    Reads from several threads are pipelined: a read sends its request at once and receives its answer in the
    order the requests went (the holder answers them in that order), so the holder reads the next request's first
    bytes while the last bytes of the one before are on the wire."""

    #: Two read threads: one hashes what arrived while the other's bytes are on the wire.
    read_workers = 2

    def __init__(self, group: Any, holder: int, tag: int, files: list[tuple[str, int]], url: str,
                 inline: dict[str, bytes] | None = None) -> None:
        self.group, self.holder, self.tag, self.url = group, holder, tag, url
        self.sizes = dict(files)
        #: The small files the holder sent with its header: read from here, without a request.
        self.inline = inline or {}
        self._asking = threading.Lock()  # one request sent at a time, numbered in that order
        self._turn = threading.Condition()  # the answers received in the order of the requests
        self._asked = self._answered = 0
        #: Why nothing more is read (the restore ended, a request was refused, the holder was cut off), or None.
        self._closed: str | None = None

    def read_vectored(self, rel: str, offset: int, views: Sequence[memoryview]) -> None:
        size = self.size(rel)
        # a tensor's chunks lie side by side: one message per 16 MiB, not one per chunk
        wanted = _joined([view.cast("B") for view in views])
        if offset < 0 or offset + sum(view.nbytes for view in wanted) > size:
            raise EOFError(f"{self.url}/{rel} holds {size} bytes, expected at least "
                           f"{offset + sum(view.nbytes for view in wanted)}")
        if rel in self.inline:
            self._check_open()
            for view in wanted:
                view[:] = self.inline[rel][offset:offset + view.nbytes]
                offset += view.nbytes
            return
        with self._asking:
            self._check_open()
            number = self._asked
            self._asked += 1
            self._cut_off_on_error(lambda: [work.wait() for work in send_doc(
                self.group, {"file": rel, "offset": offset, "sizes": [v.nbytes for v in wanted]}, self.holder,
                self.tag)])
        with self._turn:
            self._turn.wait_for(lambda: self._answered == number or self._closed is not None)
        try:
            self._check_open()
            self._cut_off_on_error(lambda: self._receive(rel, offset, wanted))
        finally:
            with self._turn:
                self._answered += 1
                self._turn.notify_all()

    def _check_open(self) -> None:
        if self._closed is not None:
            raise SnapshotAbortedError(f"no more reads of {self.url} from rank {self.holder}: {self._closed}")

    def _cut_off_on_error(self, call: Any) -> None:
        try:
            call()
        except SnapshotAbortedError as e:
            self._close(str(e))
            raise
        except RuntimeError as e:  # gloo: the holder's connection closed, or a wait timed out
            self._close(f"rank {self.holder}, which holds {self.url}, was cut off: {e}")
            raise SnapshotAbortedError(self._closed) from e

    def _close(self, why: str) -> None:
        with self._turn:
            self._closed = self._closed or why
            self._turn.notify_all()

    def _receive(self, rel: str, offset: int, views: list[memoryview]) -> None:
        answer = torch.zeros(1, dtype=torch.int64)
        self.group.recv([answer], self.holder, self.tag).wait()
        if int(answer) != _YES:
            raise SnapshotAbortedError(f"rank {self.holder} refused to send bytes {offset}.. of {self.url}/{rel}")
        for view in views:
            for at in range(0, view.nbytes, CHUNK):
                piece = torch.frombuffer(view[at:at + CHUNK], dtype=torch.uint8)
                self.group.recv([piece], self.holder, self.tag).wait()

    def read_into(self, rel: str, offset: int, out: memoryview) -> None:
        self.read_vectored(rel, offset, [out])

    def read_bytes(self, rel: str) -> bytes:
        data = bytearray(self.size(rel))
        self.read_into(rel, 0, memoryview(data))
        return bytes(data)

    def exists(self, rel: str) -> bool:
        rel = rel.rstrip("/")
        return not rel or rel in self.sizes or any(name.startswith(f"{rel}/") for name in self.sizes)

    def is_file(self, rel: str) -> bool:
        return rel in self.sizes

    def size(self, rel: str) -> int:
        if rel not in self.sizes:
            raise FileNotFoundError(f"{self.url}/{rel}")
        return self.sizes[rel]

    def end(self) -> None:
        """Tell the holder that the restore ended (once; nothing more is read). (``close``, which every read of
        a snapshot ends with, keeps the holder serving.)"""
        with self._asking:
            if self._closed is not None:
                return
            self._close("the restore ended")
            _tell_done(self.group, self.holder, self.tag)

    def _read_only(self, rel: str) -> PermissionError:
        return PermissionError(f"{self.url}/{rel}: a partner's copy is read-only")

    def open_writer(self, rel: str, size: int | None = None) -> BlobWriter:
        raise self._read_only(rel)

    def put_atomic(self, rel: str, data: bytes) -> None:
        raise self._read_only(rel)

    def remove(self, rel: str) -> None:
        raise self._read_only(rel)


def open_peer_files(group: Any, holder: int, tag: int) -> PeerFiles | None:
    """The copy rank ``holder`` serves to this rank (its header received), or None where it has none to serve.
    A malformed header is :class:`~ppe_snapshot.errors.SnapshotAbortedError`, the holder told to stop serving."""
    try:
        doc = receive_doc(group, holder, tag)
        files = check_header(doc, holder)
        if files is None:
            return None
        sizes = dict(files)
        inline = _inline_names(doc, sizes)
        if not isinstance(doc.get("path"), str) or inline is None:
            raise SnapshotAbortedError(f"rank {holder} sent a malformed part header")
        received = _receive_inline(group, holder, tag, {name: sizes[name] for name in inline})
    except SnapshotAbortedError:
        _tell_done(group, holder, tag)
        raise
    except RuntimeError as e:
        raise SnapshotAbortedError(f"rank {holder}, which holds a copy of this rank's part, was cut off: {e}") from e
    return PeerFiles(group, holder, tag, files, doc["path"], received)


def _receive_inline(group: Any, holder: int, tag: int, sizes: dict[str, int]) -> dict[str, bytes]:
    """The small files that follow a header, one message each, of the sizes it announced."""
    received = {}
    for name, size in sizes.items():
        data = torch.empty(size, dtype=torch.uint8)
        group.recv([data], holder, tag).wait()
        received[name] = bytes(data.numpy())
    return received


def _inline_names(doc: dict[str, Any], sizes: dict[str, int]) -> list[str] | None:
    """The files a header says follow it, each one of the copy's, small, at most once, within the total; None
    where they are not."""
    names = doc.get("inline", [])
    if not isinstance(names, list) or not all(isinstance(n, str) and 0 < sizes.get(n, 0) <= INLINE_FILE
                                              for n in names):
        return None
    if len(set(names)) != len(names) or sum(sizes[n] for n in names) > INLINE_TOTAL:
        return None
    return names


def _tell_done(group: Any, holder: int, tag: int) -> None:
    """Tell ``holder`` that this rank reads no more (nothing where it is gone)."""
    try:
        for work in send_doc(group, {"done": True}, holder, tag):
            work.wait()
    except RuntimeError:
        pass


def serve_copy(group: Any, peer: int, tag: int, path: str | None) -> None:
    """Serve the copy at ``path`` (None: this rank has none) to rank ``peer``'s reads until it says the restore
    ended; a request outside the copy's files is refused (and ends the serving). Raises
    :class:`~ppe_snapshot.errors.SnapshotAbortedError` when the peer was cut off."""
    try:
        _serve(group, peer, tag, path)
    except SnapshotAbortedError:
        raise
    except RuntimeError as e:  # gloo: the peer's connection closed, or a wait timed out
        raise SnapshotAbortedError(f"rank {peer}, reading its part from this rank's copy, was cut off: {e}") from e


def _serve(group: Any, peer: int, tag: int, path: str | None) -> None:
    files: list[tuple[str, int]] | None = None
    if path is not None:
        try:
            files = files_of(path)
        except OSError:  # the peer hears that there is no copy
            files = None
    storage = open_storage(path) if files is not None else None
    inline = _small_files(storage, files or [])
    header = {"failed": files is None, "files": files or [], "path": path, "inline": list(inline)}
    sent = send_doc(group, header, peer, tag)
    sent += [group.send([torch.frombuffer(bytearray(data), dtype=torch.uint8)], peer, tag) for data in inline.values()]
    for work in sent:
        work.wait()
    if storage is None or files is None:
        return
    sizes = dict(files)
    sending = _Sending(group, peer, tag, storage)
    try:
        while True:
            request = receive_doc(group, peer, tag)
            if not isinstance(request, dict) or request.get("done"):
                return
            rel, offset, wanted = request.get("file"), request.get("offset"), request.get("sizes")
            valid = (rel in sizes and type(offset) is int and offset >= 0 and isinstance(wanted, list)
                     and all(type(n) is int and n >= 0 for n in wanted) and offset + sum(wanted) <= sizes[rel])
            group.send([torch.tensor([_YES if valid else _NO], dtype=torch.int64)], peer, tag).wait()
            if not valid:
                return
            for at, nbytes in _pieces(offset, wanted):
                sending.piece(rel, at, nbytes)
    finally:
        sending.drain()


def _small_files(storage: Storage | None, files: list[tuple[str, int]]) -> dict[str, bytes]:
    """The copy's small files (:data:`INLINE_FILE`, :data:`INLINE_TOTAL`) that could be read, with their bytes
    (those that could not are read on request: the reader then finds out)."""
    small: dict[str, bytes] = {}
    total = 0
    for name, size in files:
        if 0 < size <= INLINE_FILE and total + size <= INLINE_TOTAL:
            assert storage is not None
            try:
                data = storage.read_bytes(name)
            except OSError:
                continue
            if len(data) == size:
                small[name] = data
                total += size
    return small


def _send_only(pages: memoryview) -> torch.Tensor:
    """A tensor over read-only ``pages`` (a file's mapping, which the caller keeps alive until the send ended), for
    gloo to send from: torch makes tensors of writable memory only, so it is made over the same address; nothing
    writes to it (a write would fault)."""
    return torch.frombuffer(_memory_at(_address(pages), pages.nbytes), dtype=torch.uint8)


class _Sending:
    """Pieces of a copy's files sent one message each, at most two on the wire; each sent from the file's pages
    mapped (:func:`~ppe_snapshot.storage.mapped`, kept until :meth:`drain`), else read into one of two buffers (the
    next read while the one before is on the wire). A piece that cannot be read goes as zeros (the reader's
    checksums then fail: it is never left waiting)."""

    def __init__(self, group: Any, peer: int, tag: int, storage: Storage) -> None:
        self.group, self.peer, self.tag, self.storage = group, peer, tag, storage
        self._mapped: dict[str, memoryview | None] = {}
        self._buffers: list[torch.Tensor] = []
        self._sent: list[Any] = []
        self._count = 0

    def piece(self, rel: str, at: int, nbytes: int) -> None:
        if rel not in self._mapped:
            self._mapped[rel] = mapped(self.storage, rel)
        if len(self._sent) == 2:
            self._sent.pop(0).wait()  # (a buffer: the one this piece goes into)
        pages = self._mapped[rel]
        if pages is not None and at + nbytes <= pages.nbytes:
            view = _send_only(pages[at:at + nbytes])
        else:
            view = self._read(rel, at, nbytes)
        self._sent.append(self.group.send([view], self.peer, self.tag))

    def _read(self, rel: str, at: int, nbytes: int) -> torch.Tensor:
        if not self._buffers:
            self._buffers = [new_staging_buffer(CHUNK) for _ in range(2)]
        view = self._buffers[self._count % 2][:nbytes]
        self._count += 1
        try:
            self.storage.read_into(rel, at, memoryview(view.numpy()))
        except (OSError, EOFError):
            view.zero_()
        return view

    def drain(self) -> None:
        sent, self._sent = self._sent, []
        for work in sent:
            work.wait()
