"""Many small device tensors restored in bulk: read into page-locked host slabs, each slab copied to the device as
soon as its bytes have landed, and scattered there in one go.

The bulk path (:mod:`~ppe_snapshot.engine._restore.bulk`) reads small tensors straight into their targets' memory,
which a device tensor does not offer. For such a target it asks :class:`DeviceSlabs` for a place instead: the
slab of its device and dtype holds its bytes right after the previous target's (no gap), so the slab is the exact
concatenation of its targets. A slab is closed when the walk opens the next one of its kind; once closed and all
its bytes read and verified (:meth:`DeviceSlabs.landed`, called by the read that completes it), it goes to the
device in one transfer and copied into its targets: where every target is flat, by one
``torch.split_with_sizes_copy`` (one kernel on CUDA, and no tensor object made per target), else cut into views of
the targets' shapes (``torch._utils._unflatten_dense_tensors``) and copied by one ``torch._foreach_copy_``: a few
launches per slab, no torch call per tensor. Those copies run on the read threads while the walk goes on (on an
H200 the copies of 10,000 tensors took 13-17 ms after the walk when all waited for its end), and their host slab is
then placed into again (after the transfer out of it ends: a CUDA event), so a restore pins a few slabs instead of
one per 8 MiB of tensors. The slabs still open when the walk ends are copied by :meth:`DeviceSlabs.copy`.

The walk asks for places in batches (:meth:`DeviceSlabs.place_many`: a few numpy passes per run of targets of one
device and dtype, no Python call per target), each time it hands its picks to the read pool.

Host memory: slabs of ``SLAB_BYTES`` (page-locked for CUDA), at most ``HELD_BYTES`` of them placed into and not
yet copied; where a batch would need more, it is placed in part, and the walk hands that part over, joins the
reads and copies the slabs before it places the rest. The copies from read threads go on the device's default
stream: the walk's current stream is synchronized once per device first, so that work queued on the targets before
the restore ends before they begin.
"""
from __future__ import annotations

import operator
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ppe_snapshot.engine._files import host_buffer

#: One host slab; a device tensor larger than this goes the usual way.
SLAB_BYTES = 8 << 20
#: The slabs placed into and not yet copied, at most, before the walk waits for their reads and copies them.
HELD_BYTES = 128 << 20

_DEVICE = operator.attrgetter("device")


@dataclass
class _Slab:
    device: torch.device
    dtype: torch.dtype
    host: torch.Tensor
    address: int  # of ``host``'s first byte
    used: int = 0  # bytes placed (by the walk, until the slab is closed)
    targets: list[torch.Tensor] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # the targets' bytes
    flat: bool = True  # whether every target has one dimension
    landed: int = 0  # bytes read into it and verified (by the read threads)
    closed: bool = False  # whether the walk places no more into it


