"""The writer core: what every writer does with a save, whatever runs it.

A save is an engine take (planned in the caller; a name that holds a snapshot is replaced crash-safely, see
``_replace``) or a single file written by a ``savefun`` (``_files``), handed as one unit of work to the writer's
:class:`~ppe_snapshot.writing._runners.Runner`. The core has ``depth`` slots (the runner's): a save takes a free
slot (waiting for the oldest save in flight when none is free); when the runner is ``background`` (it returns
before the work ended), the save is staged in the caller into the slot's buffer (``_buffers``, allocated once
and grown only when a snapshot needs more; the buffer is handed to the engine), else the work reads the live
state in the caller. When the work ends, the core records its stats or its failure, runs the post-save hooks and
frees the slot. A background failure is raised at the next save, :meth:`WriterCore.wait` or
:meth:`WriterCore.finalize`; :attr:`WriterCore.last_save` tells another thread when the last save ended and how.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch

from ppe_snapshot.engine import StateDict, TakeJob, check_base, gc_paused, group_rank, prepare_take, staging_estimate
from ppe_snapshot.settings import SETTINGS
from ppe_snapshot.writing import _replace
from ppe_snapshot.writing._errors import add_note, surfaced
from ppe_snapshot.writing._files import FileSave, StagedObject
from ppe_snapshot.writing._replace import AfterCommit
from ppe_snapshot.writing._runners import FileWork, Runner, TakeWork, Work
from ppe_snapshot.writing.contract import ImageLoan


logger = logging.getLogger(__name__)


@dataclass
class _Ticket:
    """One save handed to the runner: its slot, its stats, when the caller's call began and the hand-over."""
    slot: int
    stats: dict[str, Any]
    start: float
    handoff: float = 0.0
    #: An engine snapshot (else a single file written by a savefun).
    take: bool = False
    #: Done once the save ended (committed and its hooks run), with its failure as the exception.
    ended: "Future[None]" = field(default_factory=Future)


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
    busy: bool = False
    path: str | None = None  # where the save in this slot goes
    lent: bool = False  # its buffer's image is lent out (see WriterCore.lend_next_image): not staged into


