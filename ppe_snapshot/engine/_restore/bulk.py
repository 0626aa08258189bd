"""Restoring many small tensors of a version-2 snapshot in bulk: no entry object per tensor.

A dict's children that are small plain tensors (up to ``SMALL_BYTES``) stored in one chunk, restored into
existing tensors of the same dtype and shape, are read straight from the index's columns: the walk matches
children to index rows and targets, and each time ``FLUSH_BYTES`` of them are pending (from any number of dicts:
an optimizer's state is a small dict per parameter) hands them to the read pool, sorted into runs of
neighbouring bytes of a file, while it goes on; the rest when the walk ends. A run is one vectored read straight
into its targets' memory (the alignment gaps land in a scratch buffer), then every chunk's checksum is verified
in the target, the run's in one call (unless the storage needs no check, ``Storage.verify_data``): a damaged
chunk raises ``CorruptSnapshotError`` naming its path. Runs of tiny chunks (the mean under ``TINY_BYTES``, where
the gaps would outnumber the bytes) are read into a buffer and copied out after the check instead. Everything else goes
the usual way (``loading.leaf_loader``); what a reader must check (sizes vs shapes, files inside the snapshot)
was checked when the index was decoded or is checked here, before a byte reaches a target. A target on a device
(a GPU) is read into a page-locked host slab instead, copied to the device with the slab's other tensors by the
read that completes the slab (:mod:`~ppe_snapshot.engine._restore.device_slabs`).

The walk and the read threads share the GIL: the walk calls no torch method that releases it (``is_neg``
and ``is_conj`` are asked after the reads, by ``finish``), the copies of tiny chunks keep it (a memoryview
assignment, not ``ctypes.memmove``), and the walk yields it after each hand-off; otherwise each release hands
the GIL over and waits up to the interpreter's switch interval to get it back. A read thread leaves the GIL once
per run where the C helpers are built: the vectored read (every system call it takes) and the run's checksums are
one native call (``Storage.read_scattered_then`` with ``chunk_hashes.HashesAfterRead``); without them, once for
the read and once more for the checksums (the package xxhash would hold the GIL for every chunk under 64 KiB).
"""
from __future__ import annotations

import operator
import time
from collections.abc import Mapping
from itertools import chain, compress
from typing import Any, NamedTuple

import numpy as np
import torch

from ppe_snapshot.engine._files import HashesAfterRead, ReadBatch, mismatch_error, read_addresses_into
from ppe_snapshot.engine._format import PLAIN_TENSOR_TYPES, Index, Manifest, torch_dtype
from ppe_snapshot.engine._restore.device_slabs import DeviceSlabs
from ppe_snapshot.engine._state import child_paths
from ppe_snapshot.engine._util import MEMORY
from ppe_snapshot.engine._versions import version_of
from ppe_snapshot.storage import Storage

#: Neighbouring chunks share a read as in every batch of reads.
MAX_GAP, MAX_RUN = ReadBatch.MAX_GAP, ReadBatch.MAX_RUN
#: Tensors up to this size are loaded in bulk; larger ones are read straight into their targets.
SMALL_BYTES = 1 << 20
#: The walk hands its picks to the read pool each time their bytes, plus ``PER_TENSOR_COST`` each, reach this
#: (the reads overlap the walk).
FLUSH_BYTES = 4 << 20
PER_TENSOR_COST = 256
#: Runs whose chunks average less than this go through a buffer (one copy each) rather than one iovec each:
#: below it, making a view of each target costs more than the copy (measured here: about 2 KiB).
TINY_BYTES = 2048


#: Whether a target's bytes are read straight into its memory (on the host), not through a slab (a C-level getter:
#: a Python function here cost the walk a call per target).
in_host_memory = operator.attrgetter("is_cpu")
#: What the walk checks a target against, by code: (torch dtype, shape, cost).
_Fit = tuple[torch.dtype, tuple[int, ...], int]


