"""The writer core: what every writer does with a save, whatever runs it.

A save is an engine take (planned in the caller; a name that holds a snapshot is replaced crash-safely, see
``_replace``) or a single file written by a ``savefun`` (``_files``). Where the write runs is the
:class:`~ppe_snapshot.writing._executors.Executor`'s: in the caller (the take is written from the live tensors),
or in the background. A background executor has ``depth`` slots, each with its own staging buffer, allocated
once and grown only when a snapshot needs more: a save takes a free slot (waiting for the oldest save in flight
when none is free), is staged into the slot's buffer in the caller (the buffer is handed to the engine), and is
handed to the executor; when it ends, the core records its stats or its failure, runs the post-save hooks and
frees the slot. A failure is raised at the next save, :meth:`WriterCore.wait` or :meth:`WriterCore.finalize`;
:attr:`WriterCore.last_save` tells another thread when the last save ended and how.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ppe_snapshot.engine import StateDict, TakeJob, check_base, gc_paused, group_rank, prepare_take
from ppe_snapshot.writing import _replace
from ppe_snapshot.writing._errors import add_note, surfaced
from ppe_snapshot.writing._executors import Executor, Ticket
from ppe_snapshot.writing._files import FileSave, StagedObject
from ppe_snapshot.writing._replace import AfterCommit

logger = logging.getLogger(__name__)

_MiB = 1 << 20


def grown_size(current: int, needed: int) -> int:
    """Bytes for a new staging buffer: what is needed, with headroom once a buffer had to grow."""
    size = max(needed, current + current // 4) if current else needed
    return max(_MiB, -(-size // _MiB) * _MiB)


class _Value:
    """Any other target a ppe writer would torch.save (a tensor, a list, a string): stored as the
    snapshot's ``"state"`` entry as it is (``Snapshot(path).read_object("0/state")`` reads it back)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, value: Any) -> None:
        self.value = value


def app_state(target: Any, append: bool, extra_state: Mapping[str, Any] | None) -> dict[str, Any]:
    """What an engine snapshot of ``target`` holds: the target as ``"state"``, and ``extra_state``."""
    if append:
        raise ValueError("append=True needs a savefun: an engine snapshot is a directory, it cannot be appended to")
    if extra_state and "state" in extra_state:
        raise ValueError('extra_state cannot use the key "state": it holds the target')
    state = StateDict(target) if isinstance(target, Mapping) else _Value(target)
    return {"state": state, **(extra_state or {})}


@dataclass
class _Slot:
    buffer: torch.Tensor | None = None
    pinned: bool = False
    busy: bool = False
    path: str | None = None  # where the save in this slot goes


