"""What an incremental snapshot reads of other snapshots' data files: the distinct chunks it names there.

A referenced file is kept whole on disk, but a snapshot reads only its chunks in it (``ppe-snapshot ls`` and
``inspect`` show those bytes), and a self-contained copy (``upgrade_snapshot``) copies only them.
"""
from __future__ import annotations

from collections.abc import Iterator
from itertools import chain
from typing import Any

import numpy as np

from ppe_snapshot.engine._files import align, coalesced, read_file_into
from ppe_snapshot.engine._format import Manifest, ShardedTensorEntry
from ppe_snapshot.storage import Storage, split_reference

#: A referenced file's distinct chunks: their offsets (ascending) and sizes.
Spans = tuple[np.ndarray, np.ndarray]


def referenced_spans(manifest: Manifest) -> dict[str, Spans]:
    """Per data file of another snapshot that ``manifest`` names, the distinct chunks it reads there (from the
    index files' chunk columns: no entry object per tensor)."""
    if not manifest.references:
        return {}
    found: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for table in chain(manifest.ranks, (manifest.replicated,)):  # (one at a time; shards' chunks are in the columns)
        for name, offsets, sizes in _table_spans(table):
            found.setdefault(name, []).append((offsets, sizes))
    spans = {}
    for name, parts in found.items():
        offsets, first = np.unique(np.concatenate([o for o, _ in parts]), return_index=True)
        spans[name] = (offsets, np.concatenate([n for _, n in parts])[first])
    return spans


def referenced_bytes(manifest: Manifest) -> int:
    """The bytes of other snapshots' data files that ``manifest`` reads (0 for a self-contained snapshot)."""
    return sum(int(sizes.sum()) for _, sizes in referenced_spans(manifest).values())


def _table_spans(table: Any) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """``(file, offsets, sizes)`` of the referenced chunks of one index file's table (its columns hold every
    tensor's and shard's chunks; its other entries are decoded)."""
    index = table.table.index
    cols = index.cols
    for fid, name in enumerate(index.file_names):
        if split_reference(name) is not None:
            rows = cols["chunk_file"] == fid
            yield name, cols["chunk_offset"][rows].astype(np.int64), cols["chunk_nbytes"][rows].astype(np.int64)
    for path in index.header["entries"]:
        entry = table.get(path)
        shards = entry.shards if isinstance(entry, ShardedTensorEntry) else ()
        for chunk in [c for s in shards for c in s.chunks] + list(getattr(entry, "chunks", None) or []):
            if split_reference(chunk.file) is not None:
                yield chunk.file, np.array([chunk.offset], np.int64), np.array([chunk.nbytes], np.int64)


def copy_spans(source: Storage, name: str, spans: Spans, dest: Storage, new_name: str) -> tuple[dict[int, int], int]:
    """Copy the chunks ``spans`` of data file ``name`` of ``source`` into file ``new_name`` of ``dest``, one after
    another at offsets aligned as payloads are; where each went (old offset -> new offset) and the new file's
    size. The bytes are copied as they are (a damaged chunk stays damaged: ``verify`` of the copy names it)."""
    pairs = list(zip(spans[0].tolist(), spans[1].tolist()))
    moved, position = {}, 0
    for offset, n in pairs:
        moved[offset], position = position, align(position + n)
    writer = dest.open_writer(new_name, position)
    try:
        written = 0
        for first, stop in coalesced(pairs):
            start = pairs[first][0]
            data = memoryview(bytearray(pairs[stop - 1][0] + pairs[stop - 1][1] - start))
            read_file_into(source, name, start, data)
            views = []
            for offset, n in pairs[first:stop]:
                views += [_zeros(moved[offset] - written), data[offset - start:offset - start + n]]
                written = moved[offset] + n
            writer.write(views)
        writer.write([_zeros(position - written)])
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return moved, position


def _zeros(n: int) -> memoryview:
    return memoryview(bytes(n))