class _Lookup:
    """The tensor rows of a restore's index files (its rank's, then the replicated one), as the walk needs them.

    ``codes`` maps a path to a code: a row number plus ``bases[i]`` for the ``i``-th index file (a rank's own
    entries of any kind hide replicated ones of the same path). ``fits[code]`` is ``(torch dtype, shape, cost)``
    for a tensor that may be loaded in bulk (a single chunk of at most ``SMALL_BYTES``), else None; the cost, its
    bytes plus ``PER_TENSOR_COST``, paces the hand-offs to the read pool. The same by code in arrays, for the
    device targets of a hand-off: ``dtypes`` (object), ``nbytes`` and ``flat`` (one dimension). ``complex``:
    whether any tensor of the index files has a complex dtype.
    """

    def __init__(self, indexes: list[Index], owned: bool) -> None:
        self.tables = indexes  # each table's index file, read as columns
        self.bases = np.cumsum([0] + [len(index.tensor_rows) for index in indexes])
        rows = [_fits(index) for index in indexes]
        self.fits: list[_Fit | None] = list(chain.from_iterable(row.fits for row in rows))
        self.dtypes = np.concatenate([np.empty(0, dtype=object), *(row.dtypes for row in rows)])
        self.nbytes = np.concatenate([np.empty(0, dtype=np.int64), *(row.nbytes for row in rows)])
        self.flat = np.concatenate([np.empty(0, dtype=bool), *(row.flat for row in rows)])
        self.complex = any(kind == "tensor" and torch_dtype(name).is_complex
                           for index in indexes for kind, name in index.header["dtypes"])
        if len(indexes) == 1:
            self.codes: dict[str, int] = indexes[0].tensor_rows
            return
        codes: dict[str, int | None] = {}
        for index, base in zip(reversed(indexes), reversed(self.bases[:-1].tolist())):  # the first one wins
            codes.update(index.tensor_rows if not base else {p: r + base for p, r in index.tensor_rows.items()})
            if owned and index is indexes[0]:
                codes.update(dict.fromkeys(index.header["entries"]))
        self.codes = codes  # type: ignore[assignment]


class _Rows(NamedTuple):
    """An index file's tensor rows as ``_Lookup`` holds them: each row's fit, and its torch dtype (None for a numpy
    array), bytes (where it has a fit) and flatness (one dimension) as arrays."""
    fits: list[_Fit | None]
    dtypes: np.ndarray
    nbytes: np.ndarray
    flat: np.ndarray


def _fits(index: Index) -> _Rows:
    cols, first = index.cols, index.tensor_chunk_start
    nbytes = np.zeros(len(first), dtype=np.int64)
    single = cols["tensor_chunk_end"] - first == 1  # a tensor of no chunk (crafted, or empty) stays out
    nbytes[single] = cols["chunk_nbytes"][first[single]]
    dtypes = [torch_dtype(name) if kind == "tensor" else None for kind, name in index.header["dtypes"]]
    row_dtypes = np.array(dtypes + [None], dtype=object)[cols["tensor_dtype"]]
    fits: list[Any] = list(zip(row_dtypes.tolist(), index.shapes.tuples(), (nbytes + PER_TENSOR_COST).tolist()))
    for row in np.flatnonzero(~single | (nbytes > SMALL_BYTES) | np.equal(row_dtypes, None)).tolist():
        fits[row] = None
    return _Rows(fits, row_dtypes, nbytes, index.shapes.ndims == 1)


