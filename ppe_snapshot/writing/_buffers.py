"""The staging buffers a background writer owns: one per save in flight, allocated once, grown only when needed.

A save handed to a runner that writes it after the call returned is first copied into its slot's buffer (the
engine stages a take there; ``_files.StagedObject`` a savefun's target). :class:`StagingBuffers` keeps each slot's
buffer in this process's memory; the worker process keeps its own kind (``_process.SharedBuffers``).
"""
from __future__ import annotations

import torch

from ppe_snapshot.engine import new_staging_buffer

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

    @property
    def all(self) -> tuple[torch.Tensor | None, ...]:
        """Each slot's buffer (None until first used)."""
        return tuple(self._buffers)

    def get(self, slot: int, nbytes: int, pin: bool) -> torch.Tensor:
        """Slot ``slot``'s buffer, replaced by a bigger (or page-locked) one when it does not fit ``nbytes``."""
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

    def allocate(self, nbytes: int, pin: bool) -> torch.Tensor:
        """A new buffer of ``nbytes``."""
        return new_staging_buffer(nbytes, pin)

    def drop(self, buffer: torch.Tensor) -> None:
        """``buffer`` is being replaced by a bigger one."""

    def changed(self, slot: int, buffer: torch.Tensor) -> None:
        """Slot ``slot`` has a new buffer."""

    def close(self) -> None:
        """The writer is done with its buffers (its runner was shut down)."""
