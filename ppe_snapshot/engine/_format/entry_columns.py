"""The entries a rank's take makes, with its plain tensors in columns: no entry object per tensor.

A take of 10^5 small tensors spent as long making a ``TensorEntry`` and a ``Chunk`` per tensor (and reading
them back into the columns of an index file) as copying and hashing their bytes. :class:`EntryColumns` keeps
the tensors stored in one chunk of the rank's data file as columns, from the written layout to the index
file (``IndexBuilder.add_entries``) and the commit's checks; anything else (containers, values, arrays,
pickles, tensors of several chunks) stays an entry object. As a ``Mapping`` it gives every entry by path,
building a tensor's entry when asked, so the version-1 writer and other readers use it like a dict.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ppe_snapshot.engine._format.manifest import Chunk, Entry, LazyEntries, TensorEntry
from ppe_snapshot.engine._format.names import Raw
from ppe_snapshot.engine._format.serialization import dtype_name

_DIM = torch.Tensor.dim


def dtype_key(dtype: torch.dtype | np.dtype) -> tuple[str, str]:
    """The kind and dtype name of a tensor entry for a row's dtype: a torch dtype is a tensor's, a numpy
    dtype an array's."""
    if isinstance(dtype, torch.dtype):
        return Raw.TENSOR, dtype_name(dtype)
    return Raw.NDARRAY, dtype.str


class ShapeColumns:
    """The shapes of many rows as two integer arrays: per row its number of dimensions (``ndims``), and the
    dimensions of all rows one after another (``dims``), as an index file stores them (``Index.shapes``). No
    tuple per tensor: a take of 10^5 tensors made as many ``torch.Size`` objects, read each back for the index,
    and left them to a collection of the garbage collector (12 ms)."""

    def __init__(self, ndims: np.ndarray | None = None, dims: np.ndarray | None = None) -> None:
        self.ndims = np.zeros(0, dtype=np.int64) if ndims is None else ndims
        self.dims = np.zeros(0, dtype=np.int64) if dims is None else dims
        self._starts: np.ndarray | None = None

    @classmethod
    def of(cls, shapes: Sequence[Sequence[int]]) -> "ShapeColumns":
        return cls(np.fromiter(map(len, shapes), np.int64, len(shapes)),
                   np.fromiter(itertools.chain.from_iterable(shapes), np.int64))

    @classmethod
    def of_tensors(cls, tensors: Sequence[torch.Tensor], nbytes: Sequence[int], dtypes: Sequence[torch.dtype]
                   ) -> "ShapeColumns":
        """The shapes of ``tensors`` (with their sizes in bytes and dtypes): a vector's one dimension is its size
        over its item size, so only tensors of two dimensions or more are asked for their shape."""
        ndims = np.fromiter(map(_DIM, tensors), np.int64, len(tensors))
        dims = np.zeros(int(ndims.sum()), dtype=np.int64)
        shapes = cls(ndims, dims)  # its dims filled in below
        starts = shapes.starts()
        vectors = np.flatnonzero(ndims == 1)
        if len(vectors):
            itemsize = {dtype: dtype.itemsize for dtype in set(dtypes)}
            sizes = np.fromiter(map(itemsize.__getitem__, dtypes), np.int64, len(dtypes))
            dims[starts[vectors]] = np.asarray(nbytes[:len(tensors)], dtype=np.int64)[vectors] // sizes[vectors]
        higher = np.flatnonzero(ndims > 1)
        if len(higher):
            counts = ndims[higher]
            within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            dims[np.repeat(starts[higher], counts) + within] = np.fromiter(
                itertools.chain.from_iterable(tensors[i].shape for i in higher.tolist()), np.int64)
        return shapes

    def __len__(self) -> int:
        return len(self.ndims)

    def __add__(self, other: "ShapeColumns") -> "ShapeColumns":
        return ShapeColumns(np.concatenate((self.ndims, other.ndims)), np.concatenate((self.dims, other.dims)))

    def starts(self) -> np.ndarray:
        """Where each row's dimensions start in ``dims``."""
        if self._starts is None:
            self._starts = np.cumsum(self.ndims, dtype=np.int64) - self.ndims
        return self._starts

    def shape(self, row: int) -> list[int]:
        start = int(self.starts()[row])
        return self.dims[start:start + int(self.ndims[row])].tolist()

    def tuples(self) -> list[tuple[int, ...]]:
        """Every row's shape as a tuple (grouped by number of dimensions: no Python loop per row)."""
        rows = len(self.ndims)
        if rows and len(self.dims) == rows * int(self.ndims[0]) and (self.ndims == self.ndims[0]).all():
            # one number of dimensions (a model's state often): the columns zipped, 3x faster than the general way
            return list(zip(*self.dims.reshape(rows, -1).T.tolist())) if self.ndims[0] else [()] * rows
        shapes = np.empty(len(self.ndims), dtype=object)
        left = np.ones(len(self.ndims), dtype=bool)
        while left.any():  # once per number of dimensions (np.unique: a lazy import of 10 ms on its first call)
            ndim = int(self.ndims[np.argmax(left)])
            rows = np.flatnonzero(self.ndims == ndim)
            left[rows] = False
            block = self.dims[self.starts()[rows][:, None] + np.arange(ndim)].tolist()
            shapes[rows] = np.fromiter(map(tuple, block), dtype=object, count=len(rows))
        return shapes.tolist()

    def take(self, rows: Sequence[int]) -> "ShapeColumns":
        """The shapes of ``rows``, in that order (no Python loop per row)."""
        picked = np.asarray(rows, dtype=np.int64)
        ndims = self.ndims[picked]
        within = np.arange(int(ndims.sum())) - np.repeat(np.cumsum(ndims) - ndims, ndims)
        return ShapeColumns(ndims, self.dims[np.repeat(self.starts()[picked], ndims) + within])

    def __reduce__(self) -> tuple:
        return ShapeColumns, (self.ndims, self.dims)


