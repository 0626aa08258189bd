"""Packing payloads into a rank's data file, and writing it.

Each rank writes one file. Payloads sit at offsets aligned to
``ALIGNMENT``; each is cut into chunks of at most the take's block size
(:func:`chunk_limit`) with an xxh3_64 checksum each: the chunks are the blocks a
later incremental take compares, whatever take this one is. The same layout
serves both ways of writing:

* straight from the live tensors (sync take: no copy of the state), here, and
* from a staging buffer that is the exact image of the file (async take:
  the caller pays one copy, the background writes one sequential buffer),
  see :mod:`~ppe_snapshot.engine._take.staging`.
"""
from __future__ import annotations

import ctypes
import itertools
import operator
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
import xxhash

from ppe_snapshot.engine._format import PLAIN_TENSOR_TYPES, Chunk, Raw, ShapeColumns
from ppe_snapshot.engine._state import Payload, PlainTensors
from ppe_snapshot.engine._util import MEMORY
from ppe_snapshot.storage import BlobWriter, Storage

ALIGNMENT = 64
CHUNK_BYTES = 64 << 20
#: Largest piece of a non-CPU or non-contiguous tensor copied to host memory at once to be written.
HOST_COPY_BYTES = 64 << 20
#: A sync take hands the bytes of small payloads to the storage writer in batches of about this size.
WRITE_BATCH_BYTES = 4 << 20
#: Host tensors up to this size are gathered (with their padding) into buffers of ``GATHER_BUFFER_BYTES``.
GATHER_BYTES = 256 << 10
GATHER_BUFFER_BYTES = 4 << 20
_PAD = memoryview(bytes(ALIGNMENT))


def checksum(data: memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def chunk_limit(block_bytes: int | None) -> int:
    """The largest chunk a take of blocks of ``block_bytes`` writes (``CHUNK_BYTES`` read now: tests shrink it)."""
    return CHUNK_BYTES if block_bytes is None else min(CHUNK_BYTES, block_bytes)


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
    negative view (whose memory holds other values than the tensor shows). The conjugate bit is asked of complex
    tensors only (a real one's conjugate is itself): ``is_conj`` releases the GIL, which costs 10-30 us beside a
    running read thread (a restore of 10^5 tensors the usual way spent 1.3 s in it)."""
    return tensor.is_cpu and tensor.is_contiguous() and not (tensor.dtype.is_complex and tensor.is_conj()) \
        and not tensor.is_neg()


def is_copyable_raw(tensor: torch.Tensor) -> bool:
    """Whether a tensor's bytes may be copied straight from its memory (``MEMORY``): a plain tensor (no
    subclass with its own storage semantics) that :func:`is_direct` allows."""
    return type(tensor) in PLAIN_TENSOR_TYPES and is_direct(tensor)


@dataclass(slots=True)
class StagedShape:
    """What an entry needs of a staged tensor or array once the live data is let go."""
    dtype: Any
    shape: tuple[int, ...]

    def __reduce__(self) -> tuple:  # a job of 10^5 tensors pickles 2x faster than with the dataclass's state
        return StagedShape, (self.dtype, self.shape)


_KIND, _DATA, _NBYTES, _IS_CUDA = map(operator.attrgetter, ("kind", "data", "nbytes", "is_cuda"))


@dataclass
class FileLayout:
    """Where the payloads of a rank's data file go, one row per payload in file order, as columns (a state of
    10^5 tensors makes no object per payload here): first the plain tensors (``tensors`` with their ``dtypes``,
    see :class:`~ppe_snapshot.engine._state.flattening.PlainTensors`), then every other payload (``payloads``);
    ``paths``, ``offsets`` and ``sizes`` cover all rows."""
    file: str
    paths: list[str]
    tensors: list[torch.Tensor]
    dtypes: list[torch.dtype]
    payloads: list[Payload]
    offsets: list[int]
    sizes: list[int]
    size: int
    #: The plain tensors' shapes once the tensors are let go (:meth:`let_go`).
    shapes: ShapeColumns | None = None

    def kinds(self) -> Iterator[str]:
        """Each row's kind (one of :class:`~ppe_snapshot.engine._format.Raw`), in file order."""
        return itertools.chain(itertools.repeat(Raw.TENSOR, len(self.dtypes)), map(_KIND, self.payloads))

    def datas(self) -> Iterator[Any]:
        """Each row's data (a tensor, an array, bytes; after :meth:`let_go`, not the plain tensors)."""
        return itertools.chain(self.tensors, map(_DATA, self.payloads))

    def tensor_shapes(self) -> ShapeColumns:
        """The plain tensors' shapes."""
        if self.shapes is not None:
            return self.shapes
        return ShapeColumns.of_tensors(self.tensors, self.sizes, self.dtypes)

    def on_cuda(self) -> bool:
        """Whether any payload is a CUDA tensor (staging then wants pinned memory and a synchronize)."""
        return any(map(_IS_CUDA, self.tensors)) or any(p.kind == Raw.TENSOR and p.data.is_cuda for p in self.payloads)

    def let_go(self) -> None:
        """Keep of the live state only what the entries need (dtypes and shapes), once it is staged: a job
        must not keep the state alive."""
        self.shapes, self.tensors = self.tensor_shapes(), []
        for payload in self.payloads:
            data = payload.data
            if not isinstance(data, (bytes, bytearray)):
                payload.data = StagedShape(data.dtype, tuple(data.shape))

    def __reduce__(self) -> tuple:
        """Pickled column by column (a ProcessWriter sends every take's layout to its worker): lists of plain
        values pickle about 5x faster than an object per payload (0.14 s against 0.5-0.9 s for 10^5)."""
        ps = self.payloads
        return _layout_from_columns, (self.file, self.size, self.paths, self.tensors, self.dtypes, self.shapes,
                                      self.offsets, self.sizes, list(map(_KIND, ps)), list(map(_DATA, ps)),
                                      [p.replicated for p in ps])


