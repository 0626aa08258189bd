"""What every writer shares (ppe's protocol, the snapshot location, stats), and ``SimpleWriter``."""
from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, Callable

from pytorch_pfn_extras.writing import Writer

from ppe_snapshot.engine import LOCAL, StateDict, TakeJob, gc_paused, group_rank, prepare_take
from ppe_snapshot.storage import is_local, join, local_path
from ppe_snapshot.writing import _replace
from ppe_snapshot.writing._files import FileSave
from ppe_snapshot.writing._replace import AfterCommit
from ppe_snapshot.writing.contract import SnapshotWriter

#: The class of ppe's default file system (POSIX paths). ppe keeps the class private
#: (``writing._writer_base._PosixFileSystem``); a writer made without ``fs`` holds one.
_PPE_DEFAULT_FS = type(Writer().fs)


class _Value:
    """Any other target a ppe writer would torch.save (a tensor, a list, a string): stored as the
    snapshot's ``"state"`` entry as it is (``Snapshot(path).read_object("0/state")`` reads it back)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, value: Any) -> None:
        self.value = value


def is_ppe_default_fs(fs: Any) -> bool:
    """Whether ``fs`` is ppe's default (POSIX) file system, as a writer made without ``fs`` holds."""
    return type(fs) is _PPE_DEFAULT_FS