class WriterCore:
    """Saves through ``executor``; ``after_save()`` runs after each committed save (the post-save hooks)."""

    def __init__(self, executor: Executor, *, storage_options: dict[str, Any] | None,
                 after_save: Callable[[], None], name: str) -> None:
        self.executor = executor
        self.storage_options = storage_options
        self._after_save = after_save
        self._name = name  # the writer's class, as messages name it
        #: ``blocking_s``, ``write_s`` (None until the write ends), ``bytes`` and ``path`` of the last save.
        self.last_stats: dict[str, Any] = {}
        #: The end of the last save: done once it was committed and its hooks ran, its exception the failure
        #: (None before the first save).
        self.last_save: Future[None] | None = None
        self._slots = [_Slot() for _ in range(executor.depth)]
        self._failures: deque[BaseException] = deque()
        self._cond = threading.Condition()
        self.closed = False
        #: Incremental saves: each references the unchanged blocks of :attr:`base`, the snapshot this writer
        #: committed last (or the one autoload resumed from), when it lies beside the new one.
        self.incremental = False
        self.base: str | None = None

    # -- what a save is --------------------------------------------------------------
    def prepare(self, path: str, state: dict[str, Any], metadata: dict[str, Any] | None, pg: Any,
                allow_pickle: bool, incremental: bool = False) -> tuple[TakeJob, AfterCommit]:
        """The take job, and the step after its commit that gives the snapshot its name when it replaces one.

        Rank 0 of ``pg`` decides where the take goes (every rank follows it in
        ``prepare_take``) and is the one that moves the committed snapshot.
        """
        replacement, asked = None, path
        base = self._base_for(path) if incremental else None
        if group_rank(pg)[0] == 0:
            path, replacement = _replace.plan(path, self.storage_options)
        job = prepare_take(path, state, pg=pg, storage_options=self.storage_options, allow_pickle=allow_pickle,
                           metadata=metadata, base=base)
        if job.storage.url != asked:  # it replaces a snapshot (every rank follows rank 0's path), which its base
            job.base = None           # may read: a full save
        return job, _replace.after_commit(job, replacement)

    def _base_for(self, path: str) -> str | None:
        """The base of an incremental save to ``path``: :attr:`base` where it lies beside it and is not at
        ``path`` (a save replacing a snapshot is never incremental: its base may read the one replaced)."""
        if self.base is None:
            return None
        try:
            check_base(self.base, path)
        except ValueError:  # elsewhere, or at the name being saved: this save is a full one
            return None
        return self.base

    def take(self, path: str, state: dict[str, Any], metadata: dict[str, Any] | None, pg: Any,
             allow_pickle: bool, start: float, incremental: bool = False) -> None:
        """An engine snapshot of ``state`` at ``path``; ``start``: when the caller's call began (for the stats);
        ``incremental``: referencing the unchanged blocks of :attr:`base`."""
        if not self.executor.background:
            self._take_in_caller(path, state, metadata, pg, allow_pickle, start, incremental)
            return
        slot = self._acquire()
        try:
            self._claim_path(slot, path)  # a save to the same name in flight must end before it is replaced
            if incremental:  # its base is the save before it, committed (and retention done with)
                self._wait_for_saves(besides=slot)
            job, step = self.prepare(path, state, metadata, pg, allow_pickle, incremental)
            began = time.perf_counter()
            try:
                buffer = self._buffer(slot, job.layout.size, job.layout.on_cuda())
            except BaseException as e:
                job.conclude(e)  # several ranks: the others hear of it rather than wait
                raise
            job.stage(buffer)
            stats = self._new_stats(path, start, job.layout.size)
            stats["staging_s"] = time.perf_counter() - began
            ticket = Ticket(slot, stats, take=True)
            self.executor.submit_take(ticket, job, step, self._finish)
            self.last_save = ticket.ended
        except BaseException:
            self._release(slot)
            raise

    @gc_paused()  # the caller waits; the take's objects go with the locals before the collector runs again
    def _take_in_caller(self, path: str, state: dict[str, Any], metadata: dict[str, Any] | None, pg: Any,
                        allow_pickle: bool, start: float, incremental: bool) -> None:
        job, step = self.prepare(path, state, metadata, pg, allow_pickle, incremental)
        began = time.perf_counter()
        written = _replace.commit_in_place(job, step)
        self.base = path
        self._done_in_caller(path, start, began, written)

    def save_file(self, save: FileSave, target: Any, start: float) -> None:
        """A single file written by ``save``'s savefun."""
        if not self.executor.background:
            began = time.perf_counter()
            nbytes = save.run(target)
            self._done_in_caller(save.dest, start, began, nbytes)
            return
        slot = self._acquire()
        try:
            staged = StagedObject(target)
            buffer = self._buffer(slot, staged.size, staged.on_cuda)
            skeleton = staged.copy_into(buffer)
            ticket = Ticket(slot, self._new_stats(save.dest, start, None))
            self.executor.submit_file(ticket, save, skeleton, buffer, self._finish)
            self.last_save = ticket.ended
        except BaseException:
            self._release(slot)
            raise

    def _done_in_caller(self, path: str, start: float, began: float, nbytes: int | None) -> None:
        stats = self._new_stats(path, start, nbytes)
        stats["write_s"] = time.perf_counter() - began
        _log_done(stats)
        self._after_save()
        self.last_save = Future()
        self.last_save.set_result(None)

    def _new_stats(self, path: str, start: float, nbytes: int | None) -> dict[str, Any]:
        stats = {"path": path, "bytes": nbytes, "blocking_s": time.perf_counter() - start, "write_s": None}
        self.last_stats = stats
        return stats

    # -- slots and their buffers ----------------------------------------------------------
    @property
    def staging_buffers(self) -> tuple[torch.Tensor | None, ...]:
        return tuple(slot.buffer for slot in self._slots)

    @property
    def in_flight(self) -> int:
        with self._cond:
            return sum(slot.busy for slot in self._slots)

    def _acquire(self) -> int:
        """A free slot, after waiting for the oldest save if none is; raises a background failure first."""
        with self._cond:
            number = None
            while number is None:
                self._raise_failure()
                number = next((n for n, slot in enumerate(self._slots) if not slot.busy), None)
                if number is None:
                    self._cond.wait()
            self._slots[number].busy = True
        try:
            self.executor.before_save()
        except BaseException:
            self._release(number)
            raise
        return number

    def _claim_path(self, number: int, path: str) -> None:
        with self._cond:
            while any(slot.busy and slot.path == path for slot in self._slots):
                self._cond.wait()
            self._raise_failure()
            self._slots[number].path = path

    def _wait_for_saves(self, besides: int | None = None) -> None:
        """Block until every save in flight but the one in slot ``besides`` is committed and its hooks ran; raise
        a save's failure."""
        with self._cond:
            while any(slot.busy for n, slot in enumerate(self._slots) if n != besides):
                self._cond.wait()
            self._raise_failure()

    def _release(self, number: int) -> None:
        with self._cond:
            self._slots[number].busy, self._slots[number].path = False, None
            self._cond.notify_all()

    def _buffer(self, number: int, nbytes: int, pin: bool) -> torch.Tensor:
        slot = self._slots[number]
        if slot.buffer is None or slot.buffer.numel() < nbytes or (pin and not slot.pinned):
            old, slot.buffer = slot.buffer, None
            if old is not None:
                self.executor.drop_buffer(old)
            slot.buffer = self.executor.allocate(grown_size(0 if old is None else old.numel(), nbytes), pin)
            slot.pinned = pin
            self.executor.buffer_changed(number, slot.buffer)
        return slot.buffer

    def _raise_failure(self) -> None:
        """Raise the oldest background failure not raised yet (call holding ``_cond``)."""
        if self._failures:
            error = self._failures.popleft()
            raise surfaced(error) from error

    def _finish(self, ticket: Ticket, error: BaseException | None, nbytes: int | None) -> None:
        """A background save ended: run the post-save hooks, record stats or the failure, free the slot."""
        stats = ticket.stats
        stats["write_s"] = time.perf_counter() - ticket.handoff
        if nbytes is not None:
            stats["bytes"] = nbytes
        if error is None:
            if ticket.take:
                self.base = stats["path"]
            try:
                self._after_save()
            except BaseException as e:
                add_note(e, f"raised by a post-save hook after {stats['path']} was committed")
                error = e
            else:
                _log_done(stats)
        if error is not None:
            add_note(error, f"ppe_snapshot: {self._name} failed to save {stats['path']} in the background")
            logger.error("saving %s failed in the background (raised at the next call, wait() or finalize()): %r",
                         stats["path"], error)
        with self._cond:
            if error is not None:
                self._failures.append(error)
            self._slots[ticket.slot].busy, self._slots[ticket.slot].path = False, None
            self._cond.notify_all()
        if error is None:
            ticket.ended.set_result(None)
        else:
            ticket.ended.set_exception(error)

    # -- waiting and shutting down --------------------------------------------------------
    def wait(self) -> None:
        """Block until every save in flight is committed and its hooks ran; raise a save's failure."""
        self._wait_for_saves()

    def finalize(self) -> None:
        """Wait for the saves in flight, then shut the executor down (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.wait()
        finally:
            self.executor.shutdown()
            while self._failures:
                logger.error("another background save failed: %r", self._failures.popleft())


def _log_done(stats: dict[str, Any]) -> None:
    logger.info("saved %s: %s bytes, caller blocked %.3f s, written in %.3f s",
                stats["path"], stats["bytes"], stats["blocking_s"], stats["write_s"])