class EntryColumns(LazyEntries):
    """One section's entries: ``objects`` by path, and per tensor row (a tensor or numpy array stored in one
    chunk of data file ``file``) its path, dtype (torch's or numpy's), shape (:class:`ShapeColumns`), offset,
    size and xxh3_64 (the last three int64 / uint64 arrays, as the index file takes them); rows are never
    replicated."""

    def __init__(self, objects: dict[str, Entry] | None = None, file: str = "") -> None:
        self.objects: dict[str, Entry] = {} if objects is None else objects
        self.file = file
        self.paths: list[str] = []
        self.dtypes: list[torch.dtype | np.dtype] = []
        self.shapes = ShapeColumns()
        self.offsets = np.zeros(0, dtype=np.int64)
        self.nbytes = np.zeros(0, dtype=np.int64)
        self.checksums = np.zeros(0, dtype=np.uint64)
        self._rows: dict[str, int] | None = None

    def add_tensors(self, paths: Sequence[str], dtypes: Sequence[torch.dtype | np.dtype], shapes: ShapeColumns,
                    offsets: Sequence[int], nbytes: Sequence[int], checksums: Sequence[int]) -> None:
        """Tensor rows, one per position of the (equally long) columns."""
        self.paths += paths
        self.dtypes += dtypes
        self.shapes = self.shapes + shapes if len(self.shapes) else shapes
        self.offsets = np.concatenate((self.offsets, np.asarray(offsets, dtype=np.int64)))
        self.nbytes = np.concatenate((self.nbytes, np.asarray(nbytes, dtype=np.int64)))
        self.checksums = np.concatenate((self.checksums, np.asarray(checksums, dtype=np.uint64)))
        self._rows = None

    def dtype_keys(self) -> dict[torch.dtype | np.dtype, tuple[str, str]]:
        """The kind and name (see :func:`dtype_key`) of every dtype the rows hold."""
        return {dtype: dtype_key(dtype) for dtype in set(self.dtypes)}

    def end(self) -> int:
        """Where the last byte of any tensor row ends in the data file (0 without rows)."""
        return int((self.offsets + self.nbytes).max()) if self.paths else 0

    def path_set(self) -> set[str]:
        """Every path, as a set (for many membership tests: ``in`` on the mapping costs a method call each)."""
        return {*self.objects, *self.paths}

    def _row(self, path: str) -> int | None:
        if self._rows is None:
            self._rows = dict(zip(self.paths, range(len(self.paths))))
        return self._rows.get(path)

    def get(self, path: str, default: Any = None) -> Any:  # type: ignore[override]
        entry = self.objects.get(path)
        if entry is not None:
            return entry
        row = self._row(path)
        if row is None:
            return default
        chunk = Chunk(self.file, int(self.offsets[row]), int(self.nbytes[row]), f"{int(self.checksums[row]):016x}")
        kind, dtype = dtype_key(self.dtypes[row])
        return TensorEntry(dtype, self.shapes.shape(row), [chunk], kind)

    def __contains__(self, path: object) -> bool:
        return path in self.objects or (isinstance(path, str) and self._row(path) is not None)

    def __iter__(self) -> Iterator[str]:
        yield from self.objects
        yield from self.paths

    def __len__(self) -> int:
        return len(self.objects) + len(self.paths)
