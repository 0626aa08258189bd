"""Restores into tensors on a device (a GPU), pipelined: stored bytes are read into a few page-locked host
buffers, and each buffer is copied to the device asynchronously while the next one is read.

Without it each device tensor was read into a host buffer of its own, then copied, one after the other: the disk
or the page cache idle during every copy, and a launch and a read per tensor. Here a restore walks the saved
entries as before and hands each device target to :class:`DeviceReads`, which packs the targets' bytes (whole
chunks, so each is verified against its checksum on the host) into buffers of ``DEVICE_BUFFER_BYTES``:

- a buffer holding one piece of one tensor is copied straight into it (a large tensor takes several buffers);
- a buffer holding several tensors (small ones) is copied to the device in one transfer, into a device buffer of
  its size, and from there into the targets with one ``torch._foreach_copy_`` (a few kernels, not one launch and
  one transfer per tensor).

The buffers are read on a read pool of the storage (:class:`~ppe_snapshot.engine._files.reads.ReadBatch`), with at
least ``DEVICE_READ_WORKERS`` reads in flight where the cores allow, while others are on their way to the device. A
buffer is used again only after
the copy out of it ended (a CUDA event). Host memory: ``DEVICE_BUFFERS`` buffers (page-locked where the device is
a CUDA one and pinning works, else plain); device memory: one device buffer per buffer of several tensors in
flight. Nothing is device-specific but the events and the pinning: on any other device, copies are synchronous;
the tests use CPU tensors standing in for device ones.
"""
from __future__ import annotations

import logging
import os
import queue
from dataclasses import dataclass, field
from typing import Any

import torch

from ppe_snapshot.engine._files.packing import align
from ppe_snapshot.engine._files.reads import ReadBatch, read_into, tensor_bytes
from ppe_snapshot.engine._format import Chunk
from ppe_snapshot.storage import Storage

logger = logging.getLogger(__name__)

#: Bytes of one host buffer between the storage and the device. A chunk larger than this is not read here (the
#: caller reads its tensor the usual way, through a host buffer of its own).
DEVICE_BUFFER_BYTES = 16 << 20
#: Host buffers in flight: up to ``DEVICE_READ_WORKERS`` being read while the others are copied to the device.
DEVICE_BUFFERS = 6
#: Reads in flight into those buffers, at least (never more than the cores; object stores keep their own, larger
#: count). Each read thread also hashes what it read and starts its copy to the device, so a local disk's two reads
#: left the page cache half used: a warm restore of 4 GiB into an H200 took 0.64 s with two, 0.38 s with four and
#: 0.40 s with eight (medians of 3; the page-cache read alone 0.38 s; benchmarks/RESULTS.md, issue 35).
DEVICE_READ_WORKERS = 4


@dataclass
class _Piece:
    """Bytes ``[start, start + nbytes)`` of ``target`` (flat), stored as ``chunks``, at ``offset`` of a buffer."""
    target: torch.Tensor
    start: int
    nbytes: int
    chunks: list[Chunk]
    offset: int
    what: str


@dataclass
class _Batch:
    """The pieces that share one host buffer: all of one storage and one device."""
    storage: Storage
    device: torch.device
    pieces: list[_Piece] = field(default_factory=list)
    nbytes: int = 0


def _device_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as a flat uint8 tensor on its device (no copy)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


