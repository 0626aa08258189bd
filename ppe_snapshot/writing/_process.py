"""The runner of the Process writers: one long-lived worker process, fed through shared-memory staging buffers."""
from __future__ import annotations

import itertools
import logging
import multiprocessing
import multiprocessing.spawn
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
from typing import Any, Callable

import torch
import torch.multiprocessing  # noqa: F401 - registers how tensors in shared memory travel to the worker

from ppe_snapshot.engine import TakeJob, new_shared_buffer
from ppe_snapshot.errors import SnapshotError
from ppe_snapshot.storage import in_one_process
from ppe_snapshot.writing._buffers import StagingBuffers
from ppe_snapshot.writing._errors import add_note
from ppe_snapshot.writing._pinning import HostRegistrations
from ppe_snapshot.writing._runners import FileWork, OnDone, Runner, TakeWork, Work
from ppe_snapshot.writing._worker import READY, frame

logger = logging.getLogger(__name__)

UNGUARDED_MAIN = (
    "the script that creates the {writer} has no `if __name__ == \"__main__\":` guard, and a save refers to "
    "something defined in it (a savefun, a class): the worker process imports the script to find it, and that runs "
    "the training code (and creates another writer) there. Fix: put the training code under "
    "`if __name__ == \"__main__\":`, or define what the save refers to in a module of its own")

#: What the worker process runs: it takes its parent's import path from the pipe before it imports anything of
#: ours, so that it finds the package wherever the parent found it (the parent's main script is not imported).
_BOOT = ("import pickle, sys\n"
         "from multiprocessing.connection import Connection\n"
         "jobs, results = Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False)\n"
         "setup = pickle.loads(jobs.recv_bytes())\n"
         "sys.path[:] = setup['sys_path']\n"
         "from ppe_snapshot.writing._worker import serve\n"
         "serve(jobs, results, setup)\n")


def _in_main_import() -> bool:
    """Whether this process is a worker importing its parent's main script (see ``_worker``)."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


def _rebuild_error(data: bytes | None, text: str) -> BaseException:
    error: Any = None
    if data is not None:
        try:
            error = pickle.loads(data)
        except Exception:  # the text below still tells what happened
            error = None
    if not isinstance(error, BaseException):
        error = SnapshotError(text.strip().splitlines()[-1] if text.strip() else "unknown error")
    add_note(error, f"traceback in the writer process:\n{text.rstrip()}")
    return error


def _main() -> tuple[str, str] | None:
    """How the worker finds the parent's main module, which it imports only when a save refers to something
    defined there: ``("path", script)`` or ``("module", name)`` (``python -m``); None in an interactive session."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return "module", spec.name.removesuffix(".__main__")
    path = getattr(main, "__file__", None)
    return ("path", os.path.abspath(path)) if path else None


