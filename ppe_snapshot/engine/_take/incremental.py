"""Incremental takes: only the blocks that changed since a base snapshot are written.

Each payload of a rank is cut into blocks (the cut its path had in the base, when the sizes agree: every take,
incremental or not, writes its payloads in chunks of its block size, so these are the base's blocks; else blocks
of ``block_bytes``) and every block is hashed (xxh3_64). A block whose size and hash equal those of a base chunk
(the same path's chunk at the same place first, else any chunk of the base with that size and hash) is not
written: the new snapshot's chunk names the file and offset where the base holds those bytes,
``../<base name>/data/rank<r>.bin``, or where the base itself referenced them (references never chain). Every
other block is appended to this rank's data file (a changed base chunk larger than ``block_bytes`` cut into
blocks of ``block_bytes``), and so are the blocks kept of a base file that would be referenced for less than
half its bytes (:mod:`~ppe_snapshot.engine._take.sparse_references`). Readers check every chunk's checksum,
referenced or not, so a block taken as unchanged by a hash collision (about 2^-64 per block compared) is the only
way to a wrong byte.

The base must be a snapshot beside the new one (the same run directory): references are relative and never
leave it (``docs/format.md``, section 12).
"""
from __future__ import annotations

import itertools
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from ppe_snapshot.engine._files import (
    ALIGNMENT, CHUNK_BYTES, FileLayout, PayloadAppender, align, is_copyable_raw, lay_out, tensor_bytes,
)
from ppe_snapshot.engine._format import Chunk, Manifest, Raw, ShardedTensorEntry, chunk_list
from ppe_snapshot.engine._state import Payload, ShardPlan
from ppe_snapshot.engine._take.sparse_references import Kept, copy_sparse_references
from ppe_snapshot.engine._versions import FormatVersion, can_reference, read_manifest, version_of, write_version
from ppe_snapshot.settings import SETTINGS
from ppe_snapshot.storage import Storage, absolute, open_storage, shared_pool, split_reference

#: Rows handed from the hashing thread to the writing one at a time (and at most this many bytes of them).
_BATCH_ROWS = 4096
_BATCH_BYTES = 16 << 20
#: Threads hashing a batch's blocks (xxhash lets go of the GIL): hashing a state that did not change is most of
#: an incremental take's work, and one thread hashes about 10 GB/s here.
HASH_THREADS = min(4, os.cpu_count() or 1)


def check_block_bytes(block_bytes: Any) -> int:
    """``block_bytes`` if it is a valid block size (a positive multiple of 64), else a ValueError saying so."""
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < ALIGNMENT \
            or block_bytes % ALIGNMENT or block_bytes > CHUNK_BYTES:
        raise ValueError(f"block_bytes (PPE_SNAPSHOT_BLOCK_KB in KiB) must be a multiple of {ALIGNMENT} from "
                         f"{ALIGNMENT} to {CHUNK_BYTES} (the size of the blocks a take writes and an incremental "
                         f"take compares), got {block_bytes!r}")
    return block_bytes


def block_size(block_bytes: Any) -> int:
    """The block size of a take given ``block_bytes`` (None: ``PPE_SNAPSHOT_BLOCK_KB``), checked."""
    return check_block_bytes(SETTINGS.block_bytes if block_bytes is None else block_bytes)


def check_version(version: int, base: Any) -> None:
    """Raise unless takes writing format ``version`` can reference base ``base`` (index files: version 2 and up)."""
    if not can_reference(version):
        raise ValueError(f"an incremental take (base={base!r}) needs format version 2 or newer; "
                         f"PPE_SNAPSHOT_FORMAT_VERSION asks for {version}")


def split_location(location: str) -> tuple[str, str]:
    """``(run directory, snapshot name)`` of a snapshot location (a local path or a URL)."""
    parent, _, name = absolute(str(location).rstrip("/")).rpartition("/")
    return parent, name


@dataclass
class Base:
    """What a rank of an incremental take may reference of its base snapshot, file names relative to the new
    snapshot (``../<name>/...``)."""
    #: path -> its chunks in the base (its own entries, the replicated ones and its own shards).
    by_path: dict[str, list[Chunk]] = field(default_factory=dict)
    #: (nbytes, checksum) -> a chunk of the base holding such bytes.
    by_content: dict[tuple[int, str], Chunk] = field(default_factory=dict)
    #: Every data file the chunks name, with its size.
    sizes: dict[str, int] = field(default_factory=dict)