def _layout_from_columns(file: str, size: int, paths: list[str], tensors: list[torch.Tensor],
                         dtypes: list[torch.dtype], shapes: ShapeColumns | None, offsets: list[int], sizes: list[int],
                         kinds: list[str], data: list[Any], replicated: list[bool]) -> FileLayout:
    return FileLayout(file, paths, tensors, dtypes, list(map(Payload, kinds, data, replicated)), offsets, sizes,
                      size, shapes)


def lay_out(file: str, payloads: list[tuple[str, Payload]], plain: PlainTensors | None = None) -> FileLayout:
    """Each payload at the next offset aligned to ``ALIGNMENT`` after the one before: first the plain tensors,
    then ``payloads``."""
    plain = plain or PlainTensors()
    tensor = Raw.TENSOR
    sizes = list(map(_NBYTES, plain.tensors))
    sizes += [p.data.nbytes if p.kind == tensor else p.nbytes for _, p in payloads]
    ends = np.cumsum((np.array(sizes, dtype=np.int64) + (ALIGNMENT - 1)) & -ALIGNMENT)
    offsets = [0] + ends[:-1].tolist() if sizes else []
    return FileLayout(file, plain.paths + [path for path, _ in payloads], plain.tensors, plain.dtypes,
                      [p for _, p in payloads], offsets, sizes, int(ends[-1]) if sizes else 0)


#: What writing a data file gives per payload, in layout order: the xxh3_64 of its bytes (an ``int``) when they
#: are one chunk (at the payload's offset, of its size: most payloads), else the list of its chunks.
Written = list["int | list[Chunk]"]


def payload_chunks(layout: FileLayout, row: int, written: "int | list[Chunk]") -> list[Chunk]:
    """The chunks of payload ``row`` of ``layout`` from what writing it gave (see :data:`Written`)."""
    if type(written) is int:
        return [Chunk(layout.file, layout.offsets[row], layout.sizes[row], f"{written:016x}")]
    return written


def needs_bounce(payload: Payload) -> bool:
    """Whether a payload is a tensor that must be copied to host memory to be written (see :func:`is_direct`)."""
    return payload.kind == Raw.TENSOR and not is_direct(payload.data)