class BulkTensors:
    """Loads plain tensor children of containers in bulk for a restore of ``rank`` (see the module doc)."""

    def __init__(self, storage: Storage, manifest: Manifest, rank: int, reads: ReadBatch,
                 slabs: DeviceSlabs | None = None) -> None:
        """``slabs``: where device targets are read to (else they go the usual way)."""
        self._storage, self._manifest, self._rank, self._reads, self._slabs = storage, manifest, rank, reads, slabs
        self._lookup: _Lookup | None = None
        self._on_host: list[torch.Tensor] = []  # the targets read straight into (not through a slab)
        self._handed = 0  # how many of them were handed to the read pool
        # Picks not yet handed to the read pool (from any number of dicts: an optimizer's state is a small dict
        # per parameter) and their cost: host targets by code (the targets: ``_on_host[_handed:]``), device targets
        # by code and target (placed in slabs at the hand-off, in one batch).
        self._codes: list[int] = []
        self._device_codes: list[int] = []
        self._device_targets: list[torch.Tensor] = []
        self._pending = 0

    def finish(self) -> None:
        """Once every read is done: the slabs of device targets still open copied to them; a host target with the
        negative or conjugate bit (a view made by ``_neg_view``, ``conj()`` or ``.imag``, or such a view detached)
        shows its memory negated or conjugated, so the bytes read into it are turned round in place, to show the
        saved values. Checked here, not in the walk: ``is_neg`` and ``is_conj`` release the GIL, which costs 10-30
        us each while a read thread runs; and in C-level passes (a loop asking both cost 0.45 us per target)."""
        if self._slabs is not None:
            self._slabs.copy()
        targets = self._on_host  # (one copied from a slab was copied by copy_, which minds the bits)
        for target in compress(targets, map(torch.Tensor.is_neg, targets)):
            target.neg_()
        if targets and self._tables().complex:
            for target in targets:
                if target.dtype.is_complex and target.is_conj():
                    target.conj_physical_()

    def _tables(self) -> _Lookup:
        if self._lookup is None:
            owned = self._rank < self._manifest.world_size
            tables = [self._manifest.ranks[self._rank]] if owned else []
            tables.append(self._manifest.replicated)
            columns = version_of(self._manifest.version).columns
            indexes = [index for index in map(columns, tables) if index is not None]
            self._lookup = _Lookup(indexes, owned and len(indexes) == len(tables))
        return self._lookup

    def children(self, path: str, keys: list[Any], template: Any) -> dict[str, torch.Tensor]:
        """The children of the dict at ``path`` (keys as stored) loaded here, by key; their reads are complete
        after :meth:`flush` and the read pool's join."""
        if type(template) is not dict and not isinstance(template, Mapping):  # (an ABC check costs 1 us)
            return {}
        lookup = self._tables()
        if not lookup.tables:
            return {}
        strided, fits, slabs, on_host = torch.strided, lookup.fits, self._slabs, in_host_memory
        if not set(map(type, keys)) <= {str}:
            keys = [key for key in keys if type(key) is str]
        # (the paths, codes and targets in C-level passes: a model's state is a dict of thousands of tensors)
        found = zip(keys, map(template.get, keys), map(lookup.codes.get, child_paths(path, keys)))
        loaded: dict[str, torch.Tensor] = {}
        pending, plain = self._pending, PLAIN_TENSOR_TYPES
        device_cost = -1 if slabs is None else slabs.slab_bytes + PER_TENSOR_COST  # (a larger one: the usual path)
        add_code, add_host, add_device_code, add_device = self._appends()
        for key, target, code in found:
            if code is None or type(target) not in plain or (fit := fits[code]) is None:
                continue
            dtype, shape, cost = fit
            # (no is_neg / is_conj here: they release the GIL, to the read threads for milliseconds; see finish)
            try:
                if target.dtype is not dtype or target.shape != shape or target.layout is not strided \
                        or not target.is_contiguous():
                    continue  # the usual path: reads through a buffer, or names the mismatch
            except RuntimeError:  # a nested tensor of the strided layout has no shape: the usual path names it
                continue
            if on_host(target):
                add_host(target)
                add_code(code)
            elif cost <= device_cost and not target.is_meta:  # (a meta tensor has no memory: the usual path)
                add_device(target)
                add_device_code(code)
            else:
                continue
            loaded[key] = target
            pending += cost
            if pending >= FLUSH_BYTES:
                self._hand_off(lookup)
                pending = 0
                add_code, add_host, add_device_code, add_device = self._appends()
                # Let a read thread take the GIL and start its read now, not 5 ms later (the interpreter's
                # switch interval): on a cold disk the reads then start while the walk goes on (94-96 % of
                # the disk's read instead of 90 % for 5,000 tensors of 40 KB).
                time.sleep(0)
        self._pending = pending
        return loaded

    def flush(self) -> None:
        """Hand the picks still pending to the read pool (before it is joined)."""
        if self._codes or self._device_codes:
            self._hand_off(self._tables())

    def _appends(self) -> tuple[Any, ...]:
        """The ``append`` of each list of pending picks (the walk binds them once per hand-off, not per target)."""
        return self._codes.append, self._on_host.append, self._device_codes.append, self._device_targets.append

    def _hand_off(self, lookup: _Lookup) -> None:
        """Hand the pending picks to the read pool, the device ones placed in slabs first, in one batch; each time
        the slabs reach their bound, the reads handed over so far land and the slabs are copied to the device."""
        on_host, handed = self._on_host, self._handed
        codes = np.array(self._codes, dtype=np.int64)
        pointers = np.fromiter(map(torch.Tensor.data_ptr, on_host[handed:]), dtype=np.uint64,
                               count=len(on_host) - handed)  # (a C-level pass)
        self._handed = len(on_host)
        targets, device_codes = self._device_targets, np.array(self._device_codes, dtype=np.int64)
        self._codes, self._device_codes, self._device_targets = [], [], []
        self._pending = 0
        if not targets:
            self._submit(lookup, codes, pointers)
            return
        assert self._slabs is not None  # (device picks are made only where there are slabs)
        nbytes, dtypes, flat = lookup.nbytes[device_codes], lookup.dtypes[device_codes].tolist(), \
            lookup.flat[device_codes]
        placed = 0
        while True:
            addresses = self._slabs.place_many(targets[placed:], nbytes[placed:], dtypes[placed:], flat[placed:])
            end = placed + len(addresses)
            self._submit(lookup, np.concatenate((codes, device_codes[placed:end])),
                         np.concatenate((pointers, addresses.astype(np.uint64))))
            codes, pointers, placed = codes[:0], pointers[:0], end
            if placed == len(targets):
                return
            self._reads.join()  # (the slabs are at their bound: their reads land, then they go to the device)
            self._slabs.copy()

    def _submit(self, lookup: _Lookup, picked: np.ndarray, addresses: np.ndarray) -> None:
        """Hand picked tensors (codes, and the addresses their bytes go to) to the read pool, in runs of
        neighbouring bytes of a file."""
        if len(lookup.tables) == 1:
            self._submit_rows(lookup.tables[0], picked, addresses)
            return
        which = np.searchsorted(lookup.bases, picked, side="right") - 1
        for number, index in enumerate(lookup.tables):
            mine = which == number
            if mine.any():
                self._submit_rows(index, picked[mine] - lookup.bases[number], addresses[mine])

    def _submit_rows(self, index: Index, rows: np.ndarray, addresses: np.ndarray) -> None:
        cols = index.cols
        chunk = index.tensor_chunk_start[rows]
        files, offsets = cols["chunk_file"][chunk].astype(np.int64), cols["chunk_offset"][chunk]
        order = np.lexsort((offsets, files))
        files, offsets, nbytes = files[order], offsets[order], cols["chunk_nbytes"][chunk][order]
        checks, rows, addresses = cols["chunk_checksum"][chunk][order], rows[order], addresses[order]
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
        for s, e in bounds:
            run = _Run(self._storage, index, names[int(files[s])], offsets[s:e], nbytes[s:e], checks[s:e],
                       addresses[s:e], rows[s:e], self._slabs)
            tiny = int(nbytes[s:e].sum()) < (e - s) * TINY_BYTES
            self._reads.submit(self._storage, run.read_buffered if tiny else run.read_direct)


