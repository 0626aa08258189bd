"""Reading stored bytes back, checksum-verified: straight into their destination, batched, or streamed."""
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import xxhash

from ppe_snapshot.engine._files.packing import CHUNK_BYTES, checksum, row_major_blocks, tensor_bytes
from ppe_snapshot.engine._format import Chunk, Entry, Manifest, ShardedTensorEntry
from ppe_snapshot.errors import CorruptSnapshotError
from ppe_snapshot.storage import AfterRead, Storage, shared_pool

# Smallest host buffer used when a read must go through one (device or dtype change).
ALIGN_STEP = 1 << 16


def _truncated_error(storage: Storage, file: str, error: Exception) -> CorruptSnapshotError:
    return CorruptSnapshotError(f"data file {file} of {storage.url} is missing or truncated: {error}")


def read_file_into(storage: Storage, file: str, offset: int, out: memoryview) -> None:
    """``out`` from data file ``file`` at ``offset``; a missing or short file is CorruptSnapshotError."""
    try:
        storage.read_into(file, offset, out)
    except (EOFError, FileNotFoundError) as e:
        raise _truncated_error(storage, file, e) from e


def read_views_into(storage: Storage, file: str, offsets: Sequence[int], views: Sequence[memoryview]) -> None:
    """Each of ``views`` from data file ``file`` at its offset (ascending, neighbours at most
    ``ReadBatch.MAX_GAP`` apart: the gaps are read into a scratch buffer) in one vectored read; a missing or
    short file is CorruptSnapshotError."""
    position, iov = offsets[0], views
    if offsets[-1] + views[-1].nbytes - position != sum(view.nbytes for view in views):  # gaps between them
        scratch, iov = memoryview(bytearray(ReadBatch.MAX_GAP)), []
        for offset, view in zip(offsets, views):
            if offset > position:
                iov.append(scratch[:offset - position])
            iov.append(view)
            position = offset + view.nbytes
    try:
        storage.read_vectored(file, offsets[0], iov)
    except (EOFError, FileNotFoundError) as e:
        raise _truncated_error(storage, file, e) from e


def read_addresses_into(storage: Storage, file: str, offsets: Sequence[int], addresses: Sequence[int],
                        sizes: Sequence[int], then: AfterRead | None = None) -> None:
    """:func:`read_views_into` for memory named by address: ``sizes[i]`` bytes of data file ``file`` at
    ``offsets[i]`` (ascending, neighbours at most ``ReadBatch.MAX_GAP`` apart) to ``addresses[i]``, in one
    vectored read without an object per piece (``Storage.read_scattered``); ``then`` run on this thread once
    every byte has landed (``Storage.read_scattered_then``)."""
    n = len(offsets)
    starts, lengths = np.asarray(offsets, dtype=np.int64), np.asarray(sizes, dtype=np.int64)
    gaps = starts[1:] - starts[:-1] - lengths[:-1]
    if n > 1 and (gaps.min() < 0 or gaps.max() > ReadBatch.MAX_GAP):
        raise ValueError("read_addresses_into takes pieces in file order, at most ReadBatch.MAX_GAP apart")
    scratch = np.empty(ReadBatch.MAX_GAP, dtype=np.uint8)  # the gaps' bytes, read and dropped
    iov = np.empty((2 * n - 1, 2), dtype=np.uint64)
    iov[0::2, 0], iov[0::2, 1] = addresses, lengths
    iov[1::2, 0], iov[1::2, 1] = scratch.ctypes.data, gaps
    iov = iov[iov[:, 1] > 0]
    try:
        if then is None:
            storage.read_scattered(file, int(offsets[0]), iov)
        else:
            storage.read_scattered_then(file, int(offsets[0]), iov, then)
    except (EOFError, FileNotFoundError) as e:
        raise _truncated_error(storage, file, e) from e


def _read(storage: Storage, chunk: Chunk, offset: int, out: memoryview) -> None:
    read_file_into(storage, chunk.file, chunk.offset + offset, out)


def check_stored(storage: Storage, chunks: list[Chunk], what: str) -> None:
    """Before memory is allocated for ``chunks``: refuse any that ends beyond its data file as stored.

    The manifest's checks bound every chunk by the file sizes the manifest
    records, which a crafted manifest may inflate too; each file's real size
    is asked once per storage object. Reads into an existing target need no
    such check: a short file fails the read.
    """
    for chunk in chunks:
        if chunk.nbytes:
            try:
                size = storage.known_size(chunk.file)
            except FileNotFoundError as e:
                raise _truncated_error(storage, chunk.file, e) from e
            if chunk.offset + chunk.nbytes > size:
                raise CorruptSnapshotError(
                    f"data file {chunk.file} of {storage.url} is missing or truncated: it holds {size} bytes, and "
                    f"entry {what!r} has bytes {chunk.offset}..{chunk.offset + chunk.nbytes} in it")