def check_base(location: Any, new_location: str) -> str:
    """The name of base snapshot ``location`` in its run directory; raises unless it is another snapshot in the
    directory of ``new_location`` (references stay inside the run directory)."""
    if not isinstance(location, (str, os.PathLike)):
        raise TypeError(f"base must be the path or URL of a snapshot, got {type(location).__name__}")
    run_dir, name = split_location(str(location))
    new_run_dir, new_name = split_location(new_location)
    if run_dir != new_run_dir or not name or name == new_name:
        raise ValueError(f"base={str(location)!r}: an incremental snapshot's base must be another snapshot in the "
                         f"same directory as the new one ({new_run_dir}), so that its references stay inside "
                         "that run directory")
    return name


def open_base(location: str, new_location: str, rank: int, sharded: dict[str, ShardPlan],
              storage_options: dict[str, Any] | None) -> Base:
    """The base of rank ``rank``'s share of an incremental take at ``new_location``; raises unless ``location``
    is a committed snapshot in the same run directory."""
    name = check_base(location, new_location)
    storage = open_storage(location, storage_options)
    try:
        manifest = read_manifest(storage)
        base = Base()
        sizes = version_of(manifest.version).file_sizes(manifest, rank)
        for path, chunks in _base_chunks(manifest, rank, sharded, name):
            if chunks:
                base.by_path[path] = chunks
        for chunks in base.by_path.values():
            for chunk in chunks:
                base.by_content.setdefault((chunk.nbytes, chunk.checksum), chunk)
        base.sizes = {_rebased_name(n, name): size for n, size in sizes.items()}
        return base
    finally:
        storage.close()


def _base_chunks(manifest: Manifest, rank: int, sharded: dict[str, ShardPlan], name: str
                 ) -> Iterator[tuple[str, list[Chunk]]]:
    """The chunks (named as the new snapshot names them) of the base's entries that rank ``rank`` may match, by
    layout name: its own and the replicated ones, and its own shards of the sharded tensors it writes now (by
    their layout names, where the boxes agree)."""
    version = version_of(manifest.version)
    if rank < manifest.world_size:
        yield from _table_chunks(version, manifest.ranks[rank], name)
    yield from _table_chunks(version, manifest.replicated, name)
    for path, shard in _shards(version, manifest, rank, sharded):
        yield path, [_rebased(c, name) for c in shard.chunks]


def _table_chunks(version: FormatVersion, table: Any, name: str) -> Iterator[tuple[str, list[Chunk]]]:
    """Every entry's chunks of one table of the base: a version-2 index's tensor rows straight from its columns
    (no entry object per tensor: a state of 10^5 tensors), every other entry as it decodes."""
    index = version.columns(table)
    if index is None:  # the entries are held one by one
        for path, entry in table.items():
            yield from _entry_chunks(path, entry, name)
        return
    ends = index.cols["tensor_chunk_end"].tolist()
    chunks = chunk_list(index, 0, ends[-1] if ends else 0, [_rebased_name(n, name) for n in index.file_names])
    start = 0
    for path, end in zip(index.header["tensors"], ends):
        yield path, chunks[start:end]
        start = end
    for path in index.header["entries"]:
        yield from _entry_chunks(path, table.get(path), name)


def _entry_chunks(path: str, entry: Any, name: str) -> Iterator[tuple[str, list[Chunk]]]:
    """An entry's chunks by the name they are matched under: the DCP adapter's chunked tensors a piece each."""
    if isinstance(entry, ShardedTensorEntry):
        for shard in entry.shards:
            yield block_key(path, shard.offsets), [_rebased(c, name) for c in shard.chunks]
    else:
        yield path, [_rebased(c, name) for c in getattr(entry, "chunks", None) or []]


def block_key(path: str, offsets: Sequence[int]) -> str:
    """The name under which a base's piece of a tensor at ``offsets`` is matched (a DCP chunk)."""
    return f"{path}@{','.join(map(str, offsets))}"


