"""Staging: the async take's copy of a rank's payloads into a buffer that is the exact image of its data file,
and the write of that image (one sequential pass, checksums hashed beside it). See
:mod:`~ppe_snapshot.engine._files.packing` for the layout.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from ppe_snapshot.engine._files import (
    ALIGNMENT, chunk_limit, FileLayout, Written, checksum, hash_addresses, is_copyable_raw, tensor_bytes,
)
from ppe_snapshot.engine._format import Chunk, Raw
from ppe_snapshot.engine._take.device_gather import DeviceGather, device_rows, gathers, on_device
from ppe_snapshot.engine._util import MEMORY, new_private_buffer
from ppe_snapshot.storage import Storage

PAGE = 4096
#: Staging copies a CPU tensor smaller than this as one slice of ``MEMORY``, a larger one with torch's ``copy_``
#: (on its intra-op threads, which it uses from about this size on).
SMALL_COPY_BYTES = 256 << 10


def new_staging_buffer(size: int, pin: bool = False) -> torch.Tensor:
    """A zeroed, page-aligned host buffer for one rank's file image.

    Page alignment lets O_DIRECT write it as it is. Unpinned buffers are
    private memory that a fork leaves alone (see :mod:`~ppe_snapshot.engine._util.hostmem`):
    a copy-on-write page would fault at the next staging copy.
    """
    if pin and torch.cuda.is_available():
        raw = torch.zeros(size + PAGE, dtype=torch.uint8, pin_memory=True)
        start = -raw.data_ptr() % PAGE
        return raw[start:start + size]
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return new_private_buffer(size)


def clear_padding(layout: FileLayout, buffer: torch.Tensor, skipped: np.ndarray | None = None) -> None:
    """Zero the bytes of ``buffer`` that no payload of ``layout`` will cover (the padding after each): a reused
    buffer holds the previous image there, which would otherwise be written into this snapshot's file.

    Runs of small payloads are zeroed whole, payloads and padding (one memset per run: they are copied over
    right after, so nothing per tensor); a large payload only after its end. ``skipped``: rows (a mask) whose
    slots the caller writes whole, padding included.
    """
    starts = np.asarray(layout.offsets, dtype=np.int64)
    if not len(starts):
        return
    sizes = np.asarray(layout.sizes, dtype=np.int64)
    slot_ends = np.append(starts[1:], layout.size)
    small = sizes < SMALL_COPY_BYTES
    large = ~small
    if skipped is not None:
        small &= ~skipped
        large &= ~skipped
    base = buffer.data_ptr()
    edges = np.flatnonzero(np.diff(np.concatenate(([0], small.view(np.int8), [0]))))
    for first, stop in edges.reshape(-1, 2).tolist():  # slots first .. stop - 1 are small
        ctypes.memset(base + int(starts[first]), 0, int(slot_ends[stop - 1] - starts[first]))
    for end, slot_end in zip((starts + sizes)[large].tolist(), slot_ends[large].tolist()):
        if slot_end > end:
            ctypes.memset(base + end, 0, slot_end - end)


#: A staged tensor's identity: the same bytes wherever two takes of one step find it.
_TensorKey = tuple[str, Any, int, torch.dtype, tuple[int, ...]]


def _key(tensor: torch.Tensor) -> _TensorKey | None:
    if not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg():
        return None
    return tensor.device.type, tensor.device.index, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape)


class StagedImage:
    """Where each tensor of a staged take lies in its staging buffer (see :meth:`TakeJob.stage`): another take of
    the same step copies those tensors from here, in the background, instead of from the live state (so the state
    is copied out of training once). The buffer must hold this image until that take is written.

    The image keeps its tensors alive: a tensor of the first take that was a temporary (an RNG state, say) must
    not free its address for another tensor of the second take, which would then be found here."""

    def __init__(self, layout: FileLayout, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self._at: dict[_TensorKey, tuple[int, int, torch.Tensor]] = {}  # offset, size, the tensor kept
        for data, kind, offset, n in zip(layout.datas(), layout.kinds(), layout.offsets, layout.sizes):
            key = _key(data) if kind == Raw.TENSOR and n else None
            if key is not None:
                self._at[key] = (offset, n, data)

    def view_of(self, tensor: torch.Tensor, nbytes: int) -> torch.Tensor | None:
        """The ``nbytes`` of ``tensor`` in the image, or None where the image does not hold them."""
        key = _key(tensor)
        at = None if key is None else self._at.get(key)
        if at is None or at[1] != nbytes:
            return None
        return self.buffer[at[0]:at[0] + nbytes]


#: Payloads left to copy from another take's staged image: (its bytes there, offset in this image, size).
Deferred = list[tuple[torch.Tensor, int, int]]


def stage(layout: FileLayout, buffer: torch.Tensor, reused: bool = False, image: StagedImage | None = None
          ) -> Deferred:
    """Copy every payload into its place in ``buffer`` (the file image, a contiguous CPU tensor); ``reused``: the
    buffer may hold an earlier image, whose bytes between the payloads are zeroed (:func:`clear_padding`). The
    tensors ``image`` holds are not copied here but returned, for :func:`copy_deferred` (in the background).

    A small CPU tensor is copied as a slice of ``MEMORY`` (about 0.3 us,
    against 8 us for slicing, viewing and ``copy_``: the cost per tensor of a
    state of 10^5 tensors); a large one with ``copy_``, on torch's intra-op threads;
    a small tensor on a device is gathered with its neighbours and copied to the host with them in one transfer
    (:mod:`~ppe_snapshot.engine._take.device_gather`); anything else (see :func:`is_copyable_raw`: device,
    non-contiguous, conjugate or negative views, subclasses) with ``copy_`` too, which resolves it.
    """
    if buffer.dtype != torch.uint8 or not buffer.is_cpu or not buffer.is_contiguous() or buffer.numel() < layout.size:
        raise ValueError(f"a staging buffer must be a contiguous CPU uint8 tensor of at least {layout.size} bytes, "
                         f"got {buffer.dtype} {tuple(buffer.shape)} on {buffer.device}"
                         f"{'' if buffer.is_contiguous() else ', not contiguous'} given to stage into")
    gather = DeviceGather() if on_device(layout) else None
    # A device tensor's slot is left to its stager: the gather writes its runs' slots whole, and a tensor staged
    # another way has its padding zeroed after it (``pad_after``), so a gathered run is not zeroed twice.
    pad_after = reused and gather is not None
    if reused:
        clear_padding(layout, buffer, None if gather is None else device_rows(layout))
    base, cuda, memory, deferred = buffer.data_ptr(), False, MEMORY, []
    rows: Iterator[tuple[Any, str, int, int]] = zip(layout.datas(), layout.kinds(), layout.offsets, layout.sizes)
    if image is not None:  # a separate pass: the loop below costs per tensor what it did without an image
        rows = _not_in(image, rows, deferred, gather, buffer if pad_after else None)
    for data, kind, offset, n in rows:
        if kind == Raw.TENSOR:
            if not n:
                continue
            if gather is not None and gathers(data, n):  # (first: most tensors of a state on a device)
                gather.add(data, offset, n)
                continue
            if n < SMALL_COPY_BYTES and is_copyable_raw(data):
                source, at = data.data_ptr(), base + offset
                memory[at:at + n] = memory[source:source + n]
            else:
                on_cuda = data.is_cuda
                cuda |= on_cuda
                buffer[offset:offset + n].view(data.dtype).view(data.shape).copy_(data, non_blocking=on_cuda)
                if pad_after:
                    _zero_padding(buffer, offset, n)
        elif kind == Raw.NDARRAY:
            region = buffer[offset:offset + n]
            np.copyto(region.numpy().view(data.dtype).reshape(data.shape), data)
        else:
            buffer[offset:offset + n].numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        if gather is not None:
            gather.break_run()
    if gather is not None:
        cuda |= gather.copy_into(buffer)
    if cuda:
        torch.cuda.synchronize()
    return deferred


def _not_in(image: StagedImage, rows: Iterable[tuple[Any, str, int, int]], deferred: Deferred,
            gather: DeviceGather | None, padded: torch.Tensor | None) -> Iterator[tuple[Any, str, int, int]]:
    """The rows whose tensor ``image`` does not hold; those it holds go to ``deferred`` (and cut ``gather``'s
    run: they are copied later). ``padded``: the buffer where a deferred tensor's padding is zeroed."""
    for row in rows:
        data, kind, offset, n = row
        staged = image.view_of(data, n) if kind == Raw.TENSOR and n else None
        if staged is None:
            yield row
        else:
            deferred.append((staged, offset, n))
            if gather is not None:
                gather.break_run()
            if padded is not None:
                _zero_padding(padded, offset, n)