def _mismatch(storage: Storage, chunk: Chunk, what: str) -> CorruptSnapshotError:
    return mismatch_error(storage, chunk.file, chunk.offset, chunk.nbytes, what)


def mismatch_error(storage: Storage, file: str, offset: int, nbytes: int, what: str) -> CorruptSnapshotError:
    return CorruptSnapshotError(
        f"checksum mismatch in {storage.url}/{file} at bytes {offset}..{offset + nbytes} ({what}): the snapshot "
        "is damaged")


def _run_end(chunks: Sequence[Chunk], start: int, limit: int) -> int:
    """Where the run of ``chunks`` from ``start`` ends that lie one after another in one file, of at most
    ``limit`` bytes (at least one chunk): one read covers it. A payload's blocks are such a run."""
    end, total = start + 1, chunks[start].nbytes
    while end < len(chunks):
        last, chunk = chunks[end - 1], chunks[end]
        if chunk.file != last.file or chunk.offset != last.offset + last.nbytes or total + chunk.nbytes > limit:
            break
        total, end = total + chunk.nbytes, end + 1
    return end


#: A chunk of at least this many bytes, on a storage whose small reads are cheap (``Storage.small_reads_cheap``),
#: is read in pieces of this size, each hashed as soon as it landed, while the CPU's cache still holds it. Four
#: processes at once each reading 256 MiB from tmpfs on 2 cores (benchmarks/RESULTS.md, issue 34): 0.11-0.14 s
#: read alone, 0.13-0.15 s read then hashed in 16 MiB, 0.11-0.13 s in 1 MiB pieces, 0.12-0.17 s in 4 MiB ones.
HASHED_PIECE = 1 << 20


def _read_hashing(storage: Storage, chunk: Chunk, out: memoryview, what: str) -> None:
    """``chunk`` into ``out``, piece by piece, each piece hashed as it lands; the chunk verified."""
    digest = xxhash.xxh3_64()
    for at in range(0, chunk.nbytes, HASHED_PIECE):
        piece = out[at:at + HASHED_PIECE]
        read_file_into(storage, chunk.file, chunk.offset + at, piece)
        digest.update(piece)
    if digest.hexdigest() != chunk.checksum:
        raise _mismatch(storage, chunk, what)


def _hashed_in_pieces(storage: Storage, chunk: Chunk) -> bool:
    return storage.small_reads_cheap and storage.verify_data and chunk.nbytes >= HASHED_PIECE


def read_into(storage: Storage, chunks: list[Chunk], out: memoryview, what: str, verify: bool | None = None) -> None:
    """Fill ``out`` with the chunks' bytes (neighbouring ones read at once), verifying each chunk where ``verify``
    (None: unless the storage needs no check, ``Storage.verify_data``)."""
    verify = storage.verify_data if verify is None else verify
    position, start = 0, 0
    while start < len(chunks):
        if _hashed_in_pieces(storage, chunks[start]):
            _read_hashing(storage, chunks[start], out[position:position + chunks[start].nbytes], what)
            position, start = position + chunks[start].nbytes, start + 1
            continue
        end = _run_end(chunks, start, CHUNK_BYTES)
        end = next((i for i in range(start + 1, end) if _hashed_in_pieces(storage, chunks[i])), end)
        n = sum(chunk.nbytes for chunk in chunks[start:end])
        read_file_into(storage, chunks[start].file, chunks[start].offset, out[position:position + n])
        at = position
        for chunk in chunks[start:end] if verify else ():
            if checksum(out[at:at + chunk.nbytes]) != chunk.checksum:
                raise _mismatch(storage, chunk, what)
            at += chunk.nbytes
        position, start = position + n, end


