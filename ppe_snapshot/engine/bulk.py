"""Restoring many small tensors of a version-2 snapshot in bulk: no entry object per tensor.

A dict's children that are small plain tensors (up to ``SMALL_BYTES``) stored in one chunk, restored into
existing CPU tensors of the same dtype and shape, are read straight from the index's columns: the walk matches
children to index rows and targets, and each time ``FLUSH_BYTES`` of them are pending hands them to the read
pool, sorted into runs of neighbouring bytes of a file, while it goes on. A run is one vectored read straight
into its targets' memory (the alignment gaps land in a scratch buffer), then every chunk's checksum is
verified in the target: a damaged chunk raises ``CorruptSnapshotError`` naming its path. Runs of tiny chunks
(the mean under ``TINY_BYTES``, where the gaps would outnumber the bytes) are read into a buffer and copied out
after the check instead. Everything else goes the usual way (``loading.leaf_loader``); what a reader must check
(sizes vs shapes, files inside the snapshot) was checked when the index was decoded or is checked here, before
a byte reaches a target.
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
from ppe_snapshot.engine.reads import ReadBatch, mismatch_error, read_file_into, truncated_error
from ppe_snapshot.engine.serialization import torch_dtype
from ppe_snapshot.storage import Storage

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_BYTE = ctypes.c_char
#: Neighbouring chunks share a read as in every batch of reads.
MAX_GAP, MAX_RUN = ReadBatch.MAX_GAP, ReadBatch.MAX_RUN
#: Tensors up to this size are loaded in bulk; larger ones are read straight into their targets.
SMALL_BYTES = 1 << 20
#: The walk hands its picks to the read pool each time this many bytes are pending (reads overlap the walk) ...
FLUSH_BYTES = 4 << 20
#: ... or this many tensors.
FLUSH_COUNT = 16384
#: Runs whose chunks average less than this go through a buffer (one copy each) rather than one iovec each.
TINY_BYTES = 256


class _Source:
    """One index file as the bulk path reads it: per tensor row, ``(torch dtype, shape, bytes, may be a conjugate
    view)`` where it may be loaded in bulk (a single chunk of at most ``SMALL_BYTES``), else None; and the rows
    and target addresses picked but not yet handed to the read pool."""

    def __init__(self, index: Index, owned: bool) -> None:
        self.index = index
        cols = index.cols
        self.rows = index.tensor_rows
        #: Paths of other entries: a rank's own entry of another kind hides a replicated tensor of its path.
        self.others: Mapping[str, Any] = index.header["entries"] if owned else {}
        dtypes = [torch_dtype(name) if kind == "tensor" else None for kind, name in index.header["dtypes"]]
        first = index.tensor_chunk_start
        nbytes = np.zeros(len(first), dtype=np.int64)
        single = cols["tensor_chunk_end"] - first == 1  # a tensor of no chunk (crafted, or empty) stays out
        nbytes[single] = cols["chunk_nbytes"][first[single]]
        eligible = (single & (nbytes <= SMALL_BYTES)).tolist()
        dims, ndims = cols["dims"].tolist(), cols["tensor_ndim"].tolist()
        fits: list[tuple[torch.dtype, tuple[int, ...], int, bool] | None] = []
        position = 0
        for d, n, size, ok in zip(cols["tensor_dtype"].tolist(), ndims, nbytes.tolist(), eligible):
            dtype = dtypes[d]
            fits.append((dtype, tuple(dims[position:position + n]), size, dtype.is_complex)
                        if ok and dtype is not None else None)
            position += n
        self.fits = fits
        self.picked: list[int] = []
        self.pointers: list[int] = []
        self.pending = 0


class BulkTensors:
    """Loads plain tensor children of containers in bulk for a restore of ``rank`` (see the module doc)."""

    def __init__(self, storage: Storage, manifest: Manifest, rank: int, reads: ReadBatch) -> None:
        self._storage, self._manifest, self._rank, self._reads = storage, manifest, rank, reads
        self._sources: list[_Source] | None = None

    def _tables(self) -> list[_Source]:
        if self._sources is None:
            owned = self._rank < self._manifest.world_size
            tables = [(self._manifest.ranks[self._rank], True)] if owned else []
            tables.append((self._manifest.replicated, False))
            self._sources = []
            for table, own in tables:
                table = getattr(table, "table", table)
                if isinstance(table, IndexTable):
                    self._sources.append(_Source(table.index, own))
        return self._sources

    def children(self, path: str, keys: list[Any], template: Any) -> dict[str, torch.Tensor]:
        """The children of the dict at ``path`` (keys as stored) loaded here, by key; reads complete at join."""
        if not isinstance(template, Mapping) or len(keys) < 16:
            return {}
        sources = self._tables()
        if not sources:
            return {}
        get, strided = template.get, torch.strided
        loaded: dict[str, torch.Tensor] = {}
        for key in keys:
            if type(key) is not str:
                continue
            target = get(key)
            if type(target) not in _PLAIN:
                continue
            child = f"{path}/{key}" if "%" not in key and "/" not in key else child_path(path, key)
            for source in sources:
                row = source.rows.get(child)
                if row is not None or child in source.others:
                    break
            if row is None:
                continue
            fit = source.fits[row]
            if fit is None:
                continue
            dtype, shape, nbytes, complex_ = fit
            if target.dtype is not dtype or target.shape != shape or target.layout is not strided \
                    or not target.is_cpu or not target.is_contiguous() or target.is_neg() \
                    or (complex_ and target.is_conj()):
                continue  # the usual path: reads through a buffer, or names the mismatch
            source.picked.append(row)
            source.pointers.append(target.data_ptr())
            source.pending += nbytes
            loaded[key] = target
            if source.pending >= FLUSH_BYTES or len(source.picked) >= FLUSH_COUNT:
                self._submit(source)
        for source in sources:
            if source.picked:
                self._submit(source)
        return loaded

    def _submit(self, source: _Source) -> None:
        """Hand the picked tensors of ``source`` to the read pool, in runs of neighbouring bytes of a file."""
        index, rows, pointers = source.index, np.array(source.picked, dtype=np.int64), source.pointers
        source.picked, source.pointers, source.pending = [], [], 0
        cols = index.cols
        chunk = index.tensor_chunk_start[rows]
        files, offsets = cols["chunk_file"][chunk].astype(np.int64), cols["chunk_offset"][chunk]
        order = np.lexsort((offsets, files))
        files, offsets, nbytes = files[order], offsets[order], cols["chunk_nbytes"][chunk][order]
        checks, rows = cols["chunk_checksum"][chunk][order].tolist(), rows[order].tolist()
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
        names, order_list = index.file_names, order.tolist()
        pointers = [pointers[i] for i in order_list]
        offsets_list, nbytes_list = offsets.tolist(), nbytes.tolist()
        for s, e in bounds:
            run = _Run(self._storage, index, names[int(files[s])], offsets_list[s:e], nbytes_list[s:e], checks[s:e],
                       pointers[s:e], rows[s:e])
            self._reads.submit(self._storage, run.read_buffered if int(ends[e - 1] - offsets[s]) < (e - s) * TINY_BYTES
                               else run.read_direct)


class _Run:
    """Neighbouring chunks of one data file and the target memory each goes to."""

    def __init__(self, storage: Storage, index: Index, file: str, offsets: list[int], nbytes: list[int],
                 checks: list[int], pointers: list[int], rows: list[int]) -> None:
        self.storage, self.index, self.file = storage, index, file
        self.offsets, self.nbytes, self.checks, self.pointers, self.rows = offsets, nbytes, checks, pointers, rows

    def read_direct(self) -> None:
        """One vectored read straight into the targets, then every chunk verified where it landed."""
        targets = [memoryview((_BYTE * n).from_address(p)) for n, p in zip(self.nbytes, self.pointers)]
        views, position, scratch = targets, self.offsets[0], None
        if self.offsets[-1] + self.nbytes[-1] - position != sum(self.nbytes):  # gaps between the chunks
            scratch, views = memoryview(bytearray(MAX_GAP)), []
            for offset, n, target in zip(self.offsets, self.nbytes, targets):
                if offset > position:
                    views.append(scratch[:offset - position])
                views.append(target)
                position = offset + n
        try:
            self.storage.read_vectored(self.file, self.offsets[0], views)
        except (EOFError, FileNotFoundError) as e:
            raise truncated_error(self.storage, self.file, e) from e
        if list(map(xxhash.xxh3_64_intdigest, targets)) != self.checks:
            self._fail([xxhash.xxh3_64_intdigest(t) for t in targets])

    def read_buffered(self) -> None:
        """One read into a buffer; each chunk verified there, then copied into its target."""
        start = self.offsets[0]
        buffer = bytearray(self.offsets[-1] + self.nbytes[-1] - start)  # at most MAX_RUN: bounded by the index
        view = memoryview(buffer)
        read_file_into(self.storage, self.file, start, view)
        pieces = [view[o - start:o - start + n] for o, n in zip(self.offsets, self.nbytes)]
        sums = list(map(xxhash.xxh3_64_intdigest, pieces))
        if sums != self.checks:
            self._fail(sums)
        base, move = ctypes.addressof(ctypes.c_char.from_buffer(buffer)), ctypes.memmove
        for offset, n, pointer in zip(self.offsets, self.nbytes, self.pointers):
            move(pointer, base + offset - start, n)
        del pieces, view

    def _fail(self, sums: list[int]) -> None:
        i = next(i for i, (got, want) in enumerate(zip(sums, self.checks)) if got != want)
        raise mismatch_error(self.storage, self.file, self.offsets[i], self.nbytes[i],
                             self.index.header["tensors"][self.rows[i]])
