"""The writers: ppe's writer protocol over the writer core (``_core``), each with its runner.

======================  ==============================  ======================================================
writer                  ppe base (its public surface)   runner (where a save runs)
======================  ==============================  ======================================================
``SimpleWriter``        ``Writer``                      the caller (``_runners.InCaller``)
``ThreadWriter``        ``StandardWriter``              a new thread per save (``_runners.ThreadPerSave``)
``ThreadQueueWriter``   ``QueueWriter``                 one thread fed by a queue (``_runners.OneThread``)
``ProcessWriter``       ``StandardWriter``              one worker process (``_process.WorkerProcess``)
``ProcessQueueWriter``  ``QueueWriter``                 the same, ``queue_depth`` saves in flight
======================  ==============================  ======================================================

Each row is a class naming its ppe base and its runner (``_runner_type``); the queue writers add ppe's
``QueueWriter`` API and ``queue_depth`` (:class:`_Queued`). The ppe bases give each writer the public surface of
ppe's writer of its kind (``create_worker``, ``create_task``, ...); their ``__init__`` is not run (it would start
workers of its own). ppe's private names are :mod:`ppe_snapshot.ppe_private`'s.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import queue
import threading
import time
import weakref
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, Callable

from pytorch_pfn_extras.writing import QueueWriter, StandardWriter, Writer

from ppe_snapshot import ppe_private
from ppe_snapshot.engine import LOCAL
from ppe_snapshot.storage import anchored, join, open_tree
from ppe_snapshot.writing import _replace
from ppe_snapshot.writing._core import WriterCore, app_state, logger
from ppe_snapshot.writing._files import FileSave
from ppe_snapshot.writing._process import WorkerProcess
from ppe_snapshot.writing._runners import InCaller, OneThread, Runner, ThreadPerSave
from ppe_snapshot.writing.contract import ImageLoan, SnapshotWriter


def _hooks_of(writer: Writer) -> Callable[[], None]:
    """Runs ``writer``'s post-save hooks while it exists (the core holds no reference to its writer)."""
    ref = weakref.ref(writer)

    def run() -> None:
        alive = ref()
        if alive is not None:
            ppe_private.run_cleanup_hooks(alive)
    return run


def _finalize_at_exit(ref: "weakref.ref[_PpeWriter]") -> None:
    writer = ref()
    if writer is None:
        return
    try:
        writer.finalize()
    except BaseException:  # nobody is left to raise it to
        logger.exception("a background save failed and was never reported; it surfaced at interpreter exit")


def _check_depth(queue_depth: Any) -> int:
    if isinstance(queue_depth, bool) or not isinstance(queue_depth, int) or queue_depth < 1:
        raise ValueError("queue_depth is the number of saves in flight, each holding its own staging "
                         f"buffer: an int >= 1; got {queue_depth!r}")
    return queue_depth


