"""Host memory for staging buffers: private pages a fork leaves alone, shared memory made as such.

Private pages that a fork shares turn copy-on-write, and the next staging
copy would fault on every page (measured here: 0.21 s instead of 0.07 s per
GiB; DataLoader workers fork). Private buffers are therefore marked
``MADV_WIPEONFORK`` (Linux 4.14+): a child gets zero pages in their place and
the parent keeps its own. Where that cannot be had, the buffer is a shared
anonymous mapping, which a fork leaves alone too, but whose first touch costs
more (shared memory faults: 0.53 s against 0.42 s per GiB for the first copy
into a fresh buffer, measured here).

A buffer made ready ahead of a save (:class:`ReadyAhead`) is faulted in by a
thread of low CPU priority, which yields to training; a save that needs it
before that thread is done faults the rest in itself, at its own priority.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

#: This process's memory as one writable byte view: ``MEMORY[p:p + n]`` is the ``n`` bytes at address ``p`` (a
#: tensor's ``data_ptr()``). The view reads nothing by itself; only the ranges of live tensors and buffers are
#: sliced. It moves the bytes of many small tensors: a slice and a slice assignment cost half a
#: ``ctypes.memmove`` call, and no ctypes array per tensor (10^5 tensors: 45 ms against 82 ms, measured here).
MEMORY = memoryview((ctypes.c_char * sys.maxsize).from_address(0)).cast("B")

#: Linux's advice numbers, which Python's mmap module does not name (``MADV_POPULATE_WRITE``: Linux 5.14+).
MADV_WIPEONFORK, MADV_POPULATE_WRITE = 18, 23
#: The nice value of a thread that faults a buffer in ahead of a save. The lowest (19) left a 1 GiB buffer
#: unready after 6 s of a loop keeping both cores of this VM busy (its first save blocked 3.5x a steady one);
#: 10 had it ready within 3 s (1.05x). At a 4-rank restart from the local tier on 2 cores (benchmarks/RESULTS.md,
#: issue 35's ninth session) the own-part restore was unchanged and a lost node's up to 8 % slower.
FAULT_IN_NICE = 10
#: The piece of a buffer that one thread faults in at a time (a save that needs the buffer takes on the rest).
POPULATE_BYTES = 64 << 20

try:
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
    _madvise.argtypes, _madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
except (AttributeError, OSError, TypeError):  # a system without it
    _madvise = None


def new_private_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed, page-aligned buffer of this process, not shared with a forked child."""
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        if not sys.platform.startswith("linux"):
            raise OSError("MADV_WIPEONFORK is Linux's")
        memory.madvise(MADV_WIPEONFORK)
    except OSError:  # an older kernel or another system
        memory.close()
        memory = mmap.mmap(-1, nbytes)  # shared anonymous: a fork does not make it copy-on-write
    return torch.frombuffer(memory, dtype=torch.uint8)  # the tensor keeps the mapping alive


def new_shared_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed buffer in shared memory that ``torch.multiprocessing`` hands to another process without a copy
    (by file descriptor or name, per its sharing strategy).

    Made as shared memory directly: ``torch.zeros(n).share_memory_()`` faults in a private zeroed copy first,
    then copies it (1.2 s per GiB with the first staging copy, against 0.5 s, measured here).
    """
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))


@functools.cache
def can_populate() -> bool:
    """Whether this system faults pages in without writing them (``MADV_POPULATE_WRITE``)."""
    if _madvise is None:
        return False
    page = new_private_buffer(mmap.PAGESIZE)
    return _madvise(page.data_ptr(), mmap.PAGESIZE, MADV_POPULATE_WRITE) == 0


def populate(address: int, nbytes: int) -> None:
    """Fault the pages of ``nbytes`` at ``address`` (page-aligned) in, writable, without writing a byte (see
    :func:`can_populate`): any number of threads may do it, to memory a save fills meanwhile."""
    if nbytes and _madvise(address, nbytes, MADV_POPULATE_WRITE) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"faulting in a staging buffer: {os.strerror(errno)}")


def _lower_priority() -> None:
    """This thread's CPU priority lowered to ``FAULT_IN_NICE`` (Linux: a thread has its own nice value)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), FAULT_IN_NICE)
    except (AttributeError, OSError):  # another system, or a sandbox refusing it: the thread runs as it is
        pass


class ReadyAhead:
    """A host buffer made ready for a save in a background thread: allocated (``allocate()``), then every page
    faulted in at a low CPU priority (``FAULT_IN_NICE``), so that hundreds of MiB yield to training, and at a
    restart to the ranks still restoring, where the cores are busy.

    :meth:`result` gives the buffer with every page in. A save that asks before the thread is done faults in the
    pieces the thread has not reached, at its own priority: waiting for a thread that yields to a busy machine
    could take longer than faulting in a fresh buffer. Where pages cannot be faulted in without writing them
    (:func:`can_populate`), the thread writes them and the save waits for it. ``ready`` is done once the thread
    is (its result the buffer, or the failure to make it).
    """

    def __init__(self, allocate: Callable[[], torch.Tensor], name: str) -> None:
        self.ready: Future[torch.Tensor] = Future()
        self._allocated: Future[torch.Tensor] = Future()
        self._lock = threading.Lock()
        self._next = 0  # where the pieces no thread has taken on begin
        threading.Thread(target=self._make, args=(allocate,), name=name, daemon=True).start()

    @staticmethod
    def _populates(buffer: torch.Tensor) -> bool:
        return can_populate() and buffer.data_ptr() % mmap.PAGESIZE == 0

    def _make(self, allocate: Callable[[], torch.Tensor]) -> None:
        try:
            buffer = allocate()
            self._allocated.set_result(buffer)
            _lower_priority()
            if self._populates(buffer):
                self._populate_rest(buffer)
            elif buffer.numel():
                buffer.numpy()[::mmap.PAGESIZE] = 0
            self.ready.set_result(buffer)
        except BaseException as e:  # noqa: BLE001 - the save allocates as it would have without this
            for future in (self._allocated, self.ready):
                if not future.done():
                    future.set_exception(e)

    def _populate_rest(self, buffer: torch.Tensor) -> None:
        """Fault in the pieces of ``POPULATE_BYTES`` that no thread has taken on yet, one after another."""
        address, nbytes = buffer.data_ptr(), buffer.numel()
        while True:
            with self._lock:
                start = self._next
                if start >= nbytes:
                    return
                self._next = start + POPULATE_BYTES
            populate(address + start, min(POPULATE_BYTES, nbytes - start))

    def result(self) -> torch.Tensor:
        """The buffer, every page faulted in (by this thread too where the background one is not done); raises the
        failure to make it."""
        if not self.ready.done():
            buffer = self._allocated.result()
            if self._populates(buffer):
                self._populate_rest(buffer)
                return buffer
        return self.ready.result()
