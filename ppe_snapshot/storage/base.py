"""The storage interface the engine writes through.

A :class:`Storage` is rooted at one snapshot directory (a prefix on object
stores); every path it takes is relative to that root and uses ``/``.
"""
from __future__ import annotations

import abc
import contextlib
import ctypes
import os
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np

from ppe_snapshot.errors import CorruptSnapshotError, MissingBaseError


def snapshot_location(path: Any) -> str:
    """``path``, a snapshot's location (a local path or an fsspec URL, as a str or ``os.PathLike``), as a string;
    ``TypeError`` for anything else, ``ValueError`` for an empty one (which would name the current directory)."""
    location = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(location, str):
        raise TypeError(f"a snapshot's path must be a str or os.PathLike (a local path or an fsspec URL), not "
                        f"{type(path).__name__}")
    if location in ("", "file://"):
        raise ValueError("a snapshot's path is empty: name the directory (or URL) the snapshot is, or goes, in")
    return location


def is_safe_relative(name: Any) -> bool:
    """Whether ``name`` is a normalised relative path that stays inside the storage's root.

    Refused: anything but a non-empty string, absolute paths, backslashes, NUL, and empty,
    ``.`` or ``..`` parts (``data//x``, ``./x``, ``../x``).
    """
    return (type(name) is str and name != "" and name[0] != "/" and "\\" not in name and "\0" not in name
            and all(part not in ("", ".", "..") for part in name.split("/")))


class AfterRead(NamedTuple):
    """A C function ``void function(void *argument)`` for :meth:`Storage.read_scattered_then` to run on the reading
    thread once every byte has landed (the engine's checksums of what was read)."""
    function: int  # its address
    argument: int

    def __call__(self) -> None:
        """Run it here, through ctypes (without the GIL)."""
        ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self.function)(self.argument)


#: How a name of an incremental snapshot's data file starts when the bytes lie in another snapshot of the same run
#: directory: ``../<that snapshot's name>/<its file>``.
REFERENCE_PREFIX = "../"


def split_reference(name: Any) -> tuple[str, str] | None:
    """``(snapshot name, file in it)`` when ``name`` is a reference to a file of a sibling snapshot
    (``../<sibling>/<normalised relative path>``: exactly one step up, into the run directory, and down again);
    None for anything else."""
    if type(name) is not str or not name.startswith(REFERENCE_PREFIX):
        return None
    sibling, _, rest = name[len(REFERENCE_PREFIX):].partition("/")
    if not is_safe_relative(sibling) or not is_safe_relative(rest):
        return None
    return sibling, rest


def is_readable_name(name: Any) -> bool:
    """Whether a snapshot may name ``name`` as a data file to read: inside it (:func:`is_safe_relative`) or in a
    sibling snapshot of its run directory (:func:`split_reference`)."""
    return is_safe_relative(name) or split_reference(name) is not None


@contextlib.contextmanager
def naming_missing_base(url: str, name: str) -> Iterator[None]:
    """A ``FileNotFoundError`` for ``name``, a file of a sibling snapshot (a reference), becomes
    :class:`MissingBaseError` naming that snapshot; any other passes as it is."""
    try:
        yield
    except FileNotFoundError:
        if split_reference(name) is not None:
            raise _missing_base(url, name) from None
        raise


def _missing_base(url: str, name: str) -> CorruptSnapshotError:
    sibling, _ = split_reference(name) or (name, "")
    return MissingBaseError(
        f"{url} is an incremental snapshot: it reads bytes from {name}, in snapshot {sibling!r} of its run "
        f"directory, which is missing. Restore it inside its run directory with the snapshots it references (copy "
        f"the whole run directory, or write a self-contained copy with `ppe-snapshot convert --to snapshot`)")


class BlobWriter(abc.ABC):
    """A file being written sequentially; durable once :meth:`close` returns."""

    @abc.abstractmethod
    def write(self, buffers: Sequence[memoryview]) -> None:
        """Append ``buffers`` in order; done with them when it returns (the caller reuses them)."""

    @abc.abstractmethod
    def close(self) -> int:
        """Make the file durable (fsync / object closed and its size checked).

        Returns the number of bytes in the file.
        """

    @abc.abstractmethod
    def abort(self) -> None:
        """Give up on the file; it may be left partial or removed."""


