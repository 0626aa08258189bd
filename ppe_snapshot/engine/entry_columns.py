"""The entries a rank's take makes, with its plain tensors in columns: no entry object per tensor.

A take of 10^5 small tensors spent as long making a ``TensorEntry`` and a ``Chunk`` per tensor (and reading
them back into the columns of an index file) as copying and hashing their bytes. :class:`EntryColumns` keeps
the tensors stored in one chunk of the rank's data file as columns, from the written layout to the index
file (``IndexBuilder.add_entries``) and the commit's checks; anything else (containers, values, arrays,
pickles, tensors of several chunks) stays an entry object. As a ``Mapping`` it gives every entry by path,
building a tensor's entry when asked, so the version-1 writer and other readers use it like a dict.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ppe_snapshot.engine.format import Raw
from ppe_snapshot.engine.manifest import Chunk, Entry, LazyEntries, TensorEntry
from ppe_snapshot.engine.serialization import dtype_name


def dtype_key(dtype: torch.dtype | np.dtype) -> tuple[str, str]:
    """The kind and dtype name of a tensor entry for a row's dtype: a torch dtype is a tensor's, a numpy
    dtype an array's."""
    if isinstance(dtype, torch.dtype):
        return Raw.TENSOR, dtype_name(dtype)
    return Raw.NDARRAY, dtype.str


class EntryColumns(LazyEntries):
    """One section's entries: ``objects`` by path, and per tensor row (a tensor or numpy array stored in one
    chunk of data file ``file``) its path, dtype (torch's or numpy's), shape, offset, size and xxh3_64 (an
    int); rows are never replicated."""

    def __init__(self, objects: dict[str, Entry] | None = None, file: str = "") -> None:
        self.objects: dict[str, Entry] = {} if objects is None else objects
        self.file = file
        self.paths: list[str] = []
        self.dtypes: list[torch.dtype | np.dtype] = []
        self.shapes: list[Sequence[int]] = []
        self.offsets: list[int] = []
        self.nbytes: list[int] = []
        self.checksums: list[int] = []
        self._rows: dict[str, int] | None = None

    def add_tensors(self, paths: Sequence[str], dtypes: Sequence[torch.dtype | np.dtype],
                    shapes: Sequence[Sequence[int]], offsets: Sequence[int], nbytes: Sequence[int],
                    checksums: Sequence[int]) -> None:
        """Tensor rows, one per position of the (equally long) columns."""
        self.paths += paths
        self.dtypes += dtypes
        self.shapes += shapes
        self.offsets += offsets
        self.nbytes += nbytes
        self.checksums += checksums
        self._rows = None

    def dtype_keys(self) -> dict[torch.dtype | np.dtype, tuple[str, str]]:
        """The kind and name (see :func:`dtype_key`) of every dtype the rows hold."""
        return {dtype: dtype_key(dtype) for dtype in set(self.dtypes)}

    def end(self) -> int:
        """Where the last byte of any tensor row ends in the data file (0 without rows)."""
        if not self.paths:
            return 0
        return int((np.array(self.offsets, dtype=np.int64) + np.array(self.nbytes, dtype=np.int64)).max())

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
        chunk = Chunk(self.file, self.offsets[row], self.nbytes[row], f"{self.checksums[row]:016x}")
        kind, dtype = dtype_key(self.dtypes[row])
        return TensorEntry(dtype, list(self.shapes[row]), [chunk], kind)

    def __contains__(self, path: object) -> bool:
        return path in self.objects or (isinstance(path, str) and self._row(path) is not None)

    def __iter__(self) -> Iterator[str]:
        yield from self.objects
        yield from self.paths

    def __len__(self) -> int:
        return len(self.objects) + len(self.paths)
