"""The xxh3_64 checksums of many chunks named by address, in one call that does not hold the GIL.

The Python package xxhash holds the GIL for inputs under 64 KiB, and every chunk of a small tensor is smaller: a
read thread checking the 603 chunks of one run of a 10,000-tensor restore held it for about 0.5 ms, during which
the restore's walk (Python, on the other thread) waited; a background save hashing a staged image of small tensors
takes the GIL from the training loop the same way. :func:`hash_addresses` hashes a whole run in one call of a small
C library (``hash_many.c``, built by ``setup.py`` where a C compiler is found) through ctypes, which releases the
GIL for the call: the hashing runs beside Python code instead of taking turns with it. The hash is the one the
package xxhash computes, by the C function it carries (``XXH3_64bits``, exported by its extension module; else the
system's libxxhash); it is checked against the package on sample inputs before it is used.

A read can hash what it read before it takes the GIL back: :class:`HashesAfterRead` hands the storage the
hashing as its ``AfterRead`` (``Storage.read_scattered_then``; local storage runs both in one native call).

Where the library or the function cannot be had (``NATIVE`` is None), or ``PPE_SNAPSHOT_NATIVE_HASH=0``
(``SETTINGS.native_hash``), the same checksums are computed in Python, with the GIL held.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import pathlib
from typing import Any

import numpy as np
import xxhash

from ppe_snapshot.engine._util import MEMORY
from ppe_snapshot.settings import SETTINGS
from ppe_snapshot.storage import AfterRead

logger = logging.getLogger(__name__)

#: The C library ``setup.py`` builds beside this module.
LIBRARY = pathlib.Path(__file__).with_name("libhash_many.so")
#: Sizes that take each of xxh3_64's code paths (empty, 1-3, 4-8, 9-16, 17-128, 129-240 bytes, then stripes and
#: blocks, with a partial last stripe): the native hash must equal the package's on every one before it is used.
_SAMPLE_SIZES = (0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1023, 1024, 6708, 65535, 65536, 100003)


def _xxh3_function() -> int | None:
    """The address of the C function ``XXH3_64bits``: from the package xxhash's extension module, else from the
    system's libxxhash; None where neither has it."""
    places = (lambda: getattr(getattr(xxhash, "_xxhash", None), "__file__", None),
              lambda: ctypes.util.find_library("xxhash"))  # (asked only if needed: it runs ldconfig)
    for place in places:
        name = place()
        if not name:
            continue
        try:
            function = ctypes.CDLL(name).XXH3_64bits
        except (OSError, AttributeError):
            continue
        return ctypes.cast(function, ctypes.c_void_p).value
    return None


def _load() -> tuple[Any, int | None]:
    """``ppe_hash_many`` of the C library and the address of ``XXH3_64bits``, where both are found and agree with
    the package on the sample inputs; else ``(None, None)`` (said at debug level: the Python hashing computes the
    same checksums, holding the GIL)."""
    if not LIBRARY.exists():
        return None, None
    function = _xxh3_function()
    if function is None:
        logger.debug("no XXH3_64bits found: chunks are hashed in Python")
        return None, None
    try:
        hash_many = ctypes.CDLL(str(LIBRARY)).ppe_hash_many
    except (OSError, AttributeError) as e:
        logger.debug("%s cannot be loaded (%s): chunks are hashed in Python", LIBRARY, e)
        return None, None
    hash_many.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    hash_many.restype = None
    sample = np.random.default_rng(0).integers(0, 256, sum(_SAMPLE_SIZES), dtype=np.uint8)
    lengths = np.array(_SAMPLE_SIZES, dtype=np.uint64)
    starts = np.concatenate(([0], np.cumsum(lengths[:-1]))).astype(np.uint64)
    addresses = starts + np.uint64(sample.ctypes.data)
    got = np.empty(len(lengths), dtype=np.uint64)
    hash_many(function, addresses.ctypes.data, lengths.ctypes.data, len(got), got.ctypes.data)
    want = [xxhash.xxh3_64_intdigest(sample[s:s + n]) for s, n in zip(starts.tolist(), _SAMPLE_SIZES)]
    if got.tolist() != want:
        logger.warning("%s hashes differently from the package xxhash: chunks are hashed in Python", LIBRARY)
        return None, None
    return hash_many, function


#: ``ppe_hash_many(hash function, addresses, lengths, count, out)`` and the hash function's address: the native
#: hashing (None: chunks are hashed in Python).
NATIVE, XXH3_64BITS = _load()


def _job_function() -> int | None:
    """The address of ``ppe_hash_job`` (``ppe_hash_many`` of a struct of its arguments), where the native hashing
    is loaded."""
    if NATIVE is None:
        return None
    try:
        return ctypes.cast(ctypes.CDLL(str(LIBRARY)).ppe_hash_job, ctypes.c_void_p).value
    except (OSError, AttributeError):  # (a library built before it had one)
        return None


HASH_JOB = _job_function()


class _Job(ctypes.Structure):
    """``struct ppe_hash_job`` of hash_many.c."""
    _fields_ = [("hash", ctypes.c_void_p), ("addresses", ctypes.c_void_p), ("lengths", ctypes.c_void_p),
                ("count", ctypes.c_size_t), ("out", ctypes.c_void_p)]


class HashesAfterRead:
    """The checksums of chunks about to be read, computed by the read itself where it can: ``after_read`` is the
    ``AfterRead`` to hand to ``Storage.read_scattered_then`` (None where the native hashing is off: read with
    ``read_scattered``); :meth:`sums` once the read has returned."""

    def __init__(self, addresses: Any, lengths: Any) -> None:
        self._addresses, self._lengths = _columns(addresses, lengths)
        self._out = np.empty(len(self._addresses), dtype=np.uint64)
        self.after_read: AfterRead | None = None
        if HASH_JOB is not None and SETTINGS.native_hash and len(self._out):
            self._job = _Job(XXH3_64BITS, self._addresses.ctypes.data, self._lengths.ctypes.data, len(self._out),
                             self._out.ctypes.data)
            self.after_read = AfterRead(HASH_JOB, ctypes.addressof(self._job))

    def sums(self) -> np.ndarray:
        """:func:`hash_addresses` of the chunks: computed by the read, else now."""
        return self._out if self.after_read is not None else hash_addresses(self._addresses, self._lengths)


def _columns(addresses: Any, lengths: Any) -> tuple[np.ndarray, np.ndarray]:
    """The addresses and lengths of chunks as the C helper takes them: uint64 arrays of one length."""
    addresses = np.ascontiguousarray(addresses, dtype=np.uint64)
    lengths = np.ascontiguousarray(lengths, dtype=np.uint64)
    if len(addresses) != len(lengths):
        raise ValueError(f"{len(addresses)} addresses and {len(lengths)} lengths")
    return addresses, lengths


def hash_addresses(addresses: Any, lengths: Any) -> np.ndarray:
    """The xxh3_64 of ``lengths[i]`` bytes at address ``addresses[i]`` for each ``i`` (uint64); the memory must
    stay alive and unchanged during the call. Without the GIL where the native hashing was loaded."""
    addresses, lengths = _columns(addresses, lengths)
    out = np.empty(len(addresses), dtype=np.uint64)
    if NATIVE is not None and SETTINGS.native_hash and len(out):
        NATIVE(XXH3_64BITS, addresses.ctypes.data, lengths.ctypes.data, len(out), out.ctypes.data)
        return out
    ends = (addresses + lengths).tolist()
    out[:] = list(map(xxhash.xxh3_64_intdigest, map(MEMORY.__getitem__, map(slice, addresses.tolist(), ends))))
    return out