class ReadBatch:
    """Reads into their final destinations, started while more are added; complete at ``join()``.

    Pending reads are sorted and coalesced: neighbouring chunks of a file
    become one vectored read (the alignment gaps land in a scratch buffer),
    so thousands of small tensors cost a few syscalls. Each time another
    ``MAX_RUN`` bytes are pending, the runs of at least half that size go to
    a small thread pool, in file order, and are read while the caller goes on
    walking the manifest (for 5,000 small tensors that walk costs about as
    long as the reads); shorter runs wait for neighbours (a resharding restore
    reads a little of many files in turn), and ``join()`` starts the rest: a
    cold disk delivers about twice the bandwidth with two reads in flight
    instead of one (measured here), and page-cache copies use both cores;
    preadv and xxhash release the GIL. A destination must not be touched
    before ``join()``, which waits for every read and raises the first
    failure. Without a batch, reads happen at once.
    """

    #: Neighbouring chunks at most this far apart share one vectored read ...
    MAX_GAP = 4096
    #: ... of at most this many bytes.
    MAX_RUN = 32 << 20

    def __init__(self) -> None:
        self._reads: list[tuple[Storage, Chunk, memoryview, str]] = []
        self._pending_bytes = 0
        self._next_start = self.MAX_RUN
        self._futures: list[Future[None]] = []

    @staticmethod
    def _executor(storage: Storage, workers: int | None = None) -> ThreadPoolExecutor:
        """The pool of ``workers`` threads, by default ``storage.read_workers`` (reads in flight: 2 on a local
        disk, more on object stores)."""
        return shared_pool("ppe-snapshot-read", workers or storage.read_workers)

    def read_into(self, storage: Storage, chunks: list[Chunk], out: memoryview, what: str) -> None:
        position = 0
        for chunk in chunks:
            self._reads.append((storage, chunk, out[position:position + chunk.nbytes], what))
            position += chunk.nbytes
        self._pending_bytes += position
        if self._pending_bytes >= self._next_start:
            self._start(only_long=True)

    def submit(self, storage: Storage, fn: Any, *args: Any, workers: int | None = None) -> None:
        """Run ``fn(*args)``, a read of ``storage``, on its read pool (of ``workers`` threads where given) now;
        ``join()`` waits for it and raises its failure."""
        self._futures.append(self._executor(storage, workers).submit(fn, *args))

    def _start(self, only_long: bool = False) -> None:
        """Hand pending reads to the pool, as runs in file order: all of them, or the long runs only."""
        runs, self._reads = self._runs(), []
        if only_long:
            short = [r for r in runs if _span(r) < self.MAX_RUN // 2]
            runs = [r for r in runs if _span(r) >= self.MAX_RUN // 2]
            self._reads = [read for run in short for read in run]
        self._pending_bytes = sum(read[1].nbytes for read in self._reads)
        self._next_start = self._pending_bytes + self.MAX_RUN
        self._futures.extend(self._executor(run[0][0]).submit(_read_run, run) for run in runs)

    def join(self) -> None:
        if not self._futures and len(runs := self._runs()) == 1:  # one read: no thread hand-off
            self._reads, self._pending_bytes, self._next_start = [], 0, self.MAX_RUN
            _read_run(runs[0])
            return
        self._start()
        futures, self._futures = self._futures, []
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        if errors:
            raise errors[0]

    def _runs(self) -> list[list[tuple[Storage, Chunk, memoryview, str]]]:
        """The reads grouped into runs of neighbouring chunks of one file, in file order."""
        ordered = sorted(self._reads, key=lambda r: (id(r[0]), r[1].file, r[1].offset))
        runs: list[list[tuple[Storage, Chunk, memoryview, str]]] = []
        for read in ordered:
            storage, chunk = read[0], read[1]
            if runs:
                last = runs[-1][-1]
                end = last[1].offset + last[1].nbytes
                if (last[0] is storage and last[1].file == chunk.file and 0 <= chunk.offset - end <= self.MAX_GAP
                        and chunk.offset + chunk.nbytes - runs[-1][0][1].offset <= self.MAX_RUN):
                    runs[-1].append(read)
                    continue
            runs.append([read])
        return runs


def _span(run: list[tuple[Storage, Chunk, memoryview, str]]) -> int:
    return run[-1][1].offset + run[-1][1].nbytes - run[0][1].offset


def _read_run(run: list[tuple[Storage, Chunk, memoryview, str]]) -> None:
    """One vectored read for neighbouring chunks of one file, then each chunk's checksum; a chunk read in pieces
    (``HASHED_PIECE``) splits the run."""
    storage, start = run[0][0], 0
    for i, (_, chunk, view, what) in enumerate(run):
        if _hashed_in_pieces(storage, chunk):
            if start < i:
                _read_vectored_run(run[start:i])
            _read_hashing(storage, chunk, view, what)
            start = i + 1
    if start < len(run):
        _read_vectored_run(run[start:])


def _read_vectored_run(run: list[tuple[Storage, Chunk, memoryview, str]]) -> None:
    storage, first = run[0][0], run[0][1]
    read_views_into(storage, first.file, [chunk.offset for _, chunk, _, _ in run], [view for _, _, view, _ in run])
    for _, chunk, view, what in run if storage.verify_data else ():
        if checksum(view) != chunk.checksum:
            raise _mismatch(storage, chunk, what)


def coalesced(spans: Sequence[tuple[int, int]], max_run: int = 4 << 20) -> list[tuple[int, int]]:
    """The ranges ``(first, stop)`` of ``spans`` (``(offset, nbytes)`` in one file, by offset) that one read each
    covers: neighbours at most ``ReadBatch.MAX_GAP`` apart, at most ``max_run`` bytes (or one span)."""
    ranges: list[tuple[int, int]] = []
    for i, (offset, n) in enumerate(spans):
        if ranges:
            first, _ = ranges[-1]
            end = spans[i - 1][0] + spans[i - 1][1]
            if 0 <= offset - end <= ReadBatch.MAX_GAP and offset + n - spans[first][0] <= max_run:
                ranges[-1] = (first, i + 1)
                continue
        ranges.append((i, i + 1))
    return ranges


def fill(reads: ReadBatch | None, storage: Storage, chunks: list[Chunk], out: memoryview, what: str) -> None:
    """Read into a final destination: through ``reads`` when given, else now."""
    if reads is None:
        read_into(storage, chunks, out, what)
    else:
        reads.read_into(storage, chunks, out, what)


class ChunkReader:
    """Reads chunks front to back in pieces of any size, verifying each chunk when its last byte is read (unless
    the storage needs no check: ``Storage.verify_data``)."""

    def __init__(self, storage: Storage, chunks: list[Chunk], what: str) -> None:
        self._storage, self._what, self._verify = storage, what, storage.verify_data
        self._chunks = [c for c in chunks if c.nbytes]
        self._index, self._done, self._digest = 0, 0, xxhash.xxh3_64()

    def read(self, out: memoryview) -> None:
        filled = 0
        while filled < out.nbytes:  # one read per run of neighbouring chunks, then each chunk's part hashed
            first = self._chunks[self._index]
            end = _run_end(self._chunks, self._index, self._done + out.nbytes - filled)
            n = min(out.nbytes - filled, sum(c.nbytes for c in self._chunks[self._index:end]) - self._done)
            read_file_into(self._storage, first.file, first.offset + self._done, out[filled:filled + n])
            stop = filled + n
            while filled < stop:
                chunk = self._chunks[self._index]
                part = min(stop - filled, chunk.nbytes - self._done)
                if self._verify:
                    self._digest.update(out[filled:filled + part])
                filled, self._done = filled + part, self._done + part
                if self._done == chunk.nbytes:
                    if self._verify and self._digest.hexdigest() != chunk.checksum:
                        raise _mismatch(self._storage, chunk, self._what)
                    self._index, self._done, self._digest = self._index + 1, 0, xxhash.xxh3_64()


def read_through_host(storage: Storage, chunks: list[Chunk], target: torch.Tensor, what: str,
                      budget: int | None) -> None:
    """Fill a tensor that cannot be read into directly (on a device, or not contiguous), in row-major
    pieces through a host buffer of at most ``budget`` bytes (pinned for CUDA)."""
    size = target.element_size()
    step = max(ALIGN_STEP, min(budget or CHUNK_BYTES, CHUNK_BYTES))
    bounce = torch.empty(min(step, target.numel() * size), dtype=torch.uint8,
                         pin_memory=target.device.type == "cuda")
    reader = ChunkReader(storage, chunks, what)
    with torch.no_grad():
        for block in row_major_blocks(target.detach(), step // size):
            host = bounce[: block.numel() * size]
            reader.read(tensor_bytes(host))
            block.copy_(host.view(target.dtype).view(block.shape))


def verify_chunks(storage: Storage, manifest: Manifest, budget: int = CHUNK_BYTES) -> None:
    """Read every chunk of every entry through one buffer and check its checksum. The buffer grows to the
    largest read, at most ``budget`` bytes (made at once, zeroed 64 MiB cost a small snapshot's verify 35 ms)."""
    buffer = bytearray()
    seen: set[Chunk] = set()  # entries may share chunks
    # Each section once, not each rank's view of them: a manifest of many ranks would make that quadratic.
    for table in manifest.tables():
        for path, entry in table.items():
            chunks = [chunk for chunk in _chunks_of(entry) if chunk not in seen]
            seen.update(chunks)
            start = 0
            while start < len(chunks):  # neighbouring chunks that fit the buffer: one read
                end = _run_end(chunks, start, budget)
                need = min(budget, sum(chunk.nbytes for chunk in chunks[start:end]))
                if len(buffer) < need:
                    buffer = bytearray(min(budget, max(need, 2 * len(buffer))))
                if chunks[start].nbytes <= budget:
                    read_into(storage, chunks[start:end], memoryview(buffer)[:need], path, verify=True)
                    start = end
                    continue
                chunk, digest = chunks[start], xxhash.xxh3_64()
                for offset in range(0, chunk.nbytes, budget):
                    view = memoryview(buffer)[: min(budget, chunk.nbytes - offset)]
                    _read(storage, chunk, offset, view)
                    digest.update(view)
                if digest.hexdigest() != chunk.checksum:
                    raise _mismatch(storage, chunk, path)
                start += 1


def _chunks_of(entry: Entry) -> list[Chunk]:
    if isinstance(entry, ShardedTensorEntry):
        return [c for shard in entry.shards for c in shard.chunks]
    return list(getattr(entry, "chunks", []))
