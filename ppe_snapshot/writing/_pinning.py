"""Page-locking host memory that CUDA did not allocate: the ProcessWriter's shared staging buffers.

Two rules keep this from breaking the training loop:

* a registered range is unregistered before its memory is let go (at shutdown, or when the owner is collected),
  else a later buffer mapped at the same addresses cannot be registered (``cudaErrorHostMemoryAlreadyRegistered``);
* a registration that fails leaves its error as the thread's CUDA "last error", which the next kernel launch
  would raise as its own (seen on an H200: ``p.add_(1)`` failed with "part or all of the requested memory range
  is already mapped"), so the error is read back and cleared.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import weakref

import torch

logger = logging.getLogger(__name__)


class HostRegistrations:
    """The buffers one owner page-locked with ``cudaHostRegister``, held until they are unregistered."""

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}  # by address; holding them keeps their memory mapped
        finalizer = weakref.finalize(self, _unregister_all, self._buffers)
        finalizer.atexit = False  # the process ends: nothing to give back

    def register(self, buffer: torch.Tensor) -> bool:
        """Page-lock ``buffer``; False (with a warning) where CUDA refuses: the buffer still works, only slower."""
        if not torch.cuda.is_available() or buffer.numel() == 0:
            return False
        try:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.nbytes, 0))
        except Exception as e:
            clear_last_error()
            logger.warning("could not page-lock the shared staging buffer (device-to-host copies into it run "
                           "slower): %s", e)
            return False
        self._buffers[buffer.data_ptr()] = buffer
        return True

    def unregister(self, buffer: torch.Tensor) -> None:
        """Undo :meth:`register` (nothing if ``buffer`` was not registered here)."""
        if self._buffers.pop(buffer.data_ptr(), None) is not None:
            _unregister(buffer)

    def clear(self) -> None:
        """Unregister every buffer."""
        _unregister_all(self._buffers)


def _unregister_all(buffers: dict[int, torch.Tensor]) -> None:
    while buffers:
        _unregister(buffers.popitem()[1])


def _unregister(buffer: torch.Tensor) -> None:
    try:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))
    except Exception as e:  # the memory stays locked until the process ends: nothing is lost
        clear_last_error()
        logger.warning("could not unregister a page-locked staging buffer: %s", e)


def clear_last_error() -> None:
    """Reset the calling thread's CUDA runtime "last error" (``cudaGetLastError`` reads and resets it): torch
    binds no call that does."""
    get_last_error = _cuda_get_last_error()
    if get_last_error is not None:
        get_last_error()


@functools.cache
def _cuda_get_last_error():
    """``cudaGetLastError`` of the CUDA runtime that torch loaded (found in this process's mappings), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
        for path in sorted(paths):
            return ctypes.CDLL(path).cudaGetLastError
        return ctypes.CDLL(None).cudaGetLastError  # a runtime linked into torch itself
    except (OSError, AttributeError) as e:
        logger.warning("cannot reach the CUDA runtime to clear an error (%s): the next CUDA call may report it", e)
        return None
