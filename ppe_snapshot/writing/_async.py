"""What the background writers share: staging slots, in-flight saves, failures, shutdown.

A writer has ``queue_depth`` slots, each with its own staging buffer that is
allocated once and grown only when a snapshot needs more. A call takes a free
slot (waiting for the oldest save in flight when none is free), stages the
state into the slot's buffer in the caller, and hands the save to the
background, which writes, commits, runs the post-save hooks and frees the slot.
"""
from __future__ import annotations

import multiprocessing.util
import os
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ppe_snapshot.engine import TakeJob, new_staging_buffer
from ppe_snapshot.errors import SnapshotAbortedError, SnapshotError
from ppe_snapshot.writing._base import WriterBase, add_note, logger
from ppe_snapshot.writing._files import FileSave, stage_object
from ppe_snapshot.writing._replace import AfterCommit

_MiB = 1 << 20


def grown_size(current: int, needed: int) -> int:
    """Bytes for a new staging buffer: what is needed, with headroom once a buffer had to grow."""
    size = max(needed, current + current // 4) if current else needed
    return max(_MiB, -(-size // _MiB) * _MiB)


class BackgroundSaveError(SnapshotError, RuntimeError):
    """A save that ran in the background failed; raised at the writer's next call, ``wait()`` or ``finalize()``.

    A ``RuntimeError``, as ppe's writers raise for a failed worker. The
    original exception is the ``__cause__``; the message holds its traceback
    from the thread or worker process that ran the save.
    """


class BackgroundAbortError(BackgroundSaveError, SnapshotAbortedError):
    """A save of several ranks that ran in the background was aborted because another rank failed or died:
    both a :class:`BackgroundSaveError` and a :class:`~ppe_snapshot.errors.SnapshotAbortedError`."""


def surfaced(error: BaseException) -> BackgroundSaveError:
    """The error to raise in the caller for a background ``error``; raise it ``from error``."""
    if isinstance(error, BackgroundSaveError):
        return error
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip()
    if sys.version_info < (3, 11):  # the notes (the worker's traceback among them) are not printed there
        text = "\n".join([text, *getattr(error, "__notes__", [])])
    kind = BackgroundAbortError if isinstance(error, SnapshotAbortedError) else BackgroundSaveError
    return kind(f"a snapshot save failed in the background: {type(error).__name__}: {error}\n{text}")


@dataclass
class Ticket:
    """One save handed to the background."""
    slot: int
    stats: dict[str, Any]
    handoff: float = 0.0


def _finalize_at_exit(ref: "weakref.ref[AsyncWriter]") -> None:
    writer = ref()
    if writer is None:
        return
    try:
        writer.finalize()
    except BaseException:  # nobody is left to raise it to
        logger.exception("a background save failed and was never reported; it surfaced at interpreter exit")


class AsyncWriter(WriterBase):
    """Base of the writers that write in the background; see the subclasses."""

    def __init__(self, savefun: Callable[..., Any] | None = None, fs: Any = None, out_dir: str = "", *,
                 queue_depth: int = 1, **kwds: Any) -> None:
        if isinstance(queue_depth, bool) or not isinstance(queue_depth, int) or queue_depth < 1:
            raise ValueError("queue_depth is the number of saves in flight, each holding its own staging "
                             f"buffer: an int >= 1; got {queue_depth!r}")
        super().__init__(savefun, fs, out_dir, **kwds)
        self._buffers: list[torch.Tensor | None] = [None] * queue_depth
        self._pinned = [False] * queue_depth
        self._busy = [False] * queue_depth
        self._paths: list[str | None] = [None] * queue_depth  # where each busy slot saves
        self._failures: deque[BaseException] = deque()
        self._cond = threading.Condition()
        self._owner = os.getpid()
        # Runs at interpreter exit before multiprocessing stops daemonic children: saves in flight complete.
        self._exit_finalizer = multiprocessing.util.Finalize(
            self, _finalize_at_exit, args=(weakref.ref(self),), exitpriority=100)

    @property
    def staging_buffers(self) -> tuple[torch.Tensor | None, ...]:
        """The staging buffers, one per slot (None until first used); for inspection."""
        return tuple(self._buffers)

    @property
    def in_flight(self) -> int:
        """How many saves were handed over (or are being staged) and have not ended yet."""
        with self._cond:
            return sum(self._busy)

    # -- the caller's side ---------------------------------------------------
    def _take(self, path: str, app_state: dict[str, Any], metadata: dict[str, Any] | None, pg: Any,
              allow_pickle: bool, start: float) -> None:
        slot = self._acquire()
        try:
            self._claim_path(slot, path)  # a save to the same name in flight must end before it is replaced
            job, step = self._prepare(path, app_state, metadata, pg, allow_pickle)
            pin = job.layout.on_cuda()
            began = time.perf_counter()
            job.stage(lambda nbytes: self._buffer(slot, nbytes, pin))
            stats = self._new_stats(path, start, job.layout.size)
            stats["staging_s"] = time.perf_counter() - began
            self._submit_take(Ticket(slot, stats), job, step)
        except BaseException:
            self._release(slot)
            raise

    def _save_file(self, save: FileSave, target: Any, start: float) -> None:
        slot = self._acquire()
        try:
            skeleton = stage_object(target, lambda nbytes, pin: self._buffer(slot, nbytes, pin))
            self._submit_file(Ticket(slot, self._new_stats(save.dest, start, None)), save, skeleton)
        except BaseException:
            self._release(slot)
            raise

    def _acquire(self) -> int:
        """A free slot, after waiting for the oldest save if none is; raises a background failure first."""
        with self._cond:
            while True:
                self._raise_failure()
                for slot, busy in enumerate(self._busy):
                    if not busy:
                        self._busy[slot] = True
                        return slot
                self._cond.wait()

    def _claim_path(self, slot: int, path: str) -> None:
        with self._cond:
            while any(busy and p == path for busy, p in zip(self._busy, self._paths)):
                self._cond.wait()
            self._raise_failure()
            self._paths[slot] = path

    def _raise_failure(self) -> None:
        """Raise the oldest background failure not raised yet (call holding ``_cond``)."""
        if self._failures:
            error = self._failures.popleft()
            raise surfaced(error) from error

    def _release(self, slot: int) -> None:
        with self._cond:
            self._busy[slot] = False
            self._paths[slot] = None
            self._cond.notify_all()

    def _buffer(self, slot: int, nbytes: int, pin: bool) -> torch.Tensor:
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < nbytes or (pin and not self._pinned[slot]):
            size = grown_size(0 if buffer is None else buffer.numel(), nbytes)
            self._buffers[slot] = None
            if buffer is not None:
                self._drop_buffer(buffer)
            buffer = self._allocate(size, pin)
            self._buffers[slot], self._pinned[slot] = buffer, pin
            self._buffer_changed(slot, buffer)
        return buffer

    # -- hooks for the subclasses ----------------------------------------------
    def _allocate(self, nbytes: int, pin: bool) -> torch.Tensor:
        return new_staging_buffer(nbytes, pin)  # page-aligned: O_DIRECT writes it without a bounce copy

    def _drop_buffer(self, buffer: torch.Tensor) -> None:
        """A buffer is being replaced by a bigger one."""

    def _buffer_changed(self, slot: int, buffer: torch.Tensor) -> None:
        """A slot has a new buffer."""

    def _submit_take(self, ticket: Ticket, job: TakeJob, step: AfterCommit) -> None:
        raise NotImplementedError

    def _submit_file(self, ticket: Ticket, save: FileSave, skeleton: Any) -> None:
        raise NotImplementedError

    def _shutdown(self) -> None:
        """Stop the background once nothing is in flight."""

    # -- the background's side -------------------------------------------------
    def _finish(self, ticket: Ticket, error: BaseException | None, nbytes: int | None) -> None:
        """A save ended: run the post-save hooks, record stats or the failure, free the slot."""
        stats = ticket.stats
        stats["write_s"] = time.perf_counter() - ticket.handoff
        if nbytes is not None:
            stats["bytes"] = nbytes
        if error is None:
            try:
                self._post_save()
            except BaseException as e:
                add_note(e, f"raised by a post-save hook after {stats['path']} was committed")
                error = e
            else:
                self._log_done(stats)
        if error is not None:
            add_note(error, f"ppe_snapshot: {type(self).__name__} failed to save {stats['path']} in the background")
            logger.error("saving %s failed in the background (raised at the next call, wait() or finalize()): %r",
                         stats["path"], error)
        with self._cond:
            if error is not None:
                self._failures.append(error)
            self._busy[ticket.slot] = False
            self._paths[ticket.slot] = None
            self._cond.notify_all()

    # -- waiting and shutting down -------------------------------------------------
    def wait(self) -> None:
        """Block until every save in flight is committed and its hooks ran.

        Raises :class:`BackgroundSaveError` (a ``RuntimeError``) for a save that failed.
        """
        with self._cond:
            while any(self._busy):
                self._cond.wait()
            self._raise_failure()

    def finalize(self) -> None:
        """Wait for the saves in flight, then shut the background down (idempotent)."""
        if self._finalized or os.getpid() != self._owner:  # a forked child does not own the background
            return
        self._finalized = True
        try:
            self.wait()
        finally:
            self._exit_finalizer.cancel()
            self._shutdown()
            while self._failures:
                logger.error("another background save failed: %r", self._failures.popleft())

    def __del__(self) -> None:
        if "_cond" not in self.__dict__:  # __init__ did not get that far
            return
        try:
            self.finalize()
        except BaseException:
            logger.exception("a background save failed and was never reported; "
                             "it surfaced when its writer was garbage-collected")