def write_pieces(storage: Storage, file: str, pieces: list[tuple[str, Sequence[int] | None, Payload]],
                 base: str, storage_options: dict[str, Any] | None, block_bytes: int | None = None
                 ) -> IncrementalWrite:
    """Write ``pieces`` (path, offsets of a piece of a tensor or None for a whole value, payload) to ``file`` of
    the snapshot at ``storage``, referencing what snapshot ``base`` beside it holds: an incremental write for a
    writer that builds its manifest itself (the DCP adapter). Chunks come back in the order of ``pieces``."""
    check_version(write_version(), base)
    opened = open_base(base, storage.url, 0, {}, storage_options)
    named = [(path if offsets is None else block_key(path, offsets), payload) for path, offsets, payload in pieces]
    return write_incremental(storage, lay_out(file, named), None, opened, block_bytes)


def _shards(version: FormatVersion, manifest: Manifest, rank: int, sharded: dict[str, ShardPlan]
            ) -> Iterator[tuple[str, Any]]:
    """The base's shards that rank ``rank`` writes again, by their layout names."""
    for path, plan in sharded.items():
        if path not in manifest.sharded:
            continue
        entry = version.own_shards(manifest, rank, path)
        if entry is None:
            continue
        boxes = {(tuple(s.offsets), tuple(s.sizes)): s for s in entry.shards}
        for offsets, sizes, layout_name in plan.shards:
            shard = boxes.get((tuple(offsets), tuple(sizes)))
            if shard is not None:
                yield layout_name, shard


def _rebased_name(name: str, base_name: str) -> str:
    """A base's data file name as the new snapshot names it: a file of the base is ``../<base>/<file>``; a
    file the base itself referenced keeps its name (the same run directory: references never chain)."""
    return name if split_reference(name) is not None else f"../{base_name}/{name}"


def _rebased(chunk: Chunk, base_name: str) -> Chunk:
    return Chunk(_rebased_name(chunk.file, base_name), chunk.offset, chunk.nbytes, chunk.checksum)


def _row_bytes(layout: FileLayout, staged: torch.Tensor | None) -> Iterator[memoryview]:
    """Each row's bytes: a slice of the staged image, or of the live payload (a tensor not readable as it is,
    on a device or a view, is copied to host memory first, one at a time)."""
    if staged is not None:
        image = tensor_bytes(staged[: layout.size])
        for offset, n in zip(layout.offsets, layout.sizes):
            yield image[offset:offset + n]
        return
    for data, kind in zip(layout.datas(), layout.kinds()):
        if kind == Raw.TENSOR:
            if not is_copyable_raw(data):
                data = data.detach().resolve_conj().resolve_neg().contiguous().cpu()
            yield tensor_bytes(data)
        elif kind == Raw.NDARRAY:
            yield memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        else:
            yield memoryview(data)


def _cut(n: int, base_chunks: list[Chunk] | None, block_bytes: int) -> list[tuple[int, int]]:
    """Where a payload of ``n`` bytes is compared: the base's chunks of its path where they hold ``n`` bytes, else
    blocks of ``block_bytes`` (one empty block for no bytes)."""
    if base_chunks is not None:
        if len(base_chunks) == 1 and base_chunks[0].nbytes == n:  # most payloads: one chunk
            return [(0, n)]
        sizes = [c.nbytes for c in base_chunks]
        if sum(sizes) == n:
            return list(zip(itertools.accumulate(sizes[:-1], initial=0), sizes))
    if n <= block_bytes:
        return [(0, n)]
    return [(start, min(block_bytes, n - start)) for start in range(0, n, block_bytes)]


@dataclass(slots=True)
class _Row:
    view: memoryview
    cuts: list[tuple[int, int]]
    digests: list[str]
    base: list[Chunk] | None


def _hash_rows(layout: FileLayout, staged: torch.Tensor | None, base: Base, block_bytes: int,
               out: "queue.Queue[list[_Row] | BaseException | None]") -> None:
    """The hashing thread: every row's cut and block hashes, handed over in batches (then None)."""
    try:
        batch, batch_bytes = [], 0
        for path, view in zip(layout.paths, _row_bytes(layout, staged)):
            base_chunks = base.by_path.get(path)
            batch.append(_Row(view, _cut(view.nbytes, base_chunks, block_bytes), [], base_chunks))
            batch_bytes += view.nbytes
            if len(batch) >= _BATCH_ROWS or batch_bytes >= _BATCH_BYTES:
                out.put(_hashed(batch, batch_bytes))
                batch, batch_bytes = [], 0
        out.put(_hashed(batch, batch_bytes))
        out.put(None)
    except BaseException as e:  # handed to the writing thread
        out.put(e)