def _zero_padding(buffer: torch.Tensor, offset: int, nbytes: int) -> None:
    """Zero the padding after the payload at ``offset`` of ``nbytes`` (up to the next ``ALIGNMENT``)."""
    if pad := -nbytes % ALIGNMENT:
        ctypes.memset(buffer.data_ptr() + offset + nbytes, 0, pad)


def copy_deferred(buffer: torch.Tensor, deferred: Deferred) -> None:
    """Copy what :func:`stage` deferred into ``buffer``, from the other take's image (a large payload with torch's
    ``copy_``, which lets the training thread run meanwhile)."""
    base, memory = buffer.data_ptr(), MEMORY
    for staged, offset, n in deferred:
        if n < SMALL_COPY_BYTES:
            source, at = staged.data_ptr(), base + offset
            memory[at:at + n] = memory[source:source + n]
        else:
            buffer[offset:offset + n].copy_(staged)


def write_staged(storage: Storage, layout: FileLayout, buffer: torch.Tensor, block_bytes: int | None = None
                 ) -> Written:
    """Write the staged file image in one sequential pass, its payloads in chunks of at most ``block_bytes`` (see
    :data:`Written`).

    The checksums are computed in a second thread while the image is written:
    both only read the buffer, and the hashing hides behind the disk (which
    matters most for a background writer that gets little CPU). The payloads
    of one chunk each (most of them) are hashed in one call that leaves the
    GIL to the training loop (``hash_addresses``).
    """
    image = tensor_bytes(buffer[: layout.size])
    written: Written = []

    def hash_image() -> None:
        add, most = written.append, chunk_limit(block_bytes)
        sizes = np.asarray(layout.sizes, dtype=np.uint64)
        whole = sizes <= most
        addresses = np.asarray(layout.offsets, dtype=np.uint64)[whole] + np.uint64(buffer.data_ptr())
        sums = iter(hash_addresses(addresses, sizes[whole]).tolist())
        for offset, n, one in zip(layout.offsets, layout.sizes, whole.tolist()):
            if one:
                add(next(sums))
            else:
                add([Chunk(layout.file, s, min(most, offset + n - s), checksum(image[s:min(s + most, offset + n)]))
                     for s in range(offset, offset + n, most)])

    hasher = threading.Thread(target=hash_image, name="ppe-snapshot-checksums")
    hasher.start()
    writer = storage.open_writer(layout.file, layout.size)
    try:
        writer.write([image])
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        hasher.join()
    if len(written) != len(layout.paths):  # the hashing thread failed; it printed why
        raise RuntimeError(f"computing the checksums of {layout.file} failed")
    return written
