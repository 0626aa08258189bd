"""The staging buffers of :meth:`Snapshot.async_take`, kept from one call to the next.

A fresh buffer costs its first touch at every call: the kernel zeroes each page as the staging copy faults it
in, which made an ``async_take`` block as long as a whole synchronous take. A buffer whose write has ended comes
back here instead, and the next ``async_take`` copies into pages already there, as a writer's reused buffer does.

The bound: at most one idle buffer of each kind (page-locked for state on a GPU, plain for state on the host),
the one most recently given back; a buffer given back while one of its kind is idle replaces it when it is at
least as large, and is dropped otherwise. The memory held between snapshots is therefore at most one staging
image per kind (the largest recent state), beside the buffers of writes still in flight.
:func:`release_staging_buffers` drops the idle ones (``Snapshot.release_staging()``).

The first ``async_take`` has no buffer to reuse: :func:`prepare_staging_buffer` (``Snapshot.prepare_staging``)
makes one ready ahead, in a background thread (allocated, every page faulted in, page-locked for state on a GPU:
``ReadyAhead``), and gives it back here as if a write had ended; an ``async_take`` that comes while it is being
made takes it, faulting in itself what the thread has not reached yet, rather than allocate another.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ppe_snapshot.engine._files import align
from ppe_snapshot.engine._take.staging import new_staging_buffer
from ppe_snapshot.engine._util import ReadyAhead

logger = logging.getLogger(__name__)

#: What :func:`staging_estimate` adds for the values it does not count (numbers, strings, RNG states).
STAGING_SLACK = 1 << 20

_lock = threading.Lock()
#: The idle buffer of each kind, by whether it is page-locked.
_idle: dict[bool, torch.Tensor] = {}
#: The buffer of each kind being made ready (:func:`prepare_staging_buffer`), and its size.
_preparing: dict[bool, tuple[ReadyAhead, int]] = {}


def staging_estimate(state: Any) -> tuple[int, bool]:
    """The bytes a staged image of ``state`` (nested dicts, lists and tuples of tensors, arrays and other values)
    takes, with room for its small values, and whether any tensor is on a GPU."""
    nbytes, on_cuda, todo = STAGING_SLACK, False, [state]
    while todo:
        value = todo.pop()
        if isinstance(value, torch.Tensor):
            nbytes += align(value.numel() * value.element_size())
            on_cuda |= value.is_cuda
        elif isinstance(value, np.ndarray):
            nbytes += align(value.nbytes)
        elif isinstance(value, (bytes, bytearray)):
            nbytes += align(len(value))
        elif isinstance(value, Mapping):
            todo.extend(value.values())
        elif isinstance(value, (list, tuple)):
            todo.extend(value)
    return nbytes, on_cuda


def prepare_staging_buffer(nbytes: int, pin: bool) -> None:
    """Make a buffer of ``nbytes`` ready for the next ``async_take`` in a background thread; nothing where the
    idle buffer of its kind, or the one being made, holds that already. A failure (no memory to page-lock) is
    a warning: the take allocates as it would have."""
    with _lock:
        idle, preparing = _idle.get(pin), _preparing.get(pin)
        if (idle is not None and idle.numel() >= nbytes) or (preparing is not None and preparing[1] >= nbytes):
            return
        ahead = ReadyAhead(lambda: new_staging_buffer(nbytes, pin), "ppe-snapshot-prepare-staging")
        _preparing[pin] = (ahead, nbytes)
    ahead.ready.add_done_callback(lambda ready: _made(ahead, nbytes, pin))


def _made(ahead: ReadyAhead, nbytes: int, pin: bool) -> None:
    """The preparation's thread is done: its buffer kept for the next take, unless a take has it already."""
    with _lock:
        mine = _preparing.get(pin, (None,))[0] is ahead
        if mine:
            del _preparing[pin]
    error = ahead.ready.exception()
    if error is not None:
        logger.warning("making a staging buffer of %d bytes ready failed (%s: %s); the next async_take allocates "
                       "its own", nbytes, type(error).__name__, error)
    elif mine:
        give_back(ahead.ready.result(), pin)


def take_staging_buffer(nbytes: int, pin: bool) -> torch.Tensor | None:
    """The idle buffer of its kind (page-locked if ``pin``) if it holds ``nbytes`` (or the one being made ready, if
    it will: made ready by this thread too), else None (stage into a new one). It holds an older image, whose
    padding the staging copy clears."""
    with _lock:
        preparing = _preparing.get(pin)
        if preparing is not None and preparing[1] >= nbytes:
            del _preparing[pin]  # this take's: not given back when its thread is done
        else:
            preparing = None
    if preparing is not None:
        try:
            return preparing[0].result()
        except Exception:  # noqa: BLE001 - warned of by its thread; the take allocates as it would have
            pass
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
