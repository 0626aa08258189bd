"""Where a writer's saves run: in the caller, in a new thread per save, or in one long-lived thread.

The :class:`~ppe_snapshot.writing._core.WriterCore` stages a background save into a slot's buffer, allocated
by the executor (``allocate``), and hands the executor the work with a ``finish(ticket, error, nbytes)`` to call
once the save ended. The worker process is an executor too (``_process.WorkerProcess``).
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ppe_snapshot.engine import TakeJob, new_staging_buffer
from ppe_snapshot.writing._files import FileSave, materialize
from ppe_snapshot.writing._replace import AfterCommit, commit_in_place


@dataclass
class Ticket:
    """One save handed to the background: its slot, its stats, when it was handed over."""
    slot: int
    stats: dict[str, Any]
    handoff: float = 0.0
    #: An engine snapshot (else a single file written by a savefun).
    take: bool = False
    #: Done once the save ended (committed and its hooks run), with its failure as the exception.
    ended: "Future[None]" = field(default_factory=Future)


#: What an executor calls once a save ended: ``finish(ticket, error or None, bytes written or None)``.
Finish = Callable[[Ticket, "BaseException | None", "int | None"], None]


class Executor:
    """Runs the saves of one writer. This one runs them in the caller (``background`` False): the core writes
    an engine snapshot from the live tensors, with no staging copy, and never calls ``submit_*``."""

    #: Whether saves are staged and handed over (else the core writes them in the caller).
    background = False

    def __init__(self, depth: int = 1) -> None:
        #: Saves that may be in flight at once, each staged into its own buffer.
        self.depth = depth

    def check_path(self, path: str) -> None:
        """Raise when this executor cannot save at ``path``."""

    def before_save(self) -> None:
        """A background save is about to be staged (e.g. restart a worker process that died)."""

    def allocate(self, nbytes: int, pin: bool) -> torch.Tensor:
        """A staging buffer of ``nbytes`` (page-aligned: O_DIRECT writes it without a bounce copy)."""
        return new_staging_buffer(nbytes, pin)

    def drop_buffer(self, buffer: torch.Tensor) -> None:
        """A slot's buffer is being replaced by a bigger one."""

    def buffer_changed(self, slot: int, buffer: torch.Tensor) -> None:
        """Slot ``slot`` has a new buffer."""

    def submit_take(self, ticket: Ticket, job: TakeJob, step: AfterCommit, finish: Finish) -> None:
        raise NotImplementedError

    def submit_file(self, ticket: Ticket, save: FileSave, skeleton: Any, buffer: torch.Tensor,
                    finish: Finish) -> None:
        """Write the single file of ``skeleton``, whose tensors are staged in ``buffer`` (the slot's)."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop once nothing is in flight (the core waited for that)."""


class _InThisProcess(Executor):
    """A background in a thread of this process."""

    background = True

    def submit_take(self, ticket: Ticket, job: TakeJob, step: AfterCommit, finish: Finish) -> None:
        self._hand_off(ticket, lambda: commit_in_place(job, step), finish)

    def submit_file(self, ticket: Ticket, save: FileSave, skeleton: Any, buffer: torch.Tensor,
                    finish: Finish) -> None:
        self._hand_off(ticket, lambda: save.run(materialize(skeleton, buffer)), finish)

    def _hand_off(self, ticket: Ticket, work: Callable[[], int | None], finish: Finish) -> None:
        ticket.handoff = time.perf_counter()
        self._dispatch(lambda: _run(ticket, work, finish))

    def _dispatch(self, call: Callable[[], None]) -> None:
        raise NotImplementedError


def _run(ticket: Ticket, work: Callable[[], int | None], finish: Finish) -> None:
    try:
        nbytes = work()
    except BaseException as e:  # reported by finish, raised later in the caller
        finish(ticket, e, None)
    else:
        finish(ticket, None, nbytes)


class ThreadPerSave(_InThisProcess):
    """Each save in a new thread; one in flight."""

    def _dispatch(self, call: Callable[[], None]) -> None:
        # Not a daemon: the interpreter lets a save in flight finish before it exits.
        threading.Thread(target=call, name="ppe-snapshot-writer").start()


def _consume(calls: "queue.SimpleQueue[Callable[[], None] | None]") -> None:
    while (call := calls.get()) is not None:
        call()
        del call  # hold no reference to the writer between saves


class OneThread(_InThisProcess):
    """One long-lived thread, fed by a queue: up to ``depth`` saves in flight, written one after the other."""

    def __init__(self, depth: int = 1) -> None:
        super().__init__(depth)
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._consumer = threading.Thread(target=_consume, args=(self._calls,), name="ppe-snapshot-writer",
                                          daemon=True)
        self._consumer.start()

    def _dispatch(self, call: Callable[[], None]) -> None:
        self._calls.put(call)

    def shutdown(self) -> None:
        self._calls.put(None)
        if self._consumer is not threading.current_thread():
            self._consumer.join()