def _hashed(batch: list[_Row], nbytes: int) -> list[_Row]:
    """``batch`` with each row's block hashes, computed by up to ``HASH_THREADS`` threads over equal shares of its
    bytes (a small batch in this thread)."""
    blocks = [(row, start, n) for row in batch for start, n in row.cuts]
    shares = HASH_THREADS if nbytes >= HASH_THREADS * (4 << 20) else 1
    if shares == 1:
        digests = _digests(blocks)
    else:
        ends = np.cumsum([n for _, _, n in blocks])
        bounds = [0, *np.searchsorted(ends, [nbytes * k // shares for k in range(1, shares)]).tolist(), len(blocks)]
        pool = shared_pool("ppe-snapshot-block-hashes", HASH_THREADS)
        digests = [d for part in pool.map(_digests, [blocks[a:b] for a, b in zip(bounds, bounds[1:])]) for d in part]
    position = 0
    for row in batch:
        row.digests = digests[position:position + len(row.cuts)]
        position += len(row.cuts)
    return batch


def _digests(blocks: list[tuple[_Row, int, int]]) -> list[str]:
    digest = xxhash.xxh3_64_hexdigest
    return [digest(row.view[start:start + n]) for row, start, n in blocks]


@dataclass
class IncrementalWrite:
    """What an incremental write of one rank gave: each row's chunks, in layout order, and the data files they
    name with their sizes (this rank's own file, and every referenced file)."""
    chunks: list[list[Chunk]]
    files: dict[str, int]


def write_incremental(storage: Storage, layout: FileLayout, staged: torch.Tensor | None, base: Base,
                      block_bytes: int | None = None) -> IncrementalWrite:
    """Write rank's payloads (from the staged image, or from the live payloads when ``staged`` is None), each
    block that ``base`` holds unchanged referenced rather than written (see the module's docstring)."""
    block_bytes = block_size(block_bytes)
    rows: queue.Queue[list[_Row] | BaseException | None] = queue.Queue(maxsize=4)
    hasher = threading.Thread(target=_hash_rows, args=(layout, staged, base, block_bytes, rows),
                              name="ppe-snapshot-block-hashes", daemon=True)
    hasher.start()
    writer = storage.open_writer(layout.file)
    appender = PayloadAppender(writer, layout.file)
    result = IncrementalWrite([], {})
    kept: dict[str, Kept] = {}  # per base file: the offsets and sizes of the chunks referenced there
    add, by_content = result.chunks.append, base.by_content
    try:
        while (batch := rows.get()) is not None:
            if isinstance(batch, BaseException):
                raise batch
            for row in batch:
                chunks: list[Chunk] = []
                for index, ((start, n), checksum) in enumerate(zip(row.cuts, row.digests)):
                    same = row.base[index] if row.base is not None and index < len(row.base) else None
                    if same is None or same.checksum != checksum or same.nbytes != n:
                        same = by_content.get((n, checksum))
                    if same is not None and n:
                        chunks.append(same)
                        offsets, sizes = kept.get(same.file) or kept.setdefault(same.file, ([], []))
                        offsets.append(same.offset)
                        sizes.append(n)
                    else:
                        chunks += _written(appender, row.view[start:start + n], checksum, block_bytes)
                add(chunks)
        referenced = set(kept) - copy_sparse_references(storage, appender, result.chunks, kept, base.sizes)
        size = align(appender.position)
        appender.finish(size)
        writer.close()
    except BaseException:
        writer.abort()
        _drain(rows, hasher)
        raise
    hasher.join()
    result.files = {layout.file: size, **{name: base.sizes[name] for name in sorted(referenced)}}
    return result


def _written(appender: PayloadAppender, view: memoryview, checksum: str, block_bytes: int) -> list[Chunk]:
    """A changed block appended; one of a base's larger chunks (a base of larger blocks) is cut into blocks of
    ``block_bytes``, so that the next take compares it finely."""
    if view.nbytes <= block_bytes:
        return [appender.append_hashed(view, checksum)]
    digest = xxhash.xxh3_64_hexdigest
    return [appender.append_hashed(view[s:s + block_bytes], digest(view[s:s + block_bytes]))
            for s in range(0, view.nbytes, block_bytes)]


def _drain(rows: "queue.Queue[Any]", hasher: threading.Thread) -> None:
    """Let the hashing thread end after a failed write (it may be blocked on a full queue)."""
    while hasher.is_alive():
        try:
            rows.get(timeout=0.1)
        except queue.Empty:
            pass
