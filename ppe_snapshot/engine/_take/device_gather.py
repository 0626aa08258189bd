"""Small tensors on a device (a GPU) staged in one go: gathered on the device, then copied to the host at once.

Copied one by one, each small device tensor costs a copy launch and a transfer of its own: 25 us per tensor on an
H100 (10,000 tensors of 64 MiB in all blocked a save 0.25 s, where one transfer of 64 MiB takes about 1.5 ms).
Staging (:func:`~ppe_snapshot.engine._take.staging.stage`) hands such tensors here instead. Each run of them that
lie next to each other in the file image (nothing but padding between them) is gathered into one zeroed device
buffer of the run's span, at the same offsets as in the image, with one ``torch._foreach_copy_`` per dtype; then
the span is copied into the staging buffer in one transfer (its padding zeros, as :func:`clear_padding` would
leave it).
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
            run = _Run(tensor.device, offset)
            self.runs.append(run)
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
                span = run.end - run.start
                gathered = torch.zeros(span + -span % _WIDEST, dtype=torch.uint8, device=run.device)
                by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, int, int]]] = {}
                for t, at, n in run.tensors:  # one foreach copy per dtype: a mixed list is copied one by one
                    by_dtype.setdefault(t.dtype, []).append((t, at - run.start, n))
                for dtype, members in by_dtype.items():
                    torch._foreach_copy_(_places(gathered.view(dtype), members), [t for t, _, _ in members])
                on_cuda = run.device.type == "cuda"
                buffer[run.start:run.end].copy_(gathered[:span], non_blocking=on_cuda)
                cuda |= on_cuda
        return cuda


#: Every dtype's size divides this: a gathered buffer of a multiple of it can be viewed as any dtype.
_WIDEST = 16
#: Stand-ins for the padding between two tensors of one dtype in a run, by its count of elements (only their sizes
#: are read).
_gaps: dict[int, torch.Tensor] = {}


def _places(typed: torch.Tensor, members: list[tuple[torch.Tensor, int, int]]) -> list[torch.Tensor]:
    """Views of ``typed`` (a run's gathered buffer as its members' dtype), each shaped as its member and at its
    offset (bytes from the run's start), made by one call rather than three torch calls per tensor."""
    item = typed.element_size()
    first = position = members[0][1] // item
    shapes: list[torch.Tensor] = []
    kept: list[int] = []
    for t, at, n in members:
        if at // item > position:
            elements = at // item - position
            gap = _gaps.get(elements)
            if gap is None:
                gap = torch.empty(elements, device="meta")
                if elements < ALIGNMENT:  # padding, of few sizes: kept; the room of other dtypes' tensors is not
                    _gaps[elements] = gap
            shapes.append(gap)
        kept.append(len(shapes))
        shapes.append(t)
        position = (at + n) // item
    views = torch._utils._unflatten_dense_tensors(typed[first:position], shapes)
    return [views[i] for i in kept]
