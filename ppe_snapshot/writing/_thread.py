"""Writers that write and commit in a background thread of this process."""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

from pytorch_pfn_extras.writing import QueueWriter, StandardWriter

from ppe_snapshot.engine import TakeJob
from ppe_snapshot.writing._async import AsyncWriter, Ticket
from ppe_snapshot.writing._base import SimpleWriter
from ppe_snapshot.writing._files import FileSave, materialize
from ppe_snapshot.writing._replace import AfterCommit, commit_in_place


class _ThreadBase(AsyncWriter):
    def _submit_take(self, ticket: Ticket, job: TakeJob, step: AfterCommit) -> None:
        self._hand_off(ticket, lambda: commit_in_place(job, step))

    def _submit_file(self, ticket: Ticket, save: FileSave, skeleton: Any) -> None:
        buffer = self._buffers[ticket.slot]
        self._hand_off(ticket, lambda: save.run(materialize(skeleton, buffer)))

    def _hand_off(self, ticket: Ticket, work: Callable[[], int | None]) -> None:
        ticket.handoff = time.perf_counter()
        self._dispatch(lambda: self._run(ticket, work))
        self._started = True

    def _run(self, ticket: Ticket, work: Callable[[], int | None]) -> None:
        try:
            nbytes = work()
        except BaseException as e:  # reported by _finish, raised later in the caller
            self._finish(ticket, e, None)
        else:
            self._finish(ticket, None, nbytes)

    def _dispatch(self, call: Callable[[], None]) -> None:
        raise NotImplementedError


class ThreadWriter(_ThreadBase, StandardWriter[threading.Thread]):
    """Stages in the caller, writes and commits in a new background thread.

    The caller is blocked only while the state is copied into a staging
    buffer that the writer owns and reuses (pinned host memory when the state
    lives on CUDA). At most one save is in flight: a call waits for the
    previous save only if it is still running. A background failure is raised
    at the next call, :meth:`wait` or :meth:`finalize`. Arguments as for
    :class:`~ppe_snapshot.writing.SimpleWriter`.
    """

    def __init__(self, savefun: Callable[..., Any] | None = None, fs: Any = None, out_dir: str = "",
                 **kwds: Any) -> None:
        super().__init__(savefun, fs, out_dir, queue_depth=1, **kwds)
        self._started = False

    def create_worker(self, filename: str, out_dir: str, target: Any, *, savefun: Callable[..., Any] | None = None,
                      append: bool = False, **savefun_kwargs: Any) -> threading.Thread:
        """A thread (not started) that saves ``target`` with :meth:`save` (ppe's ``StandardWriter`` API).

        Calls to the writer do not use it: they stage the state and write it in a thread of their own.
        """
        return threading.Thread(target=self.save, args=(filename, out_dir, target, savefun, append),
                                kwargs=savefun_kwargs, name="ppe-snapshot-writer")

    def _dispatch(self, call: Callable[[], None]) -> None:
        # Not a daemon: the interpreter lets a save in flight finish before it exits.
        threading.Thread(target=call, name="ppe-snapshot-writer").start()


def _consume(calls: "queue.SimpleQueue[Callable[[], None] | None]") -> None:
    while (call := calls.get()) is not None:
        call()
        del call  # hold no reference to the writer between saves


class ThreadQueueWriter(_ThreadBase, QueueWriter[threading.Thread]):
    """Like :class:`ThreadWriter`, with one long-lived thread fed by a bounded queue.

    ``queue_depth`` saves may be in flight at once (written one after the
    other); each holds its own staging buffer, so host memory grows with the
    depth: about ``queue_depth`` copies of the state. A call finding the queue
    full waits for the oldest save. The default depth 1 behaves like
    :class:`ThreadWriter`.
    """

    def __init__(self, savefun: Callable[..., Any] | None = None, fs: Any = None, out_dir: str = "", *,
                 queue_depth: int = 1, **kwds: Any) -> None:
        super().__init__(savefun, fs, out_dir, queue_depth=queue_depth, **kwds)
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._consumer = threading.Thread(target=_consume, args=(self._calls,), name="ppe-snapshot-writer",
                                          daemon=True)
        self._consumer.start()
        self._started = True

    # ppe's QueueWriter API; the writer's own saves go through the queue and thread created above.
    def create_task(self, savefun: Callable[..., Any] | None = None) -> SimpleWriter:
        """A writer that saves in the caller, with this writer's settings, as ppe's queue consumers call it."""
        return SimpleWriter(savefun, self.fs, self.out_dir, allow_pickle=self.allow_pickle,
                            storage_options=self._storage_options, **self._kwds)

    def create_queue(self) -> "queue.Queue[Any]":
        return queue.Queue()

    def create_consumer(self, q: "queue.Queue[Any]") -> threading.Thread:
        """A thread (not started) that runs ppe's ``consume(q)`` loop over ``q``."""
        return threading.Thread(target=self.consume, args=(q,))

    def _dispatch(self, call: Callable[[], None]) -> None:
        self._calls.put(call)

    def _shutdown(self) -> None:
        self._calls.put(None)
        if self._consumer is not threading.current_thread():
            self._consumer.join()