class _Worker:
    """The worker process, the pipes to it, and the threads that feed it and collect its answers.

    The worker is a fresh interpreter running ``_BOOT`` (never a fork of this process, and it does not import the
    main script the way multiprocessing's ``spawn`` does), so a script without a ``__main__`` guard works.
    Nothing here blocks the caller on the worker: messages queue for a sender thread while the worker starts.
    """

    def __init__(self, stops: torch.Tensor) -> None:
        jobs_end, self._jobs = multiprocessing.Pipe(duplex=False)
        self._results, results_end = multiprocessing.Pipe(duplex=False)
        ends = (jobs_end.fileno(), results_end.fileno())
        self.process = subprocess.Popen([multiprocessing.spawn.get_executable(), "-c", _BOOT, *map(str, ends)],
                                        pass_fds=ends)
        jobs_end.close()  # only the worker holds these ends, so each side sees the other one go
        results_end.close()
        self._pending: dict[int, tuple[OnDone, str]] = {}
        self._lock = threading.Lock()
        self._exited = False
        self.ready = False  # the worker sent READY
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._outbox.put(pickle.dumps({
            "sys_path": list(sys.path), "parent_pid": os.getpid(), "main": _main(),
            "authkey": bytes(multiprocessing.current_process().authkey)}))  # to fetch the shared buffers' fds
        self._outbox.put(frame("stops", None, stops))
        self._sender = threading.Thread(target=self._send_all, name="ppe-snapshot-to-writer", daemon=True)
        self._sender.start()
        self._collector = threading.Thread(target=self._collect, name="ppe-snapshot-results", daemon=True)
        self._collector.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        with self._lock:
            return not self._exited and self.process.poll() is None

    def send_buffer(self, slot: int, buffer: torch.Tensor) -> None:
        self._outbox.put(frame("buffer", None, slot, buffer))

    def submit(self, ticket: int, payload: bytes, on_done: OnDone, path: str) -> None:
        with self._lock:
            if self._exited:
                raise SnapshotError(f"the writer process (pid {self.pid}) "
                                    f"{_exit_reason(self.process.returncode)}; {path} was not saved")
            self._pending[ticket] = (on_done, path)
        self._outbox.put(payload)

    def _send_all(self) -> None:
        while (payload := self._outbox.get()) is not None:
            try:
                self._jobs.send_bytes(payload)
            except OSError:  # the worker is gone: the collector reports what it lost
                return

    def _collect(self) -> None:
        while True:
            try:
                ticket, error, nbytes = reply = self._results.recv()
            except (EOFError, OSError):  # the worker exited
                break
            if reply == READY:
                self.ready = True
                continue
            with self._lock:
                on_done, _ = self._pending.pop(ticket)
            self._report(on_done, _rebuild_error(*error) if error is not None else None, nbytes)
        self.process.wait()
        with self._lock:
            self._exited = True
            lost, self._pending = list(self._pending.values()), {}
        reason = _exit_reason(self.process.returncode)
        if not self.ready:
            reason += " while starting (its error is on standard error above)"
        for on_done, path in lost:
            self._report(on_done, SnapshotError(f"the writer process (pid {self.pid}) {reason} before {path} "
                                                "was committed"), None)

    @staticmethod
    def _report(on_done: OnDone, error: BaseException | None, nbytes: int | None) -> None:
        try:
            on_done(error, nbytes)
        except BaseException:  # keep collecting
            logger.exception("reporting the end of a background save failed")

    def close(self) -> None:
        """Let the worker finish what it was sent, then stop it."""
        self._outbox.put(frame("stop", None))
        self._outbox.put(None)
        self._sender.join()
        self._jobs.close()  # the worker also stops when its pipe closes
        self.process.wait()
        if self._collector is not threading.current_thread():
            self._collector.join()
        self._results.close()


class SharedBuffers(StagingBuffers):
    """Staging buffers in shared memory, which the worker maps: each new one is passed to ``changed``."""

    def __init__(self, depth: int, changed: Callable[[int, torch.Tensor], None]) -> None:
        super().__init__(depth)
        self._on_changed = changed
        self._pinned_ranges = HostRegistrations()

    def allocate(self, nbytes: int, pin: bool) -> torch.Tensor:
        buffer = new_shared_buffer(nbytes)  # zeroed; the worker maps the same pages
        if pin:  # page-locked, so device-to-host copies run at full speed
            self._pinned_ranges.register(buffer)
        return buffer

    def drop(self, buffer: torch.Tensor) -> None:
        self._pinned_ranges.unregister(buffer)

    def changed(self, slot: int, buffer: torch.Tensor) -> None:
        self._on_changed(slot, buffer)

    def close(self) -> None:
        self._pinned_ranges.clear()


