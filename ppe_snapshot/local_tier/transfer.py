"""Moving a part (the files of a one-rank engine snapshot) from one rank to another through a gloo group.

A sender first sends a header (its files and their sizes; ``failed``: it has no part to send), then the files'
bytes as one stream in chunks of :data:`CHUNK` bytes, then the xxh3_64 of the stream: the memory a transfer holds
is two chunks per direction (one on the wire, one being read or written), whatever the part's size. The receiver checks the header (relative names inside the
part, sizes that add up to at most :data:`MAX_PART` bytes) before it writes anything, writes the files where it
is told and hashes what it received as it comes: a copy whose digest differs from the sender's is refused. The
part's own checksums are checked when it is restored (and whole, before, by :func:`verified` where asked).

A rank may send one part and receive several in one call (:func:`move`), all chunk by chunk at once, so that a
ring of ranks each sending to the next never waits on itself.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from ppe_snapshot.engine import LOCAL, Snapshot, new_staging_buffer
from ppe_snapshot.errors import SnapshotAbortedError
from ppe_snapshot.storage import BlobWriter, Storage, is_safe_relative, open_storage, open_tree

#: Bytes per message of a transfer.
CHUNK = 16 << 20
#: The largest header a peer may send.
MAX_HEADER = 1 << 20
#: The largest part a peer may announce (1 TiB).
MAX_PART = 1 << 40


@dataclass
class Incoming:
    """A part to receive from ``peer`` into the directory ``dest`` (a local path)."""
    peer: int
    dest: str


def files_of(path: str) -> list[tuple[str, int]]:
    """The files under directory ``path``, relative, with their sizes (none where nothing is there)."""
    tree = open_tree(path)
    root = tree.root
    found: list[tuple[str, int]] = []
    pending = [root]
    while pending:
        for entry in tree.list(pending.pop()):
            name = entry["name"].rstrip("/")
            if entry.get("type") == "directory":
                pending.append(name)
            else:
                found.append((name[len(root) + 1:], int(entry["size"])))
    return sorted(found)


def check_header(doc: Any, peer: int) -> list[tuple[str, int]] | None:
    """The files a header from ``peer`` announces (None: the peer has no part); ``SnapshotAbortedError`` when
    the header is malformed."""
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, list) or not all(
            isinstance(f, list) and len(f) == 2 and is_safe_relative(f[0]) and type(f[1]) is int and f[1] >= 0
            for f in files) or sum(f[1] for f in files) > MAX_PART:
        raise SnapshotAbortedError(f"rank {peer} sent a malformed part header")
    return None if doc.get("failed") else [(name, size) for name, size in files]


def send_doc(group: Any, doc: Any, peer: int, tag: int) -> list[Any]:
    data = json.dumps(doc).encode()
    return [group.send([torch.tensor([len(data)], dtype=torch.int64)], peer, tag),
            group.send([torch.frombuffer(bytearray(data), dtype=torch.uint8)], peer, tag)]


def receive_doc(group: Any, peer: int, tag: int) -> Any:
    size = torch.zeros(1, dtype=torch.int64)
    group.recv([size], peer, tag).wait()
    if not 0 < int(size) <= MAX_HEADER:
        raise SnapshotAbortedError(f"rank {peer} sent a header of {int(size)} bytes")
    data = torch.empty(int(size), dtype=torch.uint8)
    group.recv([data], peer, tag).wait()
    return json.loads(bytes(data.numpy()))


class _Stream:
    """The files of a part as one stream of bytes, read or written one chunk at a time."""

    def __init__(self, storage: Storage, files: list[tuple[str, int]]) -> None:
        self.storage, self.files = storage, files
        self.total = sum(size for _, size in files)
        self.chunks = -(-self.total // CHUNK)
        self.sizes = dict(files)
        self._writers: dict[str, BlobWriter] = {}
        #: The xxh3_64 of the stream's bytes so far, as sent or as received.
        self.digest = xxhash.xxh3_64()
        #: What failed on this side (the transfer goes on to its end, so the peer is never left waiting).
        self.problem: str | None = None

    def _spans(self, index: int) -> list[tuple[str, int, int, int]]:
        """(file, offset in the file, offset in the chunk, bytes) of each piece of chunk ``index``."""
        start, end = index * CHUNK, min((index + 1) * CHUNK, self.total)
        spans, at = [], 0
        for name, size in self.files:
            lo, hi = max(start, at), min(end, at + size)
            if lo < hi:
                spans.append((name, lo - at, lo - start, hi - lo))
            at += size
        return spans

    def chunk_bytes(self, index: int) -> int:
        return min(CHUNK, self.total - index * CHUNK)

    def read(self, index: int, out: memoryview) -> None:
        """Chunk ``index`` into ``out``; a file that cannot be read sends zeros (the copy then fails its checks:
        the peer still gets every chunk it expects)."""
        for name, offset, at, size in self._spans(index):
            try:
                self.storage.read_into(name, offset, out[at:at + size])
            except OSError as e:
                self.problem = self.problem or f"reading {name}: {e}"
                out[at:at + size] = bytes(size)
        self.digest.update(out[:self.chunk_bytes(index)])

    def write(self, index: int, data: memoryview) -> None:
        """Chunk ``index`` into the files; after a failure (a full tmpfs) the rest is received and dropped."""
        self.digest.update(data)
        if self.problem is not None:
            return
        try:
            for name, offset, at, size in self._spans(index):
                writer = self._writers.get(name)
                if writer is None:
                    writer = self._writers[name] = self.storage.open_writer(name, self.sizes[name])
                writer.write([data[at:at + size]])
                if offset + size == self.sizes[name]:
                    self._writers.pop(name).close()
        except OSError as e:
            self.problem = f"writing {name}: {e}"

    def finish(self) -> None:
        """Create the empty files (no chunk names them) and close what is open."""
        try:
            for name, size in self.files:
                if size == 0 and self.problem is None:
                    self.storage.open_writer(name, 0).close()
        except OSError as e:
            self.problem = f"writing {name}: {e}"
        for writer in self._writers.values():
            writer.abort()


def move(group: Any, tag: int, send: tuple[int, str | None] | None,
         receive: list[Incoming]) -> dict[int, str | None]:
    """Send the part at ``send[1]`` (None: this rank has none; its peer learns so) to rank ``send[0]``, and
    receive the parts ``receive`` names, in one go. Returns, per peer received from, None where its part was
    written at its ``dest`` (still to be :func:`verified`), else why not. Local file errors never stop a transfer
    half way; a peer that died or broke the protocol raises :class:`~ppe_snapshot.errors.SnapshotAbortedError`."""
    try:
        return _move(group, tag, send, receive)
    except RuntimeError as e:  # gloo: the peer's connection closed, or a wait timed out
        raise SnapshotAbortedError(f"a partner copy was cut off: {e}") from e


def _move(group: Any, tag: int, send: tuple[int, str | None] | None,
          receive: list[Incoming]) -> dict[int, str | None]:
    outgoing = None
    if send is not None and send[1] is not None:
        try:
            outgoing = _Stream(open_storage(send[1]), files_of(send[1]))
        except OSError:  # the peer hears that there is no part
            outgoing = None
    files = [] if outgoing is None else outgoing.files
    pending = [] if send is None else send_doc(group, {"failed": outgoing is None, "files": files}, send[0], tag)
    incoming: dict[int, _Stream | None] = {}
    for part in receive:
        files = check_header(receive_doc(group, part.peer, tag), part.peer)
        incoming[part.peer] = None if files is None else _Stream(open_storage(part.dest), files)
    for work in pending:
        work.wait()
    _stream_chunks(group, tag, None if outgoing is None else (send[0], outgoing), incoming)
    sums = [] if outgoing is None else [group.send([_as_tensor(outgoing.digest.intdigest())], send[0], tag)]
    for peer, stream in incoming.items():
        if stream is not None:
            stream.finish()
            sent = torch.zeros(1, dtype=torch.int64)
            group.recv([sent], peer, tag).wait()
            if int(sent) != int(_as_tensor(stream.digest.intdigest())):
                stream.problem = stream.problem or "its bytes differ from what was sent (xxh3_64 of the stream)"
    for work in sums:
        work.wait()
    return {peer: "it had no part to send" if stream is None else stream.problem for peer, stream in incoming.items()}


def _stream_chunks(group: Any, tag: int, outgoing: tuple[int, _Stream] | None,
                   incoming: dict[int, _Stream | None]) -> None:
    """Send ``outgoing``'s chunks to its peer and receive each incoming stream's, pipelined: two buffers per
    direction, so that chunk ``i + 1`` is read (or received) while chunk ``i`` is on the wire (or written).
    Every rank goes through the chunks in order, so no wait here is on a chunk a peer has not reached."""
    sending = outgoing is not None and outgoing[1].total > 0
    # page-aligned: the files are read and written straight from them, with no bounce copy
    out_buffers = [new_staging_buffer(CHUNK) for _ in range(2 if sending else 0)]
    streams = {peer: s for peer, s in incoming.items() if s is not None and s.chunks}
    in_buffers = {peer: [new_staging_buffer(CHUNK) for _ in range(2)] for peer in streams}

    def receive(peer: int, index: int) -> tuple[torch.Tensor, Any]:
        view = in_buffers[peer][index % 2][: streams[peer].chunk_bytes(index)]
        return view, group.recv([view], peer, tag)

    posted = {peer: receive(peer, 0) for peer in streams}
    sent: list[Any] = []
    rounds = max([s.chunks for s in streams.values()] + ([outgoing[1].chunks] if sending else []), default=0)
    for index in range(rounds):
        if sending and index < outgoing[1].chunks:
            if len(sent) == 2:
                sent.pop(0).wait()  # its buffer is the one chunk ``index`` goes into
            view = out_buffers[index % 2][: outgoing[1].chunk_bytes(index)]
            outgoing[1].read(index, memoryview(view.numpy()))
            sent.append(group.send([view], outgoing[0], tag))
        for peer, stream in streams.items():
            if index < stream.chunks:
                view, work = posted[peer]
                work.wait()
                if index + 1 < stream.chunks:
                    posted[peer] = receive(peer, index + 1)
                stream.write(index, memoryview(view.numpy()))
    for work in sent:
        work.wait()


def _as_tensor(digest: int) -> torch.Tensor:
    """A 64-bit digest as one int64."""
    return torch.tensor([digest - (1 << 64) if digest >= 1 << 63 else digest], dtype=torch.int64)


def verified(path: str | Storage) -> str | None:
    """None when the part at ``path`` (or read through a storage) is a committed snapshot whose every chunk matches
    its checksum, else what is wrong."""
    try:
        Snapshot(path, pg=LOCAL).verify(deep=True)
    except Exception as e:  # noqa: BLE001 - any failure means the copy is not usable
        return f"{type(e).__name__}: {e}"
    return None