class Storage(abc.ABC):
    """Where the bytes of one snapshot go."""

    #: The snapshot location as the user gave it (a path or a URL).
    url: str
    #: Reads the engine keeps in flight on this storage. Two is the best for a cold local disk here: one
    #: reader left it half idle, and four per process (eight for two ranks) made the 4 -> 2 FSDP restore 1.5x
    #: slower. Object stores ask for more (``storage/tuning.py``).
    read_workers: int = 2
    #: Whether reads of a few hundred KiB cost about what one large read costs per byte (a local file):
    #: the engine then reads a large chunk piece by piece and hashes each piece while the CPU's cache holds it,
    #: rather than reading it from memory a second time to hash it.
    small_reads_cheap: bool = False
    #: Whether reads check each chunk of a data file against its checksum. Only a storage over files known to be
    #: unchanged since they were written whole sets False (``UnchangedFiles``, ``unchanged.py``: a local tier's own
    #: part); its reads take the bytes as they are.
    verify_data: bool = True

    @abc.abstractmethod
    def open_writer(self, rel: str, size: int | None = None) -> BlobWriter:
        """Start a new file at ``rel``, replacing any file already there.

        ``size``, when known, lets the storage reserve the space up front.
        """

    @abc.abstractmethod
    def put_atomic(self, rel: str, data: bytes) -> None:
        """Publish ``data`` at ``rel`` all at once: readers see all of it or nothing."""

    @abc.abstractmethod
    def read_bytes(self, rel: str) -> bytes:
        """The whole file; raises ``FileNotFoundError`` when it is absent."""

    @abc.abstractmethod
    def read_into(self, rel: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``; raises ``EOFError`` when the file is shorter."""

    def read_vectored(self, rel: str, offset: int, views: Sequence[memoryview]) -> None:
        """Fill ``views`` in order from the consecutive bytes at ``offset`` (one request for many small reads).

        This default reads the whole range once and copies it out; local storage scatters it directly.
        """
        data = memoryview(bytearray(sum(v.nbytes for v in views)))
        self.read_into(rel, offset, data)
        position = 0
        for view in views:
            view[:] = data[position:position + view.nbytes]
            position += view.nbytes

    def read_scattered(self, rel: str, offset: int, iov: np.ndarray) -> None:
        """Fill the memory ``iov`` names, a ``(n, 2)`` uint64 array of (address, length) rows, in order from the
        consecutive bytes at ``offset``: :meth:`read_vectored` without a buffer object per piece (a restore of
        thousands of small tensors into their own memory). This default makes views of the memory and calls
        :meth:`read_vectored`; local storage hands the array to ``preadv`` as it is."""
        self.read_vectored(rel, offset, [memoryview((ctypes.c_char * int(n)).from_address(int(a))).cast("B")
                                         for a, n in iov.tolist() if n])

    def read_scattered_then(self, rel: str, offset: int, iov: np.ndarray, then: AfterRead) -> None:
        """:meth:`read_scattered`, then ``then()`` on this thread once every byte has landed (not where the read
        fails). Local storage runs both in one native call, which leaves the GIL once: a read thread that left
        it for the read and again for ``then`` waited up to the interpreter's switch interval each time to get it
        back while another thread ran Python."""
        self.read_scattered(rel, offset, iov)
        then()

    @abc.abstractmethod
    def exists(self, rel: str) -> bool:
        """Whether a file exists at ``rel``."""

    @abc.abstractmethod
    def is_file(self, rel: str) -> bool:
        """Whether a file (not a directory) is at ``rel``; ``""``: whether the snapshot's own place is a file.
        False on object stores, where a key and keys under it (a snapshot's) live side by side."""

    @abc.abstractmethod
    def size(self, rel: str) -> int:
        """Size of the file at ``rel`` in bytes."""

    @abc.abstractmethod
    def remove(self, rel: str) -> None:
        """Remove one file; no error when it is already gone."""

    def remove_empty_dir(self, rel: str) -> None:
        """Remove directory ``rel`` if it is empty (a store without directories: nothing to do)."""

    def known_size(self, rel: str) -> int:
        """:meth:`size`, asked once per file for the life of this object (reads check allocations against it)."""
        sizes: dict[str, int] = self.__dict__.setdefault("_known_sizes", {})
        if rel not in sizes:
            sizes[rel] = self.size(rel)
        return sizes[rel]

    def close(self) -> None:
        """Release open handles (cached readers)."""


def forget_listings(fs: Any, path: str) -> None:
    """Drop every directory listing ``fs`` keeps of ``path``, its parents and everything below it, so that the
    next look sees the store as it is now (fsspec's ``invalidate_cache`` drops the path and its parents only;
    gcsfs then still answered ``exists`` under it from a listing made before a snapshot there was complete)."""
    fs.invalidate_cache(path)
    cache = getattr(fs, "dircache", None)
    if cache is None:
        return
    prefix = fs._strip_protocol(path).rstrip("/") + "/"
    for key in [key for key in list(cache) if key.startswith(prefix)]:
        cache.pop(key, None)


def check_stored_size(fs: Any, path: str, written: int) -> int:
    """``written``, once the object store (an fsspec file system) says ``path`` holds that many bytes."""
    fs.invalidate_cache(path)
    stored = fs.size(path)
    if stored != written:
        raise OSError(f"{path}: stored size {stored} differs from the {written} bytes written")
    return written
