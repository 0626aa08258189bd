"""Restoring many small tensors of a version-2 snapshot in bulk: no entry object per tensor.

A dict's children that are small plain tensors (up to ``SMALL_BYTES``) stored in one chunk, restored into
existing CPU tensors of the same dtype and shape, are read straight from the index's columns: the children
are matched to index rows and targets in one loop, the rows are sorted into runs of neighbouring bytes of a
file, and each run is read into a buffer, every chunk's checksum verified, and copied into its target
(``ctypes.memmove``), on the read pool while the walk goes on. Everything else goes the usual way
(``loading.leaf_loader``); what a reader must check (sizes vs shapes, files inside the snapshot, checksums)
was checked when the index was decoded or is checked here, before a byte reaches a target.
"""
from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import xxhash

from ppe_snapshot.engine.flatten import child_path
from ppe_snapshot.engine.index import Index, IndexTable
from ppe_snapshot.engine.manifest import Manifest
from ppe_snapshot.engine.reads import ReadBatch, mismatch_error, read_file_into
from ppe_snapshot.engine.serialization import torch_dtype
from ppe_snapshot.storage import Storage

_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: Neighbouring chunks share a read as in every batch of reads.
MAX_GAP, MAX_RUN = ReadBatch.MAX_GAP, ReadBatch.MAX_RUN
#: Tensors up to this size are loaded in bulk; larger ones are read straight into their targets.
SMALL_BYTES = 1 << 20


class _Rows:
    """What the bulk path needs of an index, derived once: each tensor's torch dtype (None for arrays and
    multi-chunk tensors), its shape as a tuple, and its chunk's position."""

    def __init__(self, index: Index) -> None:
        cols = index.cols
        dtypes = [torch_dtype(name) if kind == "tensor" else None for kind, name in index.header["dtypes"]]
        starts, ends = index.tensor_chunk_start.tolist(), cols["tensor_chunk_end"].tolist()
        self.dtype = [dtypes[d] if e - s == 1 else None for d, s, e in zip(cols["tensor_dtype"].tolist(), starts,
                                                                              ends)]
        dims, ndims = cols["dims"].tolist(), cols["tensor_ndim"].tolist()
        shapes, position = [], 0
        for n in ndims:
            shapes.append(tuple(dims[position:position + n]))
            position += n
        self.shape = shapes
        self.chunk = starts
        #: Large tensors are read straight into their targets the usual way (no copy through a run buffer).
        first = index.tensor_chunk_start
        single = cols["tensor_chunk_end"] - first == 1  # a tensor of no chunk (crafted, or empty) stays out
        small = np.zeros(len(first), dtype=bool)
        small[single] = cols["chunk_nbytes"][first[single]] <= SMALL_BYTES
        self.small = small.tolist()
        self.rows = index.tensor_rows
        self.others = index.header["entries"]


class BulkTensors:
    """Loads plain tensor children of containers in bulk for a restore of ``rank`` (see the module doc)."""

    def __init__(self, storage: Storage, manifest: Manifest, rank: int, reads: ReadBatch) -> None:
        self._storage, self._manifest, self._rank, self._reads = storage, manifest, rank, reads
        self._sources: list[tuple[Index, _Rows]] | None = None

    def _tables(self) -> list[tuple[Index, _Rows]]:
        if self._sources is None:
            tables = [self._manifest.ranks[self._rank]] if self._rank < self._manifest.world_size else []
            tables.append(self._manifest.replicated)
            self._sources = []
            for table in tables:
                table = getattr(table, "table", table)
                if isinstance(table, IndexTable):
                    self._sources.append((table.index, _Rows(table.index)))
        return self._sources

    def children(self, path: str, keys: list[Any], template: Any) -> dict[str, torch.Tensor]:
        """The children of the dict at ``path`` (keys as stored) loaded here, by key; reads complete at join."""
        if not isinstance(template, Mapping) or len(keys) < 16:
            return {}
        sources = self._tables()
        if not sources:
            return {}
        own = sources[0] if self._rank < self._manifest.world_size else None
        get = template.get
        picked: dict[int, list[tuple[str, int, int]]] = {}
        loaded: dict[str, torch.Tensor] = {}
        for key in keys:
            if type(key) is not str:
                continue
            target = get(key)
            if type(target) not in _PLAIN:
                continue
            child = f"{path}/{key}" if "%" not in key and "/" not in key else child_path(path, key)
            for number, (_, rows) in enumerate(sources):
                row = rows.rows.get(child)
                if row is not None or (own is not None and number == 0 and child in rows.others):
                    break
            if row is None:
                continue
            dtype = rows.dtype[row]
            if dtype is None or not rows.small[row] or target.dtype is not dtype \
                    or target.shape != rows.shape[row] or target.layout is not torch.strided or not target.is_cpu \
                    or not target.is_contiguous():
                continue
            picked.setdefault(number, []).append((child, rows.chunk[row], target.data_ptr()))
            loaded[key] = target
        for number, items in picked.items():
            self._submit(sources[number][0], items)
        return loaded

    def _submit(self, index: Index, items: list[tuple[str, int, int]]) -> None:
        cols = index.cols
        chunk = np.fromiter((c for _, c, _ in items), dtype=np.int64, count=len(items))
        files, offsets = cols["chunk_file"][chunk].astype(np.int64), cols["chunk_offset"][chunk]
        order = np.lexsort((offsets, files))
        files, offsets, nbytes = files[order], offsets[order], cols["chunk_nbytes"][chunk][order]
        checks = cols["chunk_checksum"][chunk][order]
        ends = offsets + nbytes
        brk = np.ones(len(order), dtype=bool)
        brk[1:] = (files[1:] != files[:-1]) | (offsets[1:] - ends[:-1] > MAX_GAP) | (offsets[1:] < ends[:-1])
        starts = np.flatnonzero(brk)
        bounds = []
        for s, e in zip(starts.tolist(), np.append(starts[1:], len(order)).tolist()):
            # runs longer than MAX_RUN are cut at chunk boundaries
            cuts = (s + 1 + np.flatnonzero(np.diff((ends[s:e] - offsets[s]) // MAX_RUN))).tolist()
            edges = [s, *cuts, e]
            bounds += zip(edges[:-1], edges[1:])
        names = index.file_names
        order_list = order.tolist()
        for s, e in bounds:
            run = [items[i] for i in order_list[s:e]]
            self._reads.submit(self._storage, _read_run, self._storage, names[int(files[s])],
                               offsets[s:e].tolist(), nbytes[s:e].tolist(), checks[s:e].tolist(),
                               [(p, ptr) for p, _, ptr in run])


def _read_run(storage: Storage, file: str, offsets: list[int], nbytes: list[int], checks: list[int],
              targets: list[tuple[str, int]]) -> None:
    """One read of neighbouring chunks of ``file``; each chunk verified, then copied into its target."""
    start = offsets[0]
    buffer = bytearray(offsets[-1] + nbytes[-1] - start)
    view = memoryview(buffer)
    read_file_into(storage, file, start, view)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    digest, move = xxhash.xxh3_64_intdigest, ctypes.memmove
    for offset, n, check, (path, pointer) in zip(offsets, nbytes, checks, targets):
        at = offset - start
        if digest(view[at:at + n]) != check:
            raise mismatch_error(storage, file, offset, n, path)
        move(pointer, base + at, n)
    del view