class _PpeWriter(Writer, SnapshotWriter):
    """A ppe writer whose saves are engine snapshots, or single files with an explicit ``savefun``.

    Args:
        savefun: ``None`` (the default) takes an engine snapshot, a directory
            with a manifest, at ``<out_dir>/<filename>``. A function such as
            ``torch.save`` writes one file there instead, as ppe's writers do.
        fs: ppe's file-system object, used for single files on local paths.
        out_dir: Where snapshots go (a local path or an fsspec URL such as
            ``s3://bucket/run``); it takes precedence over the ``out_dir``
            of each call, as in ppe.
        storage_options: Options for fsspec (credentials, endpoint, ...).
        allow_pickle: Let engine snapshots hold values that only pickle can
            store (keyword-only; off by default, as reading them runs code).
        kwds: Passed to ``savefun``.

    Saving again under a name that holds a snapshot replaces it, as ppe's
    writers do, without ever leaving the name without a complete snapshot
    (see :mod:`ppe_snapshot.writing._replace`).
    """

    #: What runs this writer's saves, built from the saves it keeps in flight and the writer's class name.
    _runner_type: Callable[[int, str], Runner] = InCaller
    #: The saves it keeps in flight (a queue writer's ``queue_depth``).
    _queue_depth = 1

    def __init__(self, savefun: Callable[..., Any] | None = None, fs: Any = None, out_dir: str = "", *,
                 allow_pickle: bool = False, incremental: bool = False, **kwds: Any) -> None:
        storage_options: dict[str, Any] | None = kwds.pop("storage_options", None)
        if not isinstance(allow_pickle, bool):
            raise TypeError(f"allow_pickle must be True or False, got {allow_pickle!r}")
        if not isinstance(incremental, bool):
            raise TypeError(f"incremental must be True or False, got {incremental!r}")
        runner = self._runner_type(self._queue_depth, type(self).__name__)
        Writer.__init__(self, fs=fs, out_dir=out_dir)
        self.allow_pickle = allow_pickle
        self._default_savefun = savefun
        self._savefun_kwds = kwds
        self._core = WriterCore(runner, storage_options=storage_options, after_save=_hooks_of(self),
                                name=type(self).__name__)
        self._core.incremental = incremental
        self._owner = os.getpid()
        if runner.background:  # at interpreter exit, before multiprocessing stops daemonic children
            self._exit_finalizer = multiprocessing.util.Finalize(
                self, _finalize_at_exit, args=(weakref.ref(self),), exitpriority=100)

    # -- what the extension reads back -------------------------------------------------
    @property
    def storage_options(self) -> dict[str, Any] | None:
        return self._core.storage_options

    @property
    def incremental(self) -> bool:
        """Whether each engine snapshot references the unchanged blocks of :attr:`base` (and writes only the
        others), where ``base`` lies beside it; set by ``snapshot(incremental=True)``."""
        return self._core.incremental

    @incremental.setter
    def incremental(self, value: bool) -> None:
        self._core.incremental = bool(value)

    @property
    def base(self) -> str | None:
        """The snapshot an incremental save references: the last this writer committed (None before the first;
        the extension sets the one autoload resumed from)."""
        return self._core.base

    @base.setter
    def base(self, location: str | None) -> None:
        self._core.base = None if location is None else str(location)

    @property
    def last_stats(self) -> dict[str, Any]:  # type: ignore[override]
        """``path``, ``bytes``, ``blocking_s``, ``write_s`` (None until the write ends) of the last save."""
        return self._core.last_stats

    @property
    def last_save(self) -> Future[None] | None:
        """The end of the last save (None before the first): a ``Future`` done once it was committed and its
        post-save hooks ran, whose ``exception()`` is its failure; another thread may wait on it."""
        return self._core.last_save

    @property
    def staging_buffers(self) -> tuple[Any, ...]:
        """A background writer's staging buffers, one per save in flight (None until first used)."""
        return self._core.staging_buffers

    @property
    def in_flight(self) -> int:
        """How many saves were handed over (or are being staged) and have not ended yet."""
        return self._core.in_flight

    # -- ppe's protocol --------------------------------------------------------------
    def initialize(self, out_dir: str) -> None:
        if out_dir:
            open_tree(out_dir, self.storage_options).make_directory(out_dir, via=self.fs)

    def __call__(self, filename: str, out_dir: str, target: Any, *, savefun: Callable[..., Any] | None = None,
                 append: bool = False, metadata: dict[str, Any] | None = None, pg: Any = LOCAL,
                 extra_state: Mapping[str, Any] | None = None, allow_pickle: bool | None = None,
                 incremental: bool | None = None) -> None:
        """Save ``target`` (a state dict) as ``<self.out_dir or out_dir>/<filename>``.

        ``metadata`` is stored in the snapshot's manifest; ``pg`` is the
        engine's process group (``LOCAL``: this process alone; ``None``: the
        default group, each rank writing its part); ``extra_state`` holds more
        app-state entries saved beside the target's ``"state"`` (e.g. the RNG
        state); ``allow_pickle`` and ``incremental`` (False: a self-contained
        snapshot) override the writer's for this save. All five are ignored
        when a ``savefun`` writes a single file.
        """
        if self._core.closed:
            raise RuntimeError(f"this {type(self).__name__} was finalized; create a new writer to save again")
        start = time.perf_counter()
        path = self._path(out_dir, filename)
        savefun = savefun if savefun is not None else self._default_savefun
        if savefun is None:
            self._core.take(path, app_state(target, append, extra_state), metadata, pg,
                            self.allow_pickle if allow_pickle is None else allow_pickle, start,
                            self.incremental if incremental is None else incremental)
        else:
            self._core.save_file(self._file_save(path, savefun, append, self._savefun_kwds), target, start)

    def save(self, filename: str, out_dir: str, target: Any, savefun: Callable[..., Any] | None = None,
             append: bool = False, **savefun_kwargs: Any) -> None:
        """Save in the caller, whatever the writer (ppe's ``Writer.save``); then run the post-save hooks.

        ``savefun=None`` takes an engine snapshot (with the writer's
        ``allow_pickle``); a function writes one file, passed ``savefun_kwargs``.
        """
        path = self._path(out_dir, filename)
        if savefun is None:
            job, step = self._core.prepare(path, app_state(target, append, None), None, LOCAL, self.allow_pickle)
            _replace.commit_in_place(job, step)
        else:
            self._file_save(path, savefun, append, {**self._savefun_kwds, **savefun_kwargs}).run(target)
        ppe_private.run_cleanup_hooks(self)

    def _path(self, out_dir: str, filename: str) -> str:
        path = join(self.out_dir or out_dir, filename)
        self._core.runner.check_path(path)
        return path

    def _file_save(self, path: str, savefun: Callable[..., Any], append: bool, kwds: dict[str, Any]) -> FileSave:
        fs = self.fs
        if ppe_private.is_ppe_default_fs(fs):  # plain os calls, resolved as ppe's fs would
            path, fs = anchored(path, fs.root), None
        return FileSave(path, savefun, append, dict(kwds), fs, self.storage_options)

    def _settings(self) -> dict[str, Any]:
        """What a :class:`SimpleWriter` with this writer's settings is built from (picklable)."""
        return {"savefun": self._default_savefun, "fs": self.fs, "out_dir": self.out_dir,
                "allow_pickle": self.allow_pickle, "storage_options": self.storage_options, **self._savefun_kwds}

    def prepare_staging(self, target: Any) -> None:
        """Allocate, in a background thread, the staging buffer a save of ``target`` (a state dict) will need, its
        pages touched (page-locked when the state is on a GPU), so that the first save blocks only for its copy
        (a fresh buffer's first touch costs more than the copy). Call it when the state is known, e.g. after the
        first optimizer step; a later, larger state makes it grow. Nothing for a SimpleWriter, which stages
        nothing."""
        self._core.prepare_staging(target)

    def lend_staged_image(self) -> ImageLoan | None:
        """See :meth:`SnapshotWriter.lend_staged_image`; None for a SimpleWriter, which stages nothing."""
        return self._core.lend_next_image()

    def wait(self) -> None:
        """Block until every save in flight is committed and its hooks ran.

        Raises :class:`~ppe_snapshot.writing.BackgroundSaveError` (a ``RuntimeError``) for a save that failed.
        """
        self._core.wait()

    def finalize(self) -> None:
        """Wait for the saves in flight, then stop the background (idempotent). A :class:`SimpleWriter` has
        none: it stays usable, as ppe's does."""
        core = self._core
        if core.closed or not core.runner.background or os.getpid() != self._owner:  # a fork owns no background
            return
        try:
            core.finalize()
        finally:
            self._exit_finalizer.cancel()

    def __del__(self) -> None:
        if "_core" not in self.__dict__:  # __init__ did not get that far
            return
        try:
            self.finalize()
        except BaseException:
            logger.exception("a background save failed and was never reported; "
                             "it surfaced when its writer was garbage-collected")


