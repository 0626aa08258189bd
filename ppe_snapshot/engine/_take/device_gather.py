"""Small tensors on a device (a GPU) staged in one go: gathered on the device, then copied to the host at once.

Copied one by one, each small device tensor costs a copy launch and a transfer of its own: 25 us per tensor on an
H100 (10,000 tensors of 64 MiB in all blocked a save 0.25 s, where one transfer of 64 MiB takes about 1.5 ms).
Staging (:func:`~ppe_snapshot.engine._take.staging.stage`) hands such tensors here instead. Each run of them that
lie next to each other in the file image (nothing but padding between them) is gathered into one device buffer
of the run's span by one ``torch.cat`` of the tensors with zeros for the padding between them, exactly as the image
lays them out; then the span is copied into the staging buffer in one transfer. A run of one dtype is concatenated
as it is (no torch call per tensor but a flat view of a tensor of several dimensions); a run of several, or of a
dtype not every device concatenates, as bytes (two views per tensor). 10,000 tensors of 64 MiB in all on an H200
blocked a ThreadWriter 7.9 us per tensor when gathered by one ``torch._foreach_copy_`` into views of a zeroed
buffer at the image's offsets (making the views cost most of it), 6.0 us with ``torch.cat`` (benchmarks/RESULTS.md,
issue 35).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ppe_snapshot.engine._files import ALIGNMENT, FileLayout
from ppe_snapshot.engine._format import Raw

#: A device tensor smaller than this is gathered with its neighbours rather than copied on its own. (Chosen from
#: the launch cost above against a transfer's speed; to be checked on a GPU: ``make gpu-check`` runs
#: benchmarks/bench_gpu.py's many-tensor case.)
SMALL_DEVICE_BYTES = 1 << 20
#: A run is cut at this span: the device memory a gather holds at once.
RUN_BYTES = 64 << 20


@dataclass
class _Run:
    device: torch.device
    start: int  # offset in the image of the run's first tensor
    end: int = 0  # where its last tensor ends (its padding after it is not the run's)
    tensors: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)  # (tensor, offset, size)
    dtype: torch.dtype | None = None  # of all its tensors; None where they have several


def on_device(layout: FileLayout) -> bool:
    """Whether any payload of ``layout`` is a tensor on a device, not the host (then staging gathers)."""
    return not all(t.is_cpu for t in layout.tensors) or any(p.kind == Raw.TENSOR and not p.data.is_cpu
                                                             for p in layout.payloads)


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
        """``tensor`` goes at ``offset`` of the image (offsets ascending from call to call)."""
        run = None if self._broken or not self.runs else self.runs[-1]
        if run is None or run.device != tensor.device or offset - run.end >= ALIGNMENT \
                or offset + nbytes - run.start > RUN_BYTES:
            run = _Run(tensor.device, offset, dtype=tensor.dtype)
            self.runs.append(run)
        elif run.dtype is not tensor.dtype:
            run.dtype = None
        run.tensors.append((tensor, offset, nbytes))
        run.end, self._broken = offset + nbytes, False

    def break_run(self) -> None:
        """Something else lies in the image after the last tensor added: the next one starts a new run."""
        self._broken = True

    def copy_into(self, buffer: torch.Tensor) -> bool:
        """Copy every run into ``buffer`` (the file image); True where a CUDA copy may still be running."""
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
    bytes: its tensors and the zeros of the padding between them."""
    typed = run.dtype in _CONCATENATED
    dtype = run.dtype if typed else torch.uint8
    item = dtype.itemsize  # type: ignore[union-attr]
    parts, position = [], run.start
    for t, at, n in run.tensors:
        if at > position:
            parts.append(_zeros(run.device, dtype, (at - position) // item))  # type: ignore[arg-type]
        flat = t if t.dim() == 1 else t.reshape(-1)
        parts.append(flat if typed else flat.view(torch.uint8))
        position = at + n
    return parts


#: Zeros for the padding between two tensors of a run (less than ``ALIGNMENT`` bytes: few sizes), by device, dtype
#: and count.
_padding: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}


def _zeros(device: torch.device, dtype: torch.dtype, count: int) -> torch.Tensor:
    key = (device, dtype, count)
    zeros = _padding.get(key)
    if zeros is None:
        zeros = _padding[key] = torch.zeros(count, dtype=dtype, device=device)
    return zeros