class _Run:
    """Neighbouring chunks of one data file (offsets, sizes, checksums and index rows: arrays of one length) and the
    address each goes to; ``slabs`` (where device targets are read to) is told what landed, verified."""

    def __init__(self, storage: Storage, index: Index, file: str, offsets: np.ndarray, nbytes: np.ndarray,
                 checks: np.ndarray, addresses: np.ndarray, rows: np.ndarray, slabs: DeviceSlabs | None) -> None:
        self.storage, self.index, self.file, self.slabs = storage, index, file, slabs
        self.offsets, self.nbytes, self.checks, self.addresses, self.rows = offsets, nbytes, checks, addresses, rows

    def read_direct(self) -> None:
        """One vectored read straight into the targets, then every chunk verified where it landed."""
        self._read_checked(self.offsets, self.addresses, self.nbytes, self.addresses)
        self._landed()

    def read_buffered(self) -> None:
        """One read into a buffer; each chunk verified there, then copied into its target."""
        start = int(self.offsets[0])
        buffer = np.empty(int(self.offsets[-1] + self.nbytes[-1]) - start, dtype=np.uint8)  # at most about MAX_RUN
        sources = (self.offsets - start).astype(np.uint64) + np.uint64(buffer.ctypes.data)
        self._read_checked([start], [buffer.ctypes.data], [buffer.nbytes], sources)
        for source, address, n in zip(sources.tolist(), self.addresses.tolist(), self.nbytes.tolist()):
            MEMORY[address:address + n] = MEMORY[source:source + n]  # a copy that keeps the GIL: no hand-off per chunk
        self._landed()

    def _read_checked(self, offsets: Any, addresses: Any, sizes: Any, chunks_at: np.ndarray) -> None:
        """``sizes[i]`` bytes of the file at ``offsets[i]`` read to ``addresses[i]`` in one vectored read; then,
        where the storage asks it, every chunk (now at ``chunks_at``) checked, its checksum computed by the read's
        own call where it can (``HashesAfterRead``: the GIL left once)."""
        hashes = HashesAfterRead(chunks_at, self.nbytes) if self.storage.verify_data else None
        read_addresses_into(self.storage, self.file, offsets, addresses, sizes,
                            None if hashes is None else hashes.after_read)
        if hashes is not None:
            self._verify(hashes.sums())

    def _landed(self) -> None:
        if self.slabs is not None:
            self.slabs.landed(self.addresses, self.nbytes)

    def _verify(self, sums: np.ndarray) -> None:
        """Raise for the first chunk whose checksum is not the stored one."""
        wrong = np.flatnonzero(sums != self.checks)
        if len(wrong):
            i = int(wrong[0])
            raise mismatch_error(self.storage, self.file, int(self.offsets[i]), int(self.nbytes[i]),
                                 self.index.header["tensors"][int(self.rows[i])])