class WorkerProcess(Runner):
    """Saves in one long-lived worker process (:class:`_Worker`), fed through shared-memory staging buffers
    (:class:`SharedBuffers`); up to ``depth`` saves in flight, written one after the other."""

    def __init__(self, depth: int = 1, writer: str = "") -> None:
        super().__init__(depth, writer)
        self._tickets = itertools.count()
        self._buffers = SharedBuffers(depth, self._send_buffer)  # sent again to a worker that replaces one
        #: One byte per slot, shared with the worker: set when the take of several ranks in the slot failed
        #: elsewhere, so that the worker stops writing it (the parent speaks for the worker to the other ranks).
        self._stops = new_shared_buffer(depth)
        self._slot_jobs: list[TakeJob | None] = [None] * depth
        self._running: _Worker | None = None
        if _in_main_import():  # this is the worker importing the unguarded script: say so, start nothing
            raise RuntimeError(f"{writer} created while its worker process imports the main "
                               f"script; {UNGUARDED_MAIN.format(writer=writer)}")
        self._running = _Worker(self._stops)

    @property
    def pid(self) -> int | None:
        """The pid of the worker process (None once shut down)."""
        return self._running.pid if self._running is not None else None

    def buffers(self) -> StagingBuffers:
        return self._buffers

    def check_path(self, path: str) -> None:
        if in_one_process(path):
            scheme = path.split("://", 1)[0]
            raise ValueError(f"{self.writer} cannot save to {path}: a {scheme}:// file system lives in "
                             "one process, and this writer writes from its worker process. Use a ThreadWriter "
                             f"for {scheme}://, or a real file system")

    def before_save(self) -> None:
        self._live_worker()

    def _live_worker(self) -> _Worker:
        worker = self._running
        if worker is None or not worker.alive():
            if worker is not None:
                worker.close()  # reports the saves it lost
                logger.warning("the writer process (pid %s) %s; starting a new one",
                               worker.pid, _exit_reason(worker.process.returncode))
            worker = self._running = _Worker(self._stops)
            for slot, buffer in enumerate(self._buffers.all):
                if buffer is not None:
                    worker.send_buffer(slot, buffer)
        return worker

    def _send_buffer(self, slot: int, buffer: torch.Tensor) -> None:
        self._live_worker().send_buffer(slot, buffer)

    def run(self, work: Work, on_done: OnDone) -> None:
        """Hand ``work`` to the worker, which holds the slot's buffer already."""
        if isinstance(work, TakeWork):
            self._take(work, on_done)
        elif isinstance(work, FileWork):
            self._send(work, ("file", work.slot, work.save, work.value), on_done)
        else:
            raise TypeError(f"{self.writer}'s worker process runs takes and single files, not {work!r}")

    def _take(self, work: TakeWork, on_done: OnDone) -> None:
        job, slot = work.job, work.slot
        job.release_staging()
        if job.world_size == 1:
            self._send(work, ("take", slot, job, work.step), on_done)
            return
        # the worker writes and publishes the part; this process concludes (the channel is here)
        self._stops[slot], self._slot_jobs[slot] = 0, job
        job.when_failed(lambda: self._stop_writing(slot, job))
        try:
            self._send(work, ("take", slot, job, None), lambda error, nbytes: threading.Thread(
                target=self._conclude, args=(work, error, on_done), name="ppe-snapshot-conclude").start())
        except BaseException as e:  # never handed over: the other ranks must hear of it, not wait
            job.conclude(e)

    def _stop_writing(self, slot: int, job: TakeJob) -> None:
        if self._slot_jobs[slot] is job:  # still this take's slot
            self._stops[slot] = 1

    def _conclude(self, work: TakeWork, error: BaseException | None, on_done: OnDone) -> None:
        self._slot_jobs[work.slot] = None
        try:
            work.job.conclude(error)
            if work.step is not None:
                work.step.promote()
        except BaseException as e:
            on_done(e, None)
        else:
            on_done(None, None)

    def _send(self, work: Work, message: tuple[Any, ...], on_done: OnDone) -> None:
        number = next(self._tickets)
        kind, *rest = message
        try:
            payload = frame(kind, number, *rest)
        except Exception as e:
            raise TypeError(f"{self.writer} hands each save to its worker process, and this one cannot "
                            f"be pickled ({e}). Use a module-level savefun such as torch.save (and a picklable "
                            "fs), or a ThreadWriter") from e
        self._live_worker().submit(number, payload, on_done, work.path)

    def shutdown(self) -> None:
        if self._running is not None:
            self._running.close()
            self._running = None
