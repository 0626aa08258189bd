"""Small tensors on a device (a GPU) staged in one go: gathered on the device, then copied to the host at once.

Copied one by one, each small device tensor costs a copy launch and a transfer of its own: 25 us per tensor on an
H100 (10,000 tensors of 64 MiB in all blocked a save 0.25 s, where one transfer of 64 MiB takes about 1.5 ms).
Staging (:func:`~ppe_snapshot.engine._take.staging.stage`) hands such tensors here instead. Each run of them that
lie next to each other in the file image is gathered into one device buffer of the run's span by one ``torch.cat``
of the tensors and zeros for the padding after each (its slot: up to the next ``ALIGNMENT``), exactly as the image
lays them out; then the span is copied into the staging buffer in one transfer. The span covers the tensors' slots
whole, so a reused staging buffer needs no zeroing there first. A run of one dtype is concatenated as it is (no
torch call per tensor but a flat view of a tensor of several dimensions); a run of several, or of a dtype not every
device concatenates, as bytes (two views per tensor). 10,000 tensors of 64 MiB in all on an H200 blocked a
ThreadWriter 7.9 us per tensor when gathered by one ``torch._foreach_copy_`` into views of a zeroed buffer at the
image's offsets (making the views cost most of it), 6.0 us with ``torch.cat``, 4.3 us once the reused buffer was
no longer zeroed under the runs first (benchmarks/RESULTS.md, issue 35).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ppe_snapshot.engine._files import ALIGNMENT, FileLayout, align
from ppe_snapshot.engine._format import Raw

#: A device tensor smaller than this is gathered with its neighbours rather than copied on its own. On an H200
#: (``bench_gpu.py --sweep``: 256 MiB of tensors of one size, a ThreadWriter's blocking, medians of 3), 64 KiB and
#: 256 KiB tensors staged 2.1-2.3x faster gathered, 1 MiB ones alike (7.5 / 7.8 ms), 4 and 8 MiB ones 3-5 %
#: faster one by one (benchmarks/RESULTS.md, issue 35).
SMALL_DEVICE_BYTES = 1 << 20
#: A run is cut at this span: the device memory a gather holds at once.
RUN_BYTES = 64 << 20


@dataclass
class _Run:
    device: torch.device
    start: int  # offset in the image of the run's first tensor
    end: int = 0  # where its last tensor's slot ends (the tensor and its padding)
    tensors: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)  # (tensor, offset, size)
    dtype: torch.dtype | None = None  # of all its tensors; None where they have several


def on_device(layout: FileLayout) -> bool:
    """Whether any payload of ``layout`` is a tensor on a device, not the host (then staging gathers)."""
    return not all(t.is_cpu for t in layout.tensors) or any(p.kind == Raw.TENSOR and not p.data.is_cpu
                                                             for p in layout.payloads)


def device_rows(layout: FileLayout) -> np.ndarray:
    """Which rows of ``layout`` are plain tensors on a device: the rows whose slot staging writes whole (the
    gather's runs, or the tensor copied on its own and its padding zeroed), no zeroing before."""
    rows = np.zeros(len(layout.sizes), dtype=bool)
    rows[:len(layout.tensors)] = np.fromiter((not t.is_cpu for t in layout.tensors), bool, len(layout.tensors))
    return rows


def gathers(tensor: torch.Tensor, nbytes: int) -> bool:
    """Whether staging gathers ``tensor`` (of ``nbytes``) rather than copying it on its own: a tensor on a device
    that :func:`gatherable` allows."""
    return not tensor.is_cpu and gatherable(tensor, nbytes)


def gatherable(tensor: torch.Tensor, nbytes: int) -> bool:
    """Small and contiguous, no conjugate or negative view (one such tensor among them would make the foreach
    copy copy each of its group one by one)."""
    return (0 < nbytes < SMALL_DEVICE_BYTES and tensor.is_contiguous() and not tensor.is_neg()
            and not (tensor.dtype.is_complex and tensor.is_conj()))


class DeviceGather:
    """The small device tensors of one staging, in runs; :meth:`copy_into` stages them (asynchronously for CUDA:
    synchronize before reading the buffer)."""

    def __init__(self) -> None:
        self.runs: list[_Run] = []
        self._broken = False

    def add(self, tensor: torch.Tensor, offset: int, nbytes: int) -> None:
        """``tensor`` goes at ``offset`` of the image (aligned, ascending from call to call), its slot up to the
        next ``ALIGNMENT`` (where the image's next payload begins)."""
        run = None if self._broken or not self.runs else self.runs[-1]
        if run is None or offset != run.end or offset + nbytes - run.start > RUN_BYTES or run.device != tensor.device:
            run = _Run(tensor.device, offset, dtype=tensor.dtype)
            self.runs.append(run)
        elif run.dtype is not tensor.dtype:
            run.dtype = None
        run.tensors.append((tensor, offset, nbytes))
        run.end, self._broken = align(offset + nbytes), False

    def break_run(self) -> None:
        """Something else lies in the image after the last tensor added: the next one starts a new run."""
        self._broken = True

    def copy_into(self, buffer: torch.Tensor) -> bool:
        """Copy every run into ``buffer`` (the file image): its tensors' slots whole, padding zeroed; True where a
        CUDA copy may still be running."""
        cuda = False
        with torch.no_grad():
            for run in self.runs:
                gathered = torch.cat(_parts(run))
                on_cuda = run.device.type == "cuda"
                buffer[run.start:run.end].copy_(gathered.view(torch.uint8), non_blocking=on_cuda)
                cuda |= on_cuda
        return cuda


#: The dtypes whose runs are concatenated as they are: those every device's ``torch.cat`` implements. A run of any
#: other dtype (float8, the unsigned ones wider than a byte, ...) is concatenated as bytes, as a mixed one is.
_CONCATENATED = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                           torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128})


def _parts(run: _Run) -> list[torch.Tensor]:
    """A run as flat tensors of one dtype, its own where every device concatenates it (``_CONCATENATED``), else
    bytes: each tensor, then the zeros of the padding after it."""
    typed = run.dtype in _CONCATENATED
    dtype = run.dtype if typed else torch.uint8
    item = dtype.itemsize  # type: ignore[union-attr]
    zeros: dict[int, torch.Tensor] = {}  # this run's padding, by its bytes
    parts = []
    for t, at, n in run.tensors:
        flat = t if t.dim() == 1 else t.reshape(-1)
        parts.append(flat if typed else flat.view(torch.uint8))
        if pad := -n % ALIGNMENT:
            padding = zeros.get(pad)
            if padding is None:
                padding = zeros[pad] = _zeros(run.device, dtype, pad // item)  # type: ignore[arg-type]
            parts.append(padding)
    return parts


#: Zeros for the padding after a tensor (less than ``ALIGNMENT`` bytes: few sizes), by device, dtype and count.
_padding: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}


def _zeros(device: torch.device, dtype: torch.dtype, count: int) -> torch.Tensor:
    key = (device, dtype, count)
    zeros = _padding.get(key)
    if zeros is None:
        zeros = _padding[key] = torch.zeros(count, dtype=dtype, device=device)
    return zeros
