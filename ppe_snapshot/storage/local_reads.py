"""Vectored reads of a local file: into buffer objects (``os.preadv``), or into memory named by address (the C
library's ``preadv`` through ctypes, with no Python object per piece: a restore of thousands of small tensors).

Reads by address go through ``preadv_all.c`` where ``setup.py`` built it: every system call a read takes, and the
caller's ``AfterRead``, in one native call (the GIL left once); else a Python loop of ``preadv`` calls.
"""
from __future__ import annotations

import ctypes
import errno
import os
import pathlib
import sys
from typing import Any, Callable, Sequence

import numpy as np

from ppe_snapshot.storage.base import AfterRead

# preadv takes at most this many buffers per call (IOV_MAX on Linux).
_IOV_MAX = 1024


def read_views(fd: int, offset: int, views: Sequence[memoryview], name: Callable[[], str]) -> None:
    """Fill ``views`` in order from the bytes of ``fd`` at ``offset``; EOFError (naming the file ``name()``, asked
    only then) where the file ends first."""
    pending = [v for v in views if v.nbytes]
    first = 0  # pending[first:] is still to fill (a list of 10^5 views: no pop(0))
    while first < len(pending):
        batch = pending[first:first + _IOV_MAX]
        n = os.preadv(fd, batch, offset)
        if n == 0:
            raise EOFError(f"{name()} ends at byte {offset}, expected at least "
                           f"{offset + sum(v.nbytes for v in pending[first:])}")
        offset += n
        for view in batch:  # skip what was filled; keep the rest of a partly filled view
            if n < view.nbytes:
                if n:
                    pending[first] = view[n:]
                break
            n -= view.nbytes
            first += 1


def _libc_preadv() -> Any:
    """The C library's ``preadv`` (which releases the GIL while it reads), where ``struct iovec`` is two 64-bit
    words (a 64-bit Linux); else None."""
    if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    try:
        preadv = ctypes.CDLL(None, use_errno=True).preadv
    except (OSError, AttributeError):
        return None
    preadv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    preadv.restype = ctypes.c_ssize_t
    return preadv


_preadv = _libc_preadv()
#: The C library ``setup.py`` builds beside this module.
READ_ALL_LIBRARY = pathlib.Path(__file__).with_name("libpreadv_all.so")


def _load_read_all() -> Any:
    """``ppe_preadv_all`` of the C library, where it is built and ``preadv`` is at hand; else None (the Python loop
    reads the same bytes)."""
    if _preadv is None or not READ_ALL_LIBRARY.exists():
        return None
    try:
        read_all = ctypes.CDLL(str(READ_ALL_LIBRARY)).ppe_preadv_all
    except (OSError, AttributeError):
        return None
    read_all.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64,
                         ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)]
    read_all.restype = ctypes.c_int
    return read_all


#: ``ppe_preadv_all(preadv, fd, iov, count, offset, then, argument, done)`` (None: the Python loop) and the
#: ``preadv`` it calls.
READ_ALL = _load_read_all()
PREADV_ADDRESS = None if _preadv is None else ctypes.cast(_preadv, ctypes.c_void_p).value


def read_addresses(fd: int, offset: int, iov: np.ndarray, name: Callable[[], str],
                   then: AfterRead | None = None) -> bool:
    """Fill the memory ``iov`` names, a ``(n, 2)`` uint64 array of (address, length) rows, in order from the
    bytes of ``fd`` at ``offset``, then run ``then`` (where given) on this thread; EOFError (naming the file
    ``name()``, asked only on a failure) where the file ends first, and ``then`` is not run. False where this
    system has no such call (nothing was read)."""
    if _preadv is None:
        return False
    if READ_ALL is not None:
        _read_all(fd, offset, np.array(iov, dtype=np.uint64, order="C"), name, then)  # (a copy: the call changes it)
        return True
    iov = np.ascontiguousarray(iov, dtype=np.uint64)
    while len(iov):
        batch = iov[:_IOV_MAX]
        want = int(batch[:, 1].sum())
        n = _preadv(fd, batch.ctypes.data, len(batch), offset)
        if n < 0:
            code = ctypes.get_errno()
            if code == errno.EINTR:
                continue
            raise OSError(code, f"{os.strerror(code)}: reading {name()}")
        if n == 0 and want:
            raise EOFError(f"{name()} ends at byte {offset}, expected at least {offset + int(iov[:, 1].sum())}")
        offset += n
        if n == want:
            iov = iov[len(batch):]
            continue
        # A short read (at most about 2 GiB per call, or a signal): go on from where it stopped, within the
        # piece it stopped in.
        ends = np.cumsum(batch[:, 1])
        done = int(np.searchsorted(ends, n, side="right"))
        iov = iov[done:].copy()
        into = np.uint64(n - (int(ends[done - 1]) if done else 0))
        iov[0, 0] += into
        iov[0, 1] -= into
    if then is not None:
        then()
    return True


def _read_all(fd: int, offset: int, iov: np.ndarray, name: Callable[[], str], then: AfterRead | None) -> None:
    """:func:`read_addresses` in one native call."""
    done, want = ctypes.c_int64(), int(iov[:, 1].sum())
    function, argument = then if then is not None else (None, None)
    code = READ_ALL(PREADV_ADDRESS, fd, iov.ctypes.data, len(iov), offset, function, argument, ctypes.byref(done))
    if code < 0:
        raise EOFError(f"{name()} ends at byte {offset + done.value}, expected at least {offset + want}")
    if code:
        raise OSError(code, f"{os.strerror(code)}: reading {name()}")