class SimpleWriter(_PpeWriter):
    """Saves in the caller: the call returns once the snapshot is committed.

    An engine snapshot is written straight from the live tensors (no staging
    copy). See :class:`_PpeWriter` for the arguments.
    """


class ThreadWriter(_PpeWriter, StandardWriter[threading.Thread]):
    """Stages in the caller, writes and commits in a new background thread.

    The caller is blocked only while the state is copied into a staging
    buffer that the writer owns and reuses (pinned host memory when the state
    lives on CUDA). At most one save is in flight: a call waits for the
    previous save only if it is still running. A background failure is raised
    at the next call, :meth:`wait` or :meth:`finalize`. Arguments as for
    :class:`~ppe_snapshot.writing.SimpleWriter`.
    """

    _runner_type = ThreadPerSave

    def create_worker(self, filename: str, out_dir: str, target: Any, *, savefun: Callable[..., Any] | None = None,
                      append: bool = False, **savefun_kwargs: Any) -> threading.Thread:
        """A thread (not started) that saves ``target`` with :meth:`save` (ppe's ``StandardWriter`` API).

        Calls to the writer do not use it: they stage the state and write it in a thread of their own.
        """
        return threading.Thread(target=self.save, args=(filename, out_dir, target, savefun, append),
                                kwargs=savefun_kwargs, name="ppe-snapshot-writer")


class _Queued:
    """What the queue writers add (a mixin, first among their bases): ``queue_depth``, and ppe's ``QueueWriter``
    API beside the writer's own saves, which go through its runner."""

    _settings: Callable[[], dict[str, Any]]

    def __init__(self, savefun: Callable[..., Any] | None = None, fs: Any = None, out_dir: str = "", *,
                 queue_depth: int = 1, **kwds: Any) -> None:
        self._queue_depth = _check_depth(queue_depth)
        super().__init__(savefun, fs, out_dir, **kwds)  # type: ignore[call-arg]  # the writer's, next in its MRO

    def create_task(self, savefun: Callable[..., Any] | None = None) -> SimpleWriter:
        """A writer that saves in the caller, with this writer's settings, as ppe's queue consumers call it."""
        return SimpleWriter(**{**self._settings(), "savefun": savefun})


