"""Many small device tensors restored in bulk: read into page-locked host slabs, copied to the device one slab at a
time, scattered there in one go.

The bulk path (:mod:`~ppe_snapshot.engine._restore.bulk`) reads small tensors straight into their targets' memory,
which a device tensor does not offer. For such a target it asks :class:`DeviceSlabs` for a place instead: the
slab of its device and dtype holds its bytes right after the previous target's (no gap), so the slab is the exact
concatenation of its targets. Once the reads have landed (and been verified there), each slab goes to the device
in one transfer, is cut into the targets' shapes with one call (``Tensor.split`` where every target is flat: 4x
cheaper per tensor than views of their shapes, ``torch._utils._unflatten_dense_tensors``, which the others take) and
copied into them with one ``torch._foreach_copy_``: a few launches per slab, no torch call per tensor.

Host memory: slabs of ``SLAB_BYTES`` (page-locked for CUDA), at most ``HELD_BYTES`` of them at once; the walk
hands its picks over, joins the reads and copies the slabs each time they are full (:meth:`full`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ppe_snapshot.engine._files import host_buffer

#: One host slab; a device tensor larger than this goes the usual way.
SLAB_BYTES = 8 << 20
#: The slabs held at once, before the walk waits for their reads and copies them.
HELD_BYTES = 128 << 20


@dataclass
class _Slab:
    device: torch.device
    dtype: torch.dtype
    host: torch.Tensor
    address: int  # of ``host``'s first byte
    used: int = 0
    targets: list[torch.Tensor] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # the targets' bytes
    flat: bool = True  # whether every target has one dimension


class DeviceSlabs:
    """Host places for small device tensors read in bulk, and their copy to the device (see the module doc)."""

    def __init__(self, slab_bytes: int | None = None, held_bytes: int | None = None) -> None:
        self._slab_bytes = SLAB_BYTES if slab_bytes is None else slab_bytes
        self._held_bytes = HELD_BYTES if held_bytes is None else held_bytes
        self._open: dict[tuple[torch.device, torch.dtype], _Slab] = {}  # the slab being filled, per kind
        self._last: _Slab | None = None  # the slab of the last place (most targets share the kind of the last)
        self._filled: list[_Slab] = []
        self._spare: list[torch.Tensor] = []  # host slabs copied out already, for the next ones
        self._in_use = 0  # bytes of the slabs being filled or waiting to be copied

    def place(self, target: torch.Tensor, nbytes: int) -> int | None:
        """The host address ``target``'s ``nbytes`` are to be read to; None where it is too large for a slab."""
        if nbytes > self._slab_bytes:
            return None
        slab = self._last
        if slab is None or target.dtype is not slab.dtype or slab.used + nbytes > self._slab_bytes \
                or target.device != slab.device:
            slab = self._last = self._slab_for(target, nbytes)
        address = slab.address + slab.used
        slab.used += nbytes
        slab.targets.append(target)
        slab.sizes.append(nbytes)
        if slab.flat and target.dim() != 1:
            slab.flat = False
        return address

    def _slab_for(self, target: torch.Tensor, nbytes: int) -> _Slab:
        """The open slab of ``target``'s kind, a new one where there is none or it has no room for ``nbytes``."""
        kind = (target.device, target.dtype)
        slab = self._open.get(kind)
        if slab is None or slab.used + nbytes > self._slab_bytes:
            if slab is not None:
                self._filled.append(slab)
            host = self._host_slab(target.device)
            slab = self._open[kind] = _Slab(*kind, host, host.data_ptr())
        return slab

    def full(self) -> bool:
        """Whether the slabs in use reach the bound: the caller joins their reads and calls :meth:`copy`."""
        return self._in_use >= self._held_bytes

    def _host_slab(self, device: torch.device) -> torch.Tensor:
        self._in_use += self._slab_bytes
        if self._spare:
            return self._spare.pop()
        return host_buffer(self._slab_bytes, device.type == "cuda")

    def copy(self) -> None:
        """Once every read into the slabs has landed and been verified: copy each slab into its targets. The
        slabs are kept for the places asked for next."""
        slabs = self._filled + list(self._open.values())
        self._filled, self._open, self._last, self._in_use = [], {}, None, 0
        devices = set()
        with torch.no_grad():
            for slab in slabs:
                if not slab.targets:
                    continue
                device, dtype = slab.device, slab.dtype
                cuda = device.type == "cuda"
                staged = torch.empty(slab.used // dtype.itemsize, dtype=dtype, device=device)
                staged.copy_(slab.host[:slab.used].view(dtype), non_blocking=cuda)
                if slab.flat:
                    views = staged.split((np.asarray(slab.sizes) // dtype.itemsize).tolist())
                else:
                    views = torch._utils._unflatten_dense_tensors(staged, slab.targets)
                try:
                    torch._foreach_copy_(slab.targets, views)
                except RuntimeError:  # a target with the negative or conjugate bit, which foreach copies refuse
                    for target, view in zip(slab.targets, views):
                        target.copy_(view)
                if cuda:
                    devices.add(device)
        for device in devices:  # the host slabs are read into again after this
            torch.cuda.synchronize(device)
        self._spare += [slab.host for slab in slabs]