logger = logging.getLogger(__name__)


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)``; on Python 3.10 the note is kept in ``__notes__`` but not printed."""
    if sys.version_info >= (3, 11):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]


class WriterBase(Writer, SnapshotWriter):
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

    def __init__(self, savefun: Callable[..., Any] | None = None, fs: Any = None, out_dir: str = "", *,
                 allow_pickle: bool = False, **kwds: Any) -> None:
        self._storage_options: dict[str, Any] | None = kwds.pop("storage_options", None)
        if not isinstance(allow_pickle, bool):
            raise TypeError(f"allow_pickle must be True or False, got {allow_pickle!r}")
        # ppe's Writer only: the __init__ of ppe's StandardWriter / QueueWriter (bases of some of our
        # writers, for their public surface) would start workers of their own.
        Writer.__init__(self, fs=fs, out_dir=out_dir)
        self.allow_pickle = allow_pickle
        self._savefun = savefun
        self._kwds = kwds
        self._finalized = False
        #: ``blocking_s``, ``write_s`` (None until the write ends), ``bytes`` and ``path`` of the last save.
        self.last_stats: dict[str, Any] = {}

    @property
    def storage_options(self) -> dict[str, Any] | None:
        return self._storage_options

    def initialize(self, out_dir: str) -> None:
        if out_dir and local_path(out_dir, self._storage_options) is not None:
            super().initialize(out_dir)
        self._initialized = True  # object stores need no directories

    def __call__(self, filename: str, out_dir: str, target: Any, *, savefun: Callable[..., Any] | None = None,
                 append: bool = False, metadata: dict[str, Any] | None = None, pg: Any = LOCAL,
                 extra_state: Mapping[str, Any] | None = None, allow_pickle: bool | None = None) -> None:
        """Save ``target`` (a state dict) as ``<self.out_dir or out_dir>/<filename>``.

        ``metadata`` is stored in the snapshot's manifest; ``pg`` is the
        engine's process group (``LOCAL``: this process alone; ``None``: the
        default group, each rank writing its part); ``extra_state`` holds more
        app-state entries saved beside the target's ``"state"`` (e.g. the RNG
        state); ``allow_pickle`` overrides the writer's for this save. All
        four are ignored when a ``savefun`` writes a single file.
        """
        if self._finalized:
            raise RuntimeError(f"this {type(self).__name__} was finalized; create a new writer to save again")
        start = time.perf_counter()
        path = join(self.out_dir or out_dir, filename)
        self._check_path(path)
        savefun = savefun if savefun is not None else self._savefun
        if savefun is None:
            app_state = self._app_state(target, append, extra_state)
            self._take(path, app_state, metadata, pg, self.allow_pickle if allow_pickle is None else allow_pickle,
                       start)
        else:
            self._save_file(self._file_save(path, savefun, append, self._kwds), target, start)

    @staticmethod
    def _app_state(target: Any, append: bool, extra_state: Mapping[str, Any] | None) -> dict[str, Any]:
        if append:
            raise ValueError("append=True needs a savefun: an engine snapshot is a directory, "
                             "it cannot be appended to")
        if extra_state and "state" in extra_state:
            raise ValueError('extra_state cannot use the key "state": it holds the target')
        state = StateDict(target) if isinstance(target, Mapping) else _Value(target)
        return {"state": state, **(extra_state or {})}

    def save(self, filename: str, out_dir: str, target: Any, savefun: Callable[..., Any] | None = None,
             append: bool = False, **savefun_kwargs: Any) -> None:
        """Save in the caller, whatever the writer (ppe's ``Writer.save``); then run the post-save hooks.

        ``savefun=None`` takes an engine snapshot (with the writer's
        ``allow_pickle``); a function writes one file, passed ``savefun_kwargs``.
        """
        path = join(self.out_dir or out_dir, filename)
        self._check_path(path)
        if savefun is None:
            job, step = self._prepare(path, self._app_state(target, append, None), None, LOCAL, self.allow_pickle)
            _replace.commit_in_place(job, step)
        else:
            self._file_save(path, savefun, append, {**self._kwds, **savefun_kwargs}).run(target)
        self._post_save()

    def _file_save(self, path: str, savefun: Callable[..., Any], append: bool, kwds: dict[str, Any]) -> FileSave:
        fs = self.fs
        if is_local(path) and is_ppe_default_fs(fs):  # plain os calls, resolved as ppe's fs would
            path = path if path.startswith("file://") else os.path.join(fs.root, path)
            fs = None
        return FileSave(path, savefun, append, dict(kwds), fs, self._storage_options)

    def _check_path(self, path: str) -> None:
        """Raise when this writer cannot save at ``path``."""

    def _take(self, path: str, app_state: dict[str, Any], metadata: dict[str, Any] | None, pg: Any,
              allow_pickle: bool, start: float) -> None:
        raise NotImplementedError

    def _save_file(self, save: FileSave, target: Any, start: float) -> None:
        raise NotImplementedError

    def _prepare(self, path: str, app_state: dict[str, Any], metadata: dict[str, Any] | None, pg: Any,
                 allow_pickle: bool) -> tuple[TakeJob, AfterCommit]:
        """The take job, and the step after its commit that gives the snapshot its name when it replaces one.

        Rank 0 of ``pg`` decides where the take goes (every rank follows it in
        ``prepare_take``) and is the one that moves the committed snapshot.
        """
        replacement = None
        if group_rank(pg)[0] == 0:
            path, replacement = _replace.plan(path, self._storage_options)
        job = prepare_take(path, app_state, pg=pg, storage_options=self._storage_options, allow_pickle=allow_pickle,
                           metadata=metadata)
        return job, _replace.after_commit(job, replacement)

    def _new_stats(self, path: str, start: float, nbytes: int | None) -> dict[str, Any]:
        stats = {"path": path, "bytes": nbytes, "blocking_s": time.perf_counter() - start, "write_s": None}
        self.last_stats = stats
        return stats

    @staticmethod
    def _log_done(stats: dict[str, Any]) -> None:
        logger.info("saved %s: %s bytes, caller blocked %.3f s, written in %.3f s",
                    stats["path"], stats["bytes"], stats["blocking_s"], stats["write_s"])

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; nothing to wait for here."""

    def finalize(self) -> None:
        """Nothing runs in the background here: the writer stays usable, as ppe's SimpleWriter does."""


class SimpleWriter(WriterBase):
    """Saves in the caller: the call returns once the snapshot is committed.

    An engine snapshot is written straight from the live tensors (no staging
    copy). See :class:`WriterBase` for the arguments.
    """

    @gc_paused()  # the caller waits; the take's objects go with the locals before the collector runs again
    def _take(self, path: str, app_state: dict[str, Any], metadata: dict[str, Any] | None, pg: Any,
              allow_pickle: bool, start: float) -> None:
        job, step = self._prepare(path, app_state, metadata, pg, allow_pickle)
        began = time.perf_counter()
        _replace.commit_in_place(job, step)
        self._finish(path, start, began, job.layout.size)

    def _save_file(self, save: FileSave, target: Any, start: float) -> None:
        began = time.perf_counter()
        nbytes = save.run(target)
        self._finish(save.dest, start, began, nbytes)

    def _finish(self, path: str, start: float, began: float, nbytes: int) -> None:
        stats = self._new_stats(path, start, nbytes)
        stats["write_s"] = time.perf_counter() - began
        self._log_done(stats)
        self._post_save()