class ThreadQueueWriter(_Queued, _PpeWriter, QueueWriter[threading.Thread]):
    """Like :class:`ThreadWriter`, with one long-lived thread fed by a bounded queue.

    ``queue_depth`` saves may be in flight at once (written one after the
    other); each holds its own staging buffer, so host memory grows with the
    depth: about ``queue_depth`` copies of the state. A call finding the queue
    full waits for the oldest save. The default depth 1 behaves like
    :class:`ThreadWriter`.
    """

    _runner_type = OneThread

    def create_queue(self) -> "queue.Queue[Any]":
        return queue.Queue()

    def create_consumer(self, q: "queue.Queue[Any]") -> threading.Thread:
        """A thread (not started) that runs ppe's ``consume(q)`` loop over ``q``."""
        return threading.Thread(target=self.consume, args=(q,))


def _save_alone(settings: dict[str, Any], filename: str, out_dir: str, target: Any,
                savefun: Callable[..., Any] | None, append: bool, savefun_kwargs: dict[str, Any]) -> None:
    SimpleWriter(**settings).save(filename, out_dir, target, savefun, append, **savefun_kwargs)


#: The pid of a Process writer's worker process (None once finalized).
_WORKER_PID = property(lambda writer: writer._core.runner.pid, doc="The pid of the worker process (None once "
                                                                      "finalized).")


class ProcessWriter(_PpeWriter, StandardWriter[multiprocessing.Process]):
    """Stages in the caller, writes and commits in one long-lived worker process.

    The worker is started once, when the writer is created, as a fresh
    interpreter (never a fork; the caller does not wait for its start), and
    is fed through a shared-memory staging buffer that the writer allocates
    once, grows only when a snapshot needs more, and reuses;
    the training process pays neither the GIL nor copy-on-write faults for
    the write. The caller is blocked only while the state is copied into that
    buffer (device-to-host for CUDA state; the worker never touches CUDA).
    At most one save is in flight: a call waits for the previous save only if
    it is still running. A background failure is raised at the next call,
    :meth:`wait` or :meth:`finalize`; a worker that died is replaced at the
    next call. :meth:`finalize` and interpreter exit stop the worker after
    the save in flight; the worker also exits by itself when this process dies.

    The worker does not import the main script, so a script without an
    ``if __name__ == "__main__":`` guard works, unless a save refers to
    something defined in the script (a ``savefun``, a class of a saved
    object): the worker then imports it, as multiprocessing's ``spawn``
    would, and that needs the guard (the save fails saying so). It
    cannot write to ``memory://`` (that file system is private to a process).
    With a ``savefun``, tensors are staged to host memory, so CUDA tensors
    are saved as CPU tensors, and ``savefun`` (and ``fs``) must be picklable.
    Arguments as for :class:`~ppe_snapshot.writing.SimpleWriter`.
    """

    worker_pid = _WORKER_PID
    _runner_type = WorkerProcess

    def create_worker(self, filename: str, out_dir: str, target: Any, *, savefun: Callable[..., Any] | None = None,
                      append: bool = False, **savefun_kwargs: Any) -> multiprocessing.Process:
        """A process (not started) that saves ``target`` with this writer's settings (ppe's ``StandardWriter`` API).

        Calls to the writer do not use it: they hand their saves to the long-lived worker process.
        """
        return multiprocessing.Process(target=_save_alone, args=(self._settings(), filename, out_dir, target, savefun,
                                                                 append, savefun_kwargs))


class ProcessQueueWriter(_Queued, _PpeWriter, QueueWriter[multiprocessing.Process]):
    """Like :class:`ProcessWriter`, with ``queue_depth`` saves allowed in flight at once.

    The worker writes them one after the other; each holds its own
    shared-memory staging buffer, so memory grows with the depth (about
    ``queue_depth`` copies of the state). A call finding the queue full waits
    for the oldest save. The default depth 1 behaves like :class:`ProcessWriter`.
    """

    worker_pid = _WORKER_PID
    _runner_type = WorkerProcess

    def create_queue(self) -> "queue.Queue[Any]":
        return multiprocessing.JoinableQueue()  # type: ignore[return-value]

    def create_consumer(self, q: "queue.Queue[Any]") -> multiprocessing.Process:
        """A process (not started) that runs ppe's ``consume(q)`` loop over ``q``."""
        return multiprocessing.Process(target=self.consume, args=(q,))
