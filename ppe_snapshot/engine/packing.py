"""Packing payloads into a rank's data file, and writing it.

Each rank writes one file. Payloads sit at offsets aligned to
``ALIGNMENT``; each is cut into chunks of at most ``CHUNK_BYTES`` with an
xxh3_64 checksum each. The same layout serves both ways of writing:

* straight from the live tensors (sync take: no copy of the state), and
* from a staging buffer that is the exact image of the file (async take:
  the caller pays one copy, the background writes one sequential buffer).
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
import xxhash

from ppe_snapshot.engine.flatten import Payload
from ppe_snapshot.engine.format import Raw
from ppe_snapshot.engine.hostmem import new_private_buffer
from ppe_snapshot.engine.manifest import Chunk
from ppe_snapshot.storage import BlobWriter, Storage

ALIGNMENT = 64
CHUNK_BYTES = 64 << 20
#: Largest piece of a non-CPU or non-contiguous tensor copied to host memory at once to be written.
HOST_COPY_BYTES = 64 << 20
PAGE = 4096
#: Staging copies a CPU tensor smaller than this with one memmove, a larger one with torch's ``copy_`` (on its
#: intra-op threads, which it uses from about this size on).
SMALL_COPY_BYTES = 256 << 10
#: A sync take hands the bytes of small payloads to the storage writer in batches of about this size.
WRITE_BATCH_BYTES = 4 << 20
#: Host tensors up to this size are gathered (with their padding) into buffers of ``GATHER_BUFFER_BYTES``.
GATHER_BYTES = 256 << 10
GATHER_BUFFER_BYTES = 4 << 20
_PAD = memoryview(bytes(ALIGNMENT))


def checksum(data: memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


_NUMPY_BYTES = {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                torch.uint8, torch.bool}


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if tensor.dtype in _NUMPY_BYTES and not tensor.requires_grad and tensor.numel():
        return memoryview(tensor.numpy()).cast("B")
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def is_direct(tensor: torch.Tensor) -> bool:
    """Whether a tensor's memory can be written or read as is: on the host, contiguous, and no conjugate or
    negative view (whose memory holds other values than the tensor shows)."""
    return tensor.is_cpu and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def is_copyable_raw(tensor: torch.Tensor) -> bool:
    """Whether a tensor's bytes may be copied straight from its memory (``ctypes.memmove``): a plain tensor (no
    subclass with its own storage semantics) that :func:`is_direct` allows."""
    return type(tensor) in _PLAIN_TENSORS and is_direct(tensor)


@dataclass(slots=True)
class Placement:
    path: str
    payload: Payload
    offset: int
    nbytes: int


@dataclass
class FileLayout:
    file: str
    placements: list[Placement]
    size: int

    def on_cuda(self) -> bool:
        """Whether any payload is a CUDA tensor (staging then wants pinned memory and a synchronize)."""
        return any(p.payload.kind == Raw.TENSOR and p.payload.data.is_cuda for p in self.placements)

    def __reduce__(self) -> tuple:
        """Pickled column by column (a ProcessWriter sends every take's layout to its worker): lists of plain
        values pickle about 5x faster than two objects per payload (0.14 s against 0.5-0.9 s for 10^5)."""
        ps = self.placements
        return _layout_from_columns, (self.file, self.size, [p.path for p in ps], [p.offset for p in ps],
                                      [p.nbytes for p in ps], [p.payload.kind for p in ps],
                                      [p.payload.data for p in ps], [p.payload.replicated for p in ps])


def _layout_from_columns(file: str, size: int, paths: list[str], offsets: list[int], sizes: list[int],
                         kinds: list[str], data: list[Any], replicated: list[bool]) -> FileLayout:
    placements = [Placement(*column) for column in zip(paths, map(Payload, kinds, data, replicated), offsets, sizes)]
    return FileLayout(file, placements, size)


def lay_out(file: str, payloads: list[tuple[str, Payload]]) -> FileLayout:
    placements, offset, mask = [], 0, ALIGNMENT - 1
    for path, payload in payloads:
        n = payload.data.nbytes if payload.kind == Raw.TENSOR else payload.nbytes
        placements.append(Placement(path, payload, offset, n))
        offset = (offset + n + mask) & ~mask  # align()
    return FileLayout(file, placements, offset)


def needs_bounce(payload: Payload) -> bool:
    """Whether a payload is a tensor that must be copied to host memory to be written (see :func:`is_direct`)."""
    return payload.kind == Raw.TENSOR and not is_direct(payload.data)


def _payload_views(payload: Payload, bounce: torch.Tensor | None, bounced: bool) -> Iterator[memoryview]:
    """The payload's bytes in pieces of at most CHUNK_BYTES; a piece is valid until the next one.
    ``bounced``: a tensor that is copied to host through ``bounce`` first (see :func:`is_direct`)."""
    if bounced:
        yield from _bounced_views(payload.data, bounce)
        return
    if payload.kind == Raw.TENSOR:
        data = tensor_bytes(payload.data)
    elif payload.kind == Raw.NDARRAY:
        data = memoryview(np.ascontiguousarray(payload.data).reshape(-1).view(np.uint8))
    else:  # pickled or raw bytes
        data = memoryview(payload.data)
    for start in range(0, data.nbytes, CHUNK_BYTES):
        yield data[start:start + CHUNK_BYTES]


def row_major_blocks(tensor: torch.Tensor, max_elements: int) -> Iterator[torch.Tensor]:
    """Views that cover ``tensor`` in row-major order, each a run of consecutive elements
    of the flattened tensor, of at most ``max_elements`` elements (or one element)."""
    if tensor.numel() == 0:
        return
    if tensor.dim() == 0 or tensor.numel() <= max_elements:
        yield tensor
        return
    row = tensor[0].numel()
    if row <= max_elements:
        rows = max_elements // row
        for start in range(0, tensor.shape[0], rows):
            yield tensor[start:start + rows]
        return
    for i in range(tensor.shape[0]):
        yield from row_major_blocks(tensor[i], max_elements)


def _bounced_views(tensor: torch.Tensor, bounce: torch.Tensor | None) -> Iterator[memoryview]:
    """Device or non-contiguous tensors: row-major pieces copied through the host buffer ``bounce``."""
    assert bounce is not None
    size = tensor.element_size()
    for block in row_major_blocks(tensor.detach(), bounce.numel() // size):
        host = bounce[: block.numel() * size]
        host.view(tensor.dtype).view(block.shape).copy_(block)
        yield tensor_bytes(host)


def new_bounce(layout: FileLayout) -> torch.Tensor | None:
    """A host buffer for device and non-contiguous tensors, pinned when CUDA is there; None when nothing needs it."""
    device = [p.payload.data for p in layout.placements if needs_bounce(p.payload)]
    if not device:
        return None
    return host_copy_buffer(max(t.numel() * t.element_size() for t in device))


def host_copy_buffer(nbytes: int, reuse: torch.Tensor | None = None) -> torch.Tensor:
    """A host buffer (pinned when CUDA is there) for the pieces of a tensor of ``nbytes`` that must be copied to host
    memory to be written: ``reuse`` when it is big enough, else a new one of at most ``HOST_COPY_BYTES``."""
    need = min(HOST_COPY_BYTES, nbytes)
    if reuse is not None and reuse.numel() >= need:
        return reuse
    return torch.empty(need, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


class PayloadAppender:
    """Appends payloads, straight from their memory, to a data file being written.

    Pads to each payload's offset, checksums every piece, and hands the bytes
    to the storage writer every ``WRITE_BATCH_BYTES``, so the disk writes
    while the next payloads are hashed (at once for a bounced piece, whose
    buffer the next piece reuses). Small tensors in host memory (up to
    ``GATHER_BYTES``) are gathered into one zeroed buffer with their padding
    (``ctypes.memmove``, no Python object per tensor), which is handed over
    whole: 10^5 small tensors make a few writes, not 10^5 pieces.
    """

    def __init__(self, writer: BlobWriter, file: str) -> None:
        self._writer, self._file = writer, file
        self._batch: list[memoryview] = []
        self.position = self._handed_over = 0
        self._gather: memoryview | None = None
        self._gather_start = self._gather_address = 0

    def pad_to(self, offset: int) -> None:
        """Zeros up to ``offset`` (at most ``ALIGNMENT`` bytes ahead)."""
        if self.position < offset:
            if self._gather is not None and offset - self._gather_start <= self._gather.nbytes:
                self.position = offset  # the gathering buffer holds zeros there
                return
            self._end_gather()
            self._batch.append(_PAD[: offset - self.position])
            self.position = offset

    def _end_gather(self) -> None:
        if self._gather is not None:
            self._batch.append(self._gather[: self.position - self._gather_start])
            self._gather = None

    def _append_small(self, pointer: int, nbytes: int) -> Chunk:
        if self._gather is None or self.position + nbytes - self._gather_start > self._gather.nbytes:
            self._end_gather()
            if self.position - self._handed_over >= WRITE_BATCH_BYTES:
                self._hand_over()
            buffer = bytearray(GATHER_BUFFER_BYTES)
            self._gather, self._gather_start = memoryview(buffer), self.position
            self._gather_address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        at = self.position - self._gather_start
        ctypes.memmove(self._gather_address + at, pointer, nbytes)
        chunk = Chunk(self._file, self.position, nbytes, checksum(self._gather[at:at + nbytes]))
        self.position += nbytes
        return chunk

    def append(self, payload: Payload, bounce: torch.Tensor | None) -> list[Chunk]:
        """Write ``payload`` at the current position; its chunks (one empty chunk when it has no bytes)."""
        data = payload.data
        if payload.kind == Raw.TENSOR and data.nbytes <= min(GATHER_BYTES, CHUNK_BYTES) \
                and is_copyable_raw(data):  # CHUNK_BYTES at call time: tests shrink it
            return [self._append_small(data.data_ptr(), data.nbytes)]
        self._end_gather()
        start, bounced, chunks = self.position, needs_bounce(payload), []
        for view in _payload_views(payload, bounce, bounced):
            chunks.append(Chunk(self._file, self.position, view.nbytes, checksum(view)))
            self._batch.append(view)
            self.position += view.nbytes
            if bounced or self.position - self._handed_over >= WRITE_BATCH_BYTES:
                self._hand_over()
        return chunks or [Chunk(self._file, start, 0, checksum(memoryview(b"")))]

    def finish(self, size: int) -> None:
        """Pad to ``size`` and hand over the rest."""
        self.pad_to(size)
        self._end_gather()
        self._hand_over()

    def _hand_over(self) -> None:
        self._writer.write(self._batch)
        self._batch, self._handed_over = [], self.position


def write_from_sources(storage: Storage, layout: FileLayout) -> dict[str, list[Chunk]]:
    """Write the file straight from the payloads' memory; returns each path's chunks."""
    chunks: dict[str, list[Chunk]] = {}
    bounce = new_bounce(layout)
    writer = storage.open_writer(layout.file, layout.size)
    try:
        appender = PayloadAppender(writer, layout.file)
        for p in layout.placements:
            appender.pad_to(p.offset)
            chunks[p.path] = appender.append(p.payload, bounce)
        appender.finish(layout.size)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return chunks


def new_staging_buffer(size: int, pin: bool = False) -> torch.Tensor:
    """A zeroed, page-aligned host buffer for one rank's file image.

    Page alignment lets O_DIRECT write it as it is. Unpinned buffers are
    private memory that a fork leaves alone (see :mod:`~ppe_snapshot.engine.hostmem`):
    a copy-on-write page would fault at the next staging copy.
    """
    if pin and torch.cuda.is_available():
        raw = torch.zeros(size + PAGE, dtype=torch.uint8, pin_memory=True)
        start = -raw.data_ptr() % PAGE
        return raw[start:start + size]
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return new_private_buffer(size)


def stage(layout: FileLayout, buffer: torch.Tensor) -> None:
    """Copy every payload into its place in ``buffer`` (the file image, a contiguous CPU tensor).

    A small CPU tensor is copied with one ``memmove`` (about 1 us, against
    8 us for slicing, viewing and ``copy_``: the cost per tensor of a state of
    10^5 tensors); a large one with ``copy_``, on torch's intra-op threads;
    anything else (see :func:`is_copyable_raw`: device, non-contiguous,
    conjugate or negative views, subclasses) with ``copy_`` too, which
    resolves it.
    """
    if buffer.dtype != torch.uint8 or not buffer.is_cpu or not buffer.is_contiguous() or buffer.numel() < layout.size:
        raise ValueError(f"a staging buffer must be a contiguous CPU uint8 tensor of at least {layout.size} bytes, "
                         f"got {buffer.dtype} {tuple(buffer.shape)} on {buffer.device}"
                         f"{'' if buffer.is_contiguous() else ', not contiguous'}; the staging provider gave it")
    base, cuda = buffer.data_ptr(), False
    for p in layout.placements:
        data, n = p.payload.data, p.nbytes
        if p.payload.kind == Raw.TENSOR:
            if not n:
                continue
            if n < SMALL_COPY_BYTES and is_copyable_raw(data):
                ctypes.memmove(base + p.offset, data.data_ptr(), n)
            else:
                on_cuda = data.is_cuda
                cuda |= on_cuda
                buffer[p.offset:p.offset + n].view(data.dtype).view(data.shape).copy_(data, non_blocking=on_cuda)
        elif p.payload.kind == Raw.NDARRAY:
            region = buffer[p.offset:p.offset + n]
            np.copyto(region.numpy().view(data.dtype).reshape(data.shape), data)
        else:
            buffer[p.offset:p.offset + n].numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    if cuda:
        torch.cuda.synchronize()


def write_staged(storage: Storage, layout: FileLayout, buffer: torch.Tensor) -> dict[str, list[Chunk]]:
    """Write the staged file image in one sequential pass; returns each path's chunks.

    The checksums are computed in a second thread while the image is written:
    both only read the buffer, and the hashing hides behind the disk (which
    matters most for a background writer that gets little CPU).
    """
    image = tensor_bytes(buffer[: layout.size])
    chunks: dict[str, list[Chunk]] = {}

    def hash_image() -> None:
        for p in layout.placements:
            pieces = range(p.offset, p.offset + p.nbytes, CHUNK_BYTES) if p.nbytes else [p.offset]
            chunks[p.path] = [
                Chunk(layout.file, s, min(CHUNK_BYTES, p.offset + p.nbytes - s),
                      checksum(image[s:min(s + CHUNK_BYTES, p.offset + p.nbytes)]))
                for s in pieces
            ]

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
    if len(chunks) != len(layout.placements):  # the hashing thread failed; it printed why
        raise RuntimeError(f"computing the checksums of {layout.file} failed")
    return chunks
