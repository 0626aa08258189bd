"""The staging buffers of :meth:`Snapshot.async_take`, kept from one call to the next.

A fresh buffer costs its first touch at every call: the kernel zeroes each page as the staging copy faults it
in, which made an ``async_take`` block as long as a whole synchronous take. A buffer whose write has ended comes
back here instead, and the next ``async_take`` copies into pages already there, as a writer's reused buffer does.

The bound: at most one idle buffer of each kind (page-locked for state on a GPU, plain for state on the host),
the one most recently given back; a buffer given back while one of its kind is idle replaces it when it is at
least as large, and is dropped otherwise. The memory held between snapshots is therefore at most one staging
image per kind (the largest recent state), beside the buffers of writes still in flight.
:func:`release_staging_buffers` drops the idle ones (``Snapshot.release_staging()``).
"""
from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
#: The idle buffer of each kind, by whether it is page-locked.
_idle: dict[bool, torch.Tensor] = {}


def take_staging_buffer(nbytes: int, pin: bool) -> torch.Tensor | None:
    """The idle buffer of its kind (page-locked if ``pin``) if it holds ``nbytes``, else None (stage into a new
    one). It holds an older image, whose padding the staging copy clears."""
    with _lock:
        idle = _idle.get(pin)
        if idle is None or idle.numel() < nbytes:
            return None
        return _idle.pop(pin)


def give_back(buffer: torch.Tensor, pin: bool) -> None:
    """Keep ``buffer`` for the next take, once nothing reads it any more (its write has ended)."""
    with _lock:
        idle = _idle.get(pin)
        if idle is None or buffer.numel() >= idle.numel():
            _idle[pin] = buffer


def release_staging_buffers() -> int:
    """Drop the idle staging buffers; returns the bytes they held (freed once nothing else refers to them)."""
    with _lock:
        held = sum(buffer.numel() for buffer in _idle.values())
        _idle.clear()
    return held