class WriterCore:
    """Saves through ``runner``; ``after_save()`` runs after each committed save (the post-save hooks)."""

    def __init__(self, runner: Runner, *, storage_options: dict[str, Any] | None,
                 after_save: Callable[[], None], name: str) -> None:
        self.runner = runner
        self.storage_options = storage_options
        self._after_save = after_save
        self._name = name  # the writer's class, as messages name it
        #: ``blocking_s``, ``write_s`` (None until the write ends), ``bytes`` and ``path`` of the last save.
        self.last_stats: dict[str, Any] = {}
        #: The end of the last save: done once it was committed and its hooks ran, its exception the failure
        #: (None before the first save).
        self.last_save: Future[None] | None = None
        self._slots = [_Slot() for _ in range(runner.depth)]
        self._buffers = runner.buffers()
        self._failures: deque[BaseException] = deque()
        self._cond = threading.Condition()
        self.closed = False
        #: Incremental saves: each references the unchanged blocks of :attr:`base`, the snapshot this writer
        #: committed last (or the one autoload resumed from), when it lies beside the new one.
        self.incremental = False
        self.base: str | None = None
        self._loan: ImageLoan | None = None

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
            job.moved_after_commit = job.storage.url == _replace.side_name(asked)
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
        loan, self._loan = self._loan, None
        slot = self._acquire()
        try:
            self._claim_path(slot, path)  # a save to the same name in flight must end before it is replaced
            if incremental:  # its base is the save before it, committed (and retention done with)
                self._wait_for_saves(besides=slot)
            self._hand_take(slot, path, state, metadata, pg, allow_pickle, start, incremental, loan)
        except BaseException:
            self._release(slot)
            raise

    @gc_paused()  # the take's objects are handed over or gone with the locals before the collector runs again
    def _hand_take(self, slot: int, path: str, state: dict[str, Any], metadata: dict[str, Any] | None, pg: Any,
                   allow_pickle: bool, start: float, incremental: bool, loan: ImageLoan | None) -> None:
        job, step = self.prepare(path, state, metadata, pg, allow_pickle, incremental)
        stats = _stats(path, job.layout.size)
        if self.runner.background:
            began = time.perf_counter()
            try:
                buffer = self._buffers.get(slot, job.layout.size, job.layout.on_cuda())
            except BaseException as e:
                job.conclude(e)  # several ranks: the others hear of it rather than wait
                raise
            image = job.stage(buffer, keep_image=loan is not None)
            stats["staging_s"] = time.perf_counter() - began
            if loan is not None and image is not None:
                with self._cond:
                    self._slots[slot].lent = True
                loan.lend(image, partial(self._end_loan, slot))
        self._hand_over(_Ticket(slot, stats, start, take=True), TakeWork(slot, path, job, step))

    def save_file(self, save: FileSave, target: Any, start: float) -> None:
        """A single file written by ``save``'s savefun."""
        slot = self._acquire()
        try:
            work = FileWork(slot, save.dest, save, target)
            if self.runner.background:
                staged = StagedObject(target)
                work.buffer = self._buffers.get(slot, staged.size, staged.on_cuda)
                work.value = staged.copy_into(work.buffer)
            self._hand_over(_Ticket(slot, _stats(save.dest, None), start), work)
        except BaseException:
            self._release(slot)
            raise

    def _hand_over(self, ticket: _Ticket, work: Work) -> None:
        """Give ``work`` to the runner; the caller is blocked until then, or, in the caller, until it ended."""
        ticket.handoff = time.perf_counter()
        if self.runner.background:
            self._publish(ticket, ticket.handoff)
        self.runner.run(work, partial(self._finish, ticket))
        self.last_save = ticket.ended

    def _publish(self, ticket: _Ticket, unblocked: float) -> None:
        """Make ``ticket``'s stats the last ones, the caller blocked until ``unblocked``."""
        ticket.stats["blocking_s"] = unblocked - ticket.start
        self.last_stats = ticket.stats

    # -- slots and their buffers ----------------------------------------------------------

    def prepare_staging(self, state: Any) -> None:
        """Have the staging buffer of a save of ``state`` ready before that save (made in the background); nothing
        for a runner that saves in the caller."""
        if self.runner.background and not self.closed:
            nbytes, on_cuda = staging_estimate(state)
            self._buffers.reserve(nbytes, on_cuda)

    @property
    def staging_buffers(self) -> tuple[torch.Tensor | None, ...]:
        return self._buffers.all

    @property
    def in_flight(self) -> int:
        with self._cond:
            return sum(slot.busy for slot in self._slots)

    def lend_next_image(self) -> ImageLoan | None:
        """Lend the staged image of the next engine save (:class:`~ppe_snapshot.writing.ImageLoan`): its slot is
        not staged into again until the loan is released. None when this writer's runner stages nothing."""
        if not self.runner.background:
            return None
        loan = self._loan = ImageLoan(lambda: self._forget_loan(loan))
        return loan

    def _forget_loan(self, loan: ImageLoan) -> None:
        if self._loan is loan:
            self._loan = None

    def _end_loan(self, number: int) -> None:
        with self._cond:
            self._slots[number].lent = False
            self._cond.notify_all()

    def _acquire(self) -> int:
        """A free slot (neither in flight nor lent), after waiting for the oldest save if none is; raises a
        background failure first."""
        with self._cond:
            number = None
            while number is None:
                self._raise_failure()
                number = next((n for n, slot in enumerate(self._slots) if not slot.busy and not slot.lent), None)
                if number is None:
                    self._cond.wait()
            self._slots[number].busy = True
        try:
            self.runner.before_save()
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

    def _raise_failure(self) -> None:
        """Raise the oldest background failure not raised yet (call holding ``_cond``)."""
        if self._failures:
            error = self._failures.popleft()
            raise surfaced(error) from error

    def _finish(self, ticket: _Ticket, error: BaseException | None, nbytes: int | None) -> None:
        """A save ended: record its stats, run the post-save hooks, record its failure, free the slot. In the
        caller (the runner is not ``background``), a hook's failure is raised there."""
        stats, ended = ticket.stats, time.perf_counter()
        stats["write_s"] = ended - ticket.handoff
        if nbytes is not None:
            stats["bytes"] = nbytes
        if not self.runner.background:
            self._publish(ticket, ended)
        if error is None:
            if ticket.take:
                self.base = stats["path"]
            try:
                self._after_save()
            except BaseException as e:
                if not self.runner.background:
                    raise
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
        """Wait for the saves in flight, then shut the runner down (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.wait()
        finally:
            self.runner.shutdown()
            if self._loans_ended():
                self._buffers.close()
            while self._failures:
                logger.error("another background save failed: %r", self._failures.popleft())

    def _loans_ended(self) -> bool:
        """Wait for the images lent out to come back; False (a warning: their buffers are left open) when one
        did not within the commit timeout."""
        with self._cond:
            if self._cond.wait_for(lambda: not any(slot.lent for slot in self._slots), SETTINGS.commit_timeout):
                return True
        logger.warning("%s: a staged image lent out was not given back within %s s; its buffer stays open",
                       self._name, SETTINGS.commit_timeout)
        return False


def _stats(path: str, nbytes: int | None) -> dict[str, Any]:
    return {"path": path, "bytes": nbytes, "blocking_s": None, "write_s": None}


def _log_done(stats: dict[str, Any]) -> None:
    logger.info("saved %s: %s bytes, caller blocked %.3f s, written in %.3f s",
                stats["path"], stats["bytes"], stats["blocking_s"], stats["write_s"])