class DeviceReads:
    """Reads into device tensors through page-locked host buffers, copied to the device while the next are read;
    complete after :meth:`join`. Reads and copies run on ``reads``' pool; ``join`` that batch first."""

    def __init__(self, reads: ReadBatch, buffer_bytes: int | None = None, buffers: int | None = None) -> None:
        self._reads = reads
        self._buffer_bytes = DEVICE_BUFFER_BYTES if buffer_bytes is None else buffer_bytes
        self._count = DEVICE_BUFFERS if buffers is None else buffers
        self._free: queue.Queue[tuple[torch.Tensor, Any]] = queue.Queue()
        self._made = 0  # host buffers allocated so far (at most ``buffers``)
        self._batch: _Batch | None = None
        self._devices: set[torch.device] = set()

    def add(self, storage: Storage, chunks: list[Chunk], target: torch.Tensor, what: str) -> bool:
        """Read ``chunks`` (the whole of ``target``'s bytes) into ``target``, a contiguous tensor; False where it
        cannot be read here (not contiguous, a conjugate or negative view, or a chunk larger than a buffer), for
        the caller to read it another way."""
        if not target.is_contiguous() or target.is_neg() or (target.dtype.is_complex and target.is_conj()) \
                or any(chunk.nbytes > self._buffer_bytes for chunk in chunks):
            return False
        start, group, group_bytes = 0, [], 0
        for chunk in chunks:
            if group and group_bytes + chunk.nbytes > self._buffer_bytes:
                self._place(storage, target, start, group_bytes, group, what)
                start, group, group_bytes = start + group_bytes, [], 0
            group.append(chunk)
            group_bytes += chunk.nbytes
        if group_bytes:
            self._place(storage, target, start, group_bytes, group, what)
        return True

    def _place(self, storage: Storage, target: torch.Tensor, start: int, nbytes: int, chunks: list[Chunk],
               what: str) -> None:
        batch = self._batch
        if batch is not None and (batch.storage is not storage or batch.device != target.device
                                  or align(batch.nbytes) + nbytes > self._buffer_bytes):
            self._dispatch()
            batch = None
        if batch is None:
            batch = self._batch = _Batch(storage, target.device)
        offset = align(batch.nbytes)
        batch.pieces.append(_Piece(target, start, nbytes, chunks, offset, what))
        batch.nbytes = offset + nbytes

    def _dispatch(self) -> None:
        """Hand the batch being packed to the read pool, in a free host buffer (waiting for one)."""
        batch, self._batch = self._batch, None
        if batch is None:
            return
        if batch.device.type == "cuda" and batch.device not in self._devices:
            # Work queued on the targets before the restore ends before the copies into them begin (the copies
            # go on the device's default stream, from the read threads).
            torch.cuda.current_stream(batch.device).synchronize()
        self._devices.add(batch.device)
        host = self._host_buffer(batch.device)
        try:
            self._reads.submit(batch.storage, self._read_and_copy, batch, host, workers=read_workers(batch.storage))
        except BaseException:
            self._free.put((host, None))  # (a later batch must not wait for it)
            raise

    def _host_buffer(self, device: torch.device) -> torch.Tensor:
        if self._made < self._count:
            self._made += 1
            return host_buffer(self._buffer_bytes, device.type == "cuda")
        host, copied = self._free.get()
        if copied is not None:
            copied.synchronize()  # the copy out of it has ended
        return host

    def _read_and_copy(self, batch: _Batch, host: torch.Tensor) -> None:
        """On a read thread: the batch's chunks into ``host`` (each verified), then copied to the device."""
        copied = None
        try:
            view = tensor_bytes(host)
            for piece in batch.pieces:
                read_into(batch.storage, piece.chunks, view[piece.offset:piece.offset + piece.nbytes], piece.what)
            with torch.no_grad():
                copied = _to_device(batch, host)
        finally:
            self._free.put((host, copied))

    def join(self) -> None:
        """Hand over what is still being packed, wait for the reads (``reads.join()``) and for every copy."""
        self._dispatch()
        self._reads.join()
        for device in self._devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)


def read_workers(storage: Storage) -> int:
    """Reads in flight into device buffers on ``storage``: its own count, raised to ``DEVICE_READ_WORKERS`` where
    the machine has the cores."""
    return max(storage.read_workers, min(DEVICE_READ_WORKERS, os.cpu_count() or 1))


def _to_device(batch: _Batch, host: torch.Tensor) -> Any:
    """Copy a read buffer into its targets: one transfer, then one gathered copy on the device where it holds
    several pieces. Returns the CUDA event that marks the end of the transfer out of ``host`` (None elsewhere:
    the copy was synchronous)."""
    cuda = batch.device.type == "cuda"
    pieces = batch.pieces
    if len(pieces) == 1:
        piece = pieces[0]
        _device_bytes(piece.target)[piece.start:piece.start + piece.nbytes].copy_(
            host[piece.offset:piece.offset + piece.nbytes], non_blocking=cuda)
    else:
        staged = torch.empty(batch.nbytes, dtype=torch.uint8, device=batch.device)
        staged.copy_(host[:batch.nbytes], non_blocking=cuda)
        torch._foreach_copy_([_device_bytes(p.target)[p.start:p.start + p.nbytes] for p in pieces],
                             [staged[p.offset:p.offset + p.nbytes] for p in pieces])
    if not cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(batch.device))
    return event


_pinning_failed = False


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A host buffer for reads on their way to a device: page-locked if ``pin`` and the system allows it, else
    plain (slower copies, the same bytes; said once per process)."""
    global _pinning_failed
    if pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as e:
            if not _pinning_failed:
                _pinning_failed = True
                logger.warning("restoring into a GPU through plain host memory: page-locking %d bytes failed (%s)",
                               nbytes, e)
    return torch.empty(nbytes, dtype=torch.uint8)
