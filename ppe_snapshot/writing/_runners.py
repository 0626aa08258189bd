"""What runs a writer's saves: a :class:`Runner`, given each save as a unit of :class:`Work` by ``run``.

The writer core (``_core``) plans a save, stages it into a buffer of its own (``_buffers``) when the runner runs
it after the call returned (``background``), and hands it to :meth:`Runner.run` with an ``on_done(error, nbytes)``
to call once it ended. Runners: :class:`InCaller`, :class:`ThreadPerSave`, :class:`OneThread`, and the worker
process (``_process.WorkerProcess``). Adding one: "Adding a writer" in docs/architecture.md.
"""
from __future__ import annotations

import abc
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ppe_snapshot.engine import TakeJob
from ppe_snapshot.writing._buffers import StagingBuffers
from ppe_snapshot.writing._files import FileSave, materialize
from ppe_snapshot.writing._replace import AfterCommit, commit_in_place

#: What a runner calls once a unit of work ended: ``on_done(error or None, bytes written or None)``.
OnDone = Callable[[BaseException | None, "int | None"], None]


@dataclass
class Work(metaclass=abc.ABCMeta):
    """One save, ready to run: calling it writes (and commits) it in this process and returns the bytes written."""
    #: The slot whose staging buffer holds the save's state (when it was staged).
    slot: int
    #: Where the save goes, as messages name it.
    path: str

    @abc.abstractmethod
    def __call__(self) -> int:
        """Write the save here; the bytes written."""


@dataclass
class TakeWork(Work):
    """An engine take: write and commit ``job``, then run ``step`` (``_replace.after_commit``)."""
    job: TakeJob
    step: AfterCommit

    def __call__(self) -> int:
        return commit_in_place(self.job, self.step)


@dataclass
class FileWork(Work):
    """A single file written by ``save``'s savefun: of ``value`` as it is, or, with a ``buffer``, of the object
    whose tensors were staged there (``value`` is then its skeleton, see ``_files.StagedObject``)."""
    save: FileSave
    value: Any
    buffer: torch.Tensor | None = None

    def __call__(self) -> int:
        return self.save.run(self.value if self.buffer is None else materialize(self.value, self.buffer))


def run_to_end(work: Work, on_done: OnDone) -> None:
    """Run ``work`` here and tell ``on_done`` how it ended (what a background runner's thread does)."""
    try:
        nbytes = work()
    except BaseException as e:  # reported by on_done, raised later in the caller
        on_done(e, None)
    else:
        on_done(None, nbytes)


class Runner(metaclass=abc.ABCMeta):
    """Runs the saves of one writer: ``depth`` saves may be in flight at once (``writer``: its class name, for
    messages)."""

    #: Whether :meth:`run` returns before the work ended: the core then stages the state into a buffer of its
    #: own for the work to read, and a failure is raised at the writer's next call, ``wait()`` or
    #: ``finalize()``. Else the work runs in the caller, from the live state, and raises there.
    background = True

    def __init__(self, depth: int = 1, writer: str = "") -> None:
        self.depth = depth
        self.writer = writer

    @abc.abstractmethod
    def run(self, work: Work, on_done: OnDone) -> None:
        """Run ``work``, then call ``on_done`` (from any thread). A runner that is not ``background`` runs it
        before it returns and lets a failure of ``work`` propagate."""

    def buffers(self) -> StagingBuffers:
        """The staging buffers of its ``depth`` slots (asked once, by the core)."""
        return StagingBuffers(self.depth)

    def check_path(self, path: str) -> None:
        """Raise when this runner cannot save at ``path``."""

    def before_save(self) -> None:
        """A save is about to be staged (e.g. restart a worker process that died)."""

    def shutdown(self) -> None:
        """Stop once nothing is in flight (the core waited for that)."""


class InCaller(Runner):
    """Runs each save in the caller: the take is written from the live tensors, with no staging copy."""

    background = False

    def run(self, work: Work, on_done: OnDone) -> None:
        on_done(None, work())


class ThreadPerSave(Runner):
    """Each save in a new thread."""

    def run(self, work: Work, on_done: OnDone) -> None:
        # Not a daemon: the interpreter lets a save in flight finish before it exits.
        threading.Thread(target=run_to_end, args=(work, on_done), name="ppe-snapshot-writer").start()


def _consume(calls: "queue.SimpleQueue[tuple[Work, OnDone] | None]") -> None:
    while (call := calls.get()) is not None:
        run_to_end(*call)
        del call  # hold no reference to the writer between saves


class OneThread(Runner):
    """One long-lived thread, fed by a queue: the saves in flight are written one after the other."""

    def __init__(self, depth: int = 1, writer: str = "") -> None:
        super().__init__(depth, writer)
        self._calls: queue.SimpleQueue[tuple[Work, OnDone] | None] = queue.SimpleQueue()
        self._consumer = threading.Thread(target=_consume, args=(self._calls,), name="ppe-snapshot-writer",
                                          daemon=True)
        self._consumer.start()

    def run(self, work: Work, on_done: OnDone) -> None:
        self._calls.put((work, on_done))

    def shutdown(self) -> None:
        self._calls.put(None)
        if self._consumer is not threading.current_thread():
            self._consumer.join()