def _payload_views(payload: Payload, bounce: torch.Tensor | None, bounced: bool, most: int
                   ) -> Iterator[memoryview]:
    """The payload's bytes in pieces of at most ``most`` bytes; a piece is valid until the next one.
    ``bounced``: a tensor that is copied to host through ``bounce`` first (see :func:`is_direct`)."""
    if bounced:
        for view in _bounced_views(payload.data, bounce):
            for start in range(0, view.nbytes, most):
                yield view[start:start + most]
        return
    if payload.kind == Raw.TENSOR:
        data = tensor_bytes(payload.data)
    elif payload.kind == Raw.NDARRAY:
        data = memoryview(np.ascontiguousarray(payload.data).reshape(-1).view(np.uint8))
    else:  # pickled or raw bytes
        data = memoryview(payload.data)
    for start in range(0, data.nbytes, most):
        yield data[start:start + most]


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


def host_copy_buffer(source: torch.Tensor, reuse: torch.Tensor | None = None) -> torch.Tensor:
    """A host buffer for the pieces of ``source`` that must be copied to host memory to be written: ``reuse`` when
    it is big enough (and pinned, for a CUDA tensor), else a new one of at most ``HOST_COPY_BYTES``.

    Pinned only for a CUDA source: pinning is slow, and torch keeps freed pinned blocks cached for the life of the
    process (with the bounce of CPU tensors pinned, a take of transposed CPU tensors held 162 MiB more on an H200
    machine, where 80 MiB is the bound)."""
    need, pin = min(HOST_COPY_BYTES, source.nbytes), source.is_cuda
    if reuse is not None and reuse.numel() >= need and (not pin or reuse.is_pinned()):
        return reuse
    return torch.empty(need, dtype=torch.uint8, pin_memory=pin)