class DeviceSlabs:
    """Host places for small device tensors read in bulk, and their copy to the device (see the module doc)."""

    def __init__(self, slab_bytes: int | None = None, held_bytes: int | None = None) -> None:
        self._slab_bytes = SLAB_BYTES if slab_bytes is None else slab_bytes
        self._held_bytes = HELD_BYTES if held_bytes is None else held_bytes
        self._lock = threading.Lock()  # guards what the read threads touch: the slabs' landing, the spares
        self._open: dict[tuple[torch.device, torch.dtype], _Slab] = {}  # the slab being filled, per kind
        self._live: dict[int, _Slab] = {}  # by address: the slabs placed into and not yet copied
        self._spare: list[tuple[torch.Tensor, Any]] = []  # host slabs copied out of, and the end of that copy
        self._in_use = 0  # bytes of the live slabs
        self._devices: set[torch.device] = set()  # the devices copied to

    def place_many(self, targets: list[torch.Tensor], nbytes: np.ndarray, dtypes: list[torch.dtype],
                   flat: np.ndarray | list[bool]) -> np.ndarray:
        """The host addresses ``targets[i]``'s ``nbytes[i]`` bytes (each at most ``slab_bytes``) are to be read to,
        in order, for as many targets as the bound allows: fewer addresses than targets where the slabs in use
        would pass it, and the caller hands the placed ones to the reads, joins them, calls :meth:`copy`, and
        places the rest. ``dtypes`` and ``flat`` (one dimension) are the targets', which the walk knows already
        from the index. Each slab holds its targets' bytes one after another, in the order given."""
        n = len(targets)
        if not n:
            return np.empty(0, dtype=np.int64)
        devices = list(map(_DEVICE, targets))
        if devices.count(devices[0]) == n and dtypes.count(dtypes[0]) == n:  # one run: the common case, told in
            edges = [0, n]  # two C-level passes (a third of the time of the pairwise ones)
        else:
            changes = np.fromiter(map(operator.is_not, dtypes[1:], dtypes[:-1]), dtype=bool, count=n - 1) \
                | np.fromiter(map(operator.ne, devices[1:], devices[:-1]), dtype=bool, count=n - 1)
            edges = [0, *(np.flatnonzero(changes) + 1).tolist(), n]
        nbytes, flat = np.asarray(nbytes, dtype=np.int64), np.asarray(flat, dtype=bool)
        ends = np.cumsum(nbytes)
        addresses: list[np.ndarray] = []
        for start, stop in zip(edges[:-1], edges[1:]):  # runs of one device and dtype
            if self._place_run(targets, nbytes, ends, flat, start, stop, (devices[start], dtypes[start]),
                               addresses) < stop:
                break
        return np.concatenate(addresses) if addresses else np.empty(0, dtype=np.int64)

    @property
    def slab_bytes(self) -> int:
        """The size of a slab: a larger target goes the usual way."""
        return self._slab_bytes

    def _place_run(self, targets: list[torch.Tensor], nbytes: np.ndarray, ends: np.ndarray, flat: np.ndarray,
                   start: int, stop: int, kind: tuple[torch.device, torch.dtype], addresses: list[np.ndarray]) -> int:
        """Place ``targets[start:stop]``, all of ``kind``, slab by slab (``ends``: the cumulated ``nbytes``), their
        addresses appended to ``addresses``; returns where it stopped (``stop`` unless the bound was reached)."""
        position = start
        while position < stop:
            slab = self._open.get(kind)
            if slab is None or slab.used + int(nbytes[position]) > self._slab_bytes:
                if self._in_use and self._in_use + self._slab_bytes > self._held_bytes:
                    return position
                slab = self._new_slab(kind, slab)
            before = int(ends[position] - nbytes[position])  # the bytes of the targets before ``position``
            end = min(stop, int(np.searchsorted(ends, before + self._slab_bytes - slab.used, side="right")))
            offsets = ends[position:end] - nbytes[position:end] - before + slab.used
            addresses.append(offsets + slab.address)
            slab.targets += targets[position:end]
            slab.sizes += nbytes[position:end].tolist()
            slab.used += int(ends[end - 1]) - before
            if not flat[position:end].all():
                slab.flat = False
            position = end
        return stop

    def _new_slab(self, kind: tuple[torch.device, torch.dtype], full: _Slab | None) -> _Slab:
        """A new open slab of ``kind``; ``full``, the one it replaces, is closed."""
        if full is not None:
            self._close(full)
        host = self._host_slab(kind[0])
        slab = self._open[kind] = _Slab(*kind, host, host.data_ptr())
        with self._lock:
            self._live[slab.address] = slab
        return slab

    def _close(self, slab: _Slab) -> None:
        """No more places in ``slab``: copied now if its bytes have all landed already, else by the read that
        lands the last of them."""
        with self._lock:
            slab.closed = True
            ready = slab.landed == slab.used and self._live.pop(slab.address, None) is not None
        if ready:
            self._copy_slab(slab)

    def landed(self, addresses: list[int], sizes: list[int]) -> None:
        """``sizes[i]`` bytes read to ``addresses[i]`` and verified there (addresses outside the slabs are left
        alone); a closed slab whose bytes have now all landed is copied to the device, on this thread."""
        with self._lock:
            if not self._live:
                return
            bases = np.fromiter(self._live, dtype=np.int64, count=len(self._live))
            bases.sort()
            at = np.asarray(addresses, dtype=np.int64)
            which = np.searchsorted(bases, at, side="right") - 1
            inside = (which >= 0) & (at < bases[which] + self._slab_bytes)
            totals = np.bincount(which[inside], weights=np.asarray(sizes, dtype=np.int64)[inside],
                                 minlength=len(bases))
            ready = []
            for base, total in zip(bases[totals > 0].tolist(), totals[totals > 0].tolist()):
                slab = self._live[base]
                slab.landed += int(total)
                if slab.closed and slab.landed == slab.used:
                    ready.append(self._live.pop(base))
        for slab in ready:
            self._copy_slab(slab)

    def _host_slab(self, device: torch.device) -> torch.Tensor:
        """A host slab for ``device``: a spare one (once the copy out of it has ended), else a new one."""
        if device.type == "cuda" and device not in self._devices:
            torch.cuda.current_stream(device).synchronize()  # (see the module doc)
        self._devices.add(device)
        with self._lock:
            self._in_use += self._slab_bytes
            spare = self._spare.pop() if self._spare else None
        if spare is None:
            return host_buffer(self._slab_bytes, device.type == "cuda")
        host, copied = spare
        if copied is not None:
            copied.synchronize()
        return host

    def copy(self) -> None:
        """Once every read into the slabs has landed and been verified: copy each slab not yet copied into its
        targets, and wait for every copy to the device. The slabs are kept for the places asked for next."""
        with self._lock:
            slabs, self._live = list(self._live.values()), {}
        self._open = {}
        for slab in slabs:
            self._copy_slab(slab)
        for device in self._devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    def _copy_slab(self, slab: _Slab) -> None:
        """Copy a slab whose bytes have all landed into its targets (on any thread), then make it a spare (not
        where the copy failed: a transfer out of it may still be under way)."""
        copied = _to_device(slab) if slab.targets else None
        with self._lock:
            self._spare.append((slab.host, copied))
            self._in_use -= self._slab_bytes


def _to_device(slab: _Slab) -> Any:
    """One transfer of the slab, then one copy out of it into its targets (see the module doc); the CUDA event that
    marks the end of the transfer out of the host slab (None elsewhere: the copy was synchronous)."""
    device, dtype = slab.device, slab.dtype
    cuda = device.type == "cuda"
    with torch.no_grad():  # (a thread of its own: the walk's mode is not this thread's)
        staged = torch.empty(slab.used // dtype.itemsize, dtype=dtype, device=device)
        staged.copy_(slab.host[:slab.used].view(dtype), non_blocking=cuda)
        sizes = (np.asarray(slab.sizes) // dtype.itemsize).tolist() if slab.flat else None
        views = None if sizes is not None else torch._utils._unflatten_dense_tensors(staged, slab.targets)
        try:
            if views is None:
                torch.split_with_sizes_copy(staged, sizes, out=slab.targets)
            else:
                torch._foreach_copy_(slab.targets, views)
        except RuntimeError:  # a target with the negative or conjugate bit, which copies into a list refuse
            for target, view in zip(slab.targets, staged.split(sizes) if views is None else views):
                target.copy_(view)
    if not cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
