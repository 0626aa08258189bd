"""Swap two local directory entries atomically (Linux ``renameat2(RENAME_EXCHANGE)``).

Used to replace a snapshot that keeps its name: the new one is written
beside it, then both names are exchanged in one step, so a crash at any
moment leaves a complete snapshot under the name.
"""
from __future__ import annotations

import ctypes
import errno
import os
import sys

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
#: errno values meaning "this kernel, libc or file system cannot exchange": the caller falls back.
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_FUNCTION = _renameat2()


def swap_entries(first: str, second: str) -> bool:
    """Exchange the entries at two existing local paths in one atomic step.

    Returns False, having changed nothing, when the platform or the file
    system cannot do it; raises ``OSError`` for any other failure.
    """
    if _FUNCTION is None:
        return False
    if _FUNCTION(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, f"cannot exchange {first} and {second}: {os.strerror(code)}")


def sync_directory(path: str) -> None:
    """Make the renames inside directory ``path`` durable (best effort: not every file system can)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