class PayloadAppender:
    """Appends payloads, straight from their memory, to a data file being written.

    Pads to each payload's offset, checksums every piece, and hands the bytes
    to the storage writer every ``WRITE_BATCH_BYTES``, so the disk writes
    while the next payloads are hashed (at once for a bounced piece, whose
    buffer the next piece reuses). Small tensors in host memory (up to
    ``GATHER_BYTES``) are gathered into one zeroed buffer with their padding
    (slices of ``MEMORY``, no Python object per tensor), which is handed over
    whole: 10^5 small tensors make a few writes, not 10^5 pieces.
    """

    def __init__(self, writer: BlobWriter, file: str, block_bytes: int | None = None) -> None:
        self._writer, self._file, self._most = writer, file, chunk_limit(block_bytes)  # the largest chunk
        self._batch: list[memoryview] = []
        self.position = self._handed_over = 0
        self._gather: memoryview | None = None
        self._gather_start = 0
        #: Gathering buffers in the batch, and those handed over (free to gather into again, once zeroed).
        self._gathered: list[bytearray] = []
        self._spare: list[bytearray] = []
        self._bounce: torch.Tensor | None = None

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
            self._gathered.append(self._gather.obj)
            self._gather = None

    def _new_gather(self) -> None:
        """Hand over what is due and start gathering into a zeroed buffer at the current position: one handed
        over before (its pages are faulted in already: 68 MiB of new buffers cost a 10^5-tensor take 15 ms)."""
        self._end_gather()
        if self.position - self._handed_over >= WRITE_BATCH_BYTES:
            self._hand_over()
        if self._spare:
            buffer = self._spare.pop()
            ctypes.memset((ctypes.c_char * len(buffer)).from_buffer(buffer), 0, len(buffer))
        else:
            buffer = bytearray(GATHER_BUFFER_BYTES)
        self._gather, self._gather_start = memoryview(buffer), self.position

    def append(self, payload: Payload, bounce: torch.Tensor | None) -> list[Chunk]:
        """Write ``payload`` at the current position; its chunks (one empty chunk when it has no bytes).
        ``bounce``: a host buffer for a tensor that :func:`needs_bounce`."""
        self._bounce, start = bounce, self.position
        written = self._append(payload)
        if type(written) is int:
            return [Chunk(self._file, start, self.position - start, f"{written:016x}")]
        return written

    def append_layout(self, layout: FileLayout) -> Written:
        """Write every payload of ``layout`` at its offset (see :data:`Written`), then pad to its size.

        A small host tensor (most payloads of a large state) is copied into the gathering buffer and hashed
        there, in this loop: the cost per tensor is a few attribute reads, a slice copy (``MEMORY``) and a
        hash. (The same work as a few ``map`` passes over runs of tensors measured no faster: the calls into
        torch and xxhash cost the time, not the loop.)
        """
        written: Written = []
        add, digest, memory, tensor = written.append, xxhash.xxh3_64_intdigest, MEMORY, Raw.TENSOR
        small = min(GATHER_BYTES, self._most)
        gather, gather_start, gather_end = memoryview(b""), 0, -1  # no gathering buffer yet
        for data, kind, offset, n in zip(layout.datas(), layout.kinds(), layout.offsets, layout.sizes):
            if n <= small and kind == tensor and type(data) in PLAIN_TENSOR_TYPES and data.is_cpu \
                    and data.is_contiguous() and not data.is_conj() and not data.is_neg():  # is_copyable_raw()
                if offset + n > gather_end:
                    self._new_gather()  # at the current position: the padding up to offset is in the buffer
                    gather, gather_start = self._gather, self._gather_start
                    gather_end = gather_start + gather.nbytes
                at, source = offset - gather_start, data.data_ptr()
                gather[at:at + n] = memory[source:source + n]
                add(digest(gather[at:at + n]))
                self.position = offset + n
            else:
                self.pad_to(offset)
                payload = Payload(kind, data)
                if needs_bounce(payload):
                    self._bounce = host_copy_buffer(data, self._bounce)
                add(self._append(payload))  # it ends the gathering buffer
                gather_end = -1
        self.finish(layout.size)
        return written

    def _append(self, payload: Payload) -> "int | list[Chunk]":
        data = payload.data
        if payload.kind == Raw.TENSOR and data.nbytes <= min(GATHER_BYTES, self._most) and is_copyable_raw(data):
            if self._gather is None or self.position + data.nbytes - self._gather_start > self._gather.nbytes:
                self._new_gather()
            at, source, n = self.position - self._gather_start, data.data_ptr(), data.nbytes
            self._gather[at:at + n] = MEMORY[source:source + n]
            self.position += n
            return xxhash.xxh3_64_intdigest(self._gather[at:at + n])
        self._end_gather()
        bounced, chunks = needs_bounce(payload), []
        for view in _payload_views(payload, self._bounce, bounced, self._most):
            chunks.append(Chunk(self._file, self.position, view.nbytes, checksum(view)))
            self._batch.append(view)
            self.position += view.nbytes
            if bounced or self.position - self._handed_over >= WRITE_BATCH_BYTES:
                self._hand_over()
        if len(chunks) == 1:
            return int(chunks[0].checksum, 16)
        return chunks or xxhash.xxh3_64_intdigest(b"")

    def append_hashed(self, view: memoryview, checksum: str) -> Chunk:
        """Append bytes already hashed (``checksum``) at the next offset aligned to ``ALIGNMENT``, as they are (no
        copy); their chunk. An incremental take's changed blocks."""
        start = align(self.position)
        self.pad_to(start)
        self._end_gather()
        self._batch.append(view)
        self.position = start + view.nbytes
        if self.position - self._handed_over >= WRITE_BATCH_BYTES:
            self._hand_over()
        return Chunk(self._file, start, view.nbytes, checksum)

    def finish(self, size: int) -> None:
        """Pad to ``size`` and hand over the rest."""
        self.pad_to(size)
        self._end_gather()
        self._hand_over()

    def _hand_over(self) -> None:
        self._writer.write(self._batch)  # done with the buffers when it returns (BlobWriter.write)
        self._batch, self._handed_over = [], self.position
        self._spare += self._gathered
        self._gathered = []


def write_from_sources(storage: Storage, layout: FileLayout, block_bytes: int | None = None) -> Written:
    """Write the file straight from the payloads' memory, in chunks of ``block_bytes`` (see :data:`Written`)."""
    writer = storage.open_writer(layout.file, layout.size)
    try:
        written = PayloadAppender(writer, layout.file, block_bytes).append_layout(layout)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return written
