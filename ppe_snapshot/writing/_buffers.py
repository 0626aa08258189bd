"""The staging buffers a background writer owns: one per save in flight, allocated once, grown only when needed.

A save handed to a runner that writes it after the call returned is first copied into its slot's buffer (the
engine stages a take there; ``_files.StagedObject`` a savefun's target). :class:`StagingBuffers` keeps each slot's
buffer in this process's memory; the worker process keeps its own kind (``_process.SharedBuffers``).
"""
from __future__ import annotations

from concurrent.futures import Future

import torch

from ppe_snapshot.engine import ReadyAhead, new_staging_buffer

_MiB = 1 << 20


def grown_size(current: int, needed: int) -> int:
    """Bytes for a new staging buffer: what is needed, with headroom once a buffer had to grow."""
    size = max(needed, current + current // 4) if current else needed
    return max(_MiB, -(-size // _MiB) * _MiB)


class StagingBuffers:
    """The staging buffer of each of ``depth`` slots: page-aligned host memory (O_DIRECT writes it without a
    bounce copy), page-locked when the state lives on CUDA."""

    def __init__(self, depth: int) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * depth
        self._pinned = [False] * depth
        #: A buffer being made ready in the background for slot 0 (see :meth:`reserve`), its size and pinning.
        self._reserved: tuple[ReadyAhead, int, bool] | None = None

    @property
    def all(self) -> tuple[torch.Tensor | None, ...]:
        """Each slot's buffer (None until first used)."""
        return tuple(self._buffers)

    def reserve(self, nbytes: int, pin: bool) -> None:
        """Make slot 0's buffer (the first save's) ready for ``nbytes`` in a background thread, every page touched,
        so that the save does not pay for allocating, page-locking and faulting it in; nothing when the buffer
        there or the one being made will do. A failure leaves the save to allocate as before."""
        if self._fits(0, nbytes, pin) or self._reserving(nbytes, pin):
            return
        if self._reserved is not None:  # too small: dropped once made
            self._reserved[0].ready.add_done_callback(self._drop_made)
        current = self._buffers[0]
        size = grown_size(0 if current is None else current.numel(), nbytes)
        self._reserved = (ReadyAhead(lambda: self.allocate(size, pin), "ppe-snapshot-reserve"), size, pin)

    def _drop_made(self, made: "Future[torch.Tensor]") -> None:
        if made.exception() is None:
            self.drop(made.result())

    def _reserving(self, nbytes: int, pin: bool) -> bool:
        """Whether the buffer being made for slot 0 will fit ``nbytes`` (and has not failed)."""
        if self._reserved is None:
            return False
        ahead, size, pinned = self._reserved
        failed = ahead.ready.done() and ahead.ready.exception() is not None
        return size >= nbytes and pinned >= pin and not failed

    def _fits(self, slot: int, nbytes: int, pin: bool) -> bool:
        buffer = self._buffers[slot]
        return buffer is not None and buffer.numel() >= nbytes and (self._pinned[slot] or not pin)

    def get(self, slot: int, nbytes: int, pin: bool) -> torch.Tensor:
        """Slot ``slot``'s buffer, replaced by a bigger (or page-locked) one when it does not fit ``nbytes``."""
        if slot == 0 and self._reserved is not None:
            self._take_reserved(nbytes, pin)
        old = self._buffers[slot]
        if old is None or old.numel() < nbytes or (pin and not self._pinned[slot]):
            self._buffers[slot] = None
            if old is not None:
                self.drop(old)
            new = self._buffers[slot] = self.allocate(grown_size(0 if old is None else old.numel(), nbytes), pin)
            self._pinned[slot] = pin
            self.changed(slot, new)
            return new
        return old

    def _take_reserved(self, nbytes: int, pin: bool) -> None:
        """Put the reserved buffer in slot 0 (made ready by this thread too if it is still being made) unless the
        one there fits this save or the reserved one does not."""
        ahead, _, pinned = self._reserved
        self._reserved = None
        try:
            buffer = ahead.result()
        except Exception:  # noqa: BLE001 - the save allocates as it did without a reservation
            return
        if self._fits(0, nbytes, pin) or buffer.numel() < nbytes or pinned < pin:
            self.drop(buffer)
            return
        old, self._buffers[0] = self._buffers[0], buffer
        if old is not None:
            self.drop(old)
        self._pinned[0] = pinned
        self.changed(0, buffer)

    def allocate(self, nbytes: int, pin: bool) -> torch.Tensor:
        """A new buffer of ``nbytes``."""
        return new_staging_buffer(nbytes, pin)

    def drop(self, buffer: torch.Tensor) -> None:
        """``buffer`` is being replaced by a bigger one."""

    def changed(self, slot: int, buffer: torch.Tensor) -> None:
        """Slot ``slot`` has a new buffer."""

    def close(self) -> None:
        """The writer is done with its buffers (its runner was shut down)."""
