"""The contract between the snapshot extension and a writer whose saves are engine snapshots.

The extension (:mod:`ppe_snapshot.extension`) calls any writer with ppe's
protocol: ``writer(filename, out_dir, target, savefun=..., append=...)``
and ``finalize()``. A writer that is a :class:`SnapshotWriter` (every
``ppe_snapshot.writing`` writer is one; a writer of your own becomes one by
subclassing it or by ``SnapshotWriter.register``) is also given what an
engine snapshot records beside the target, and is read back for the stats
the extension reports:

========================  =====================================================================
passed in (keywords)      ``metadata``: stored in the manifest (the extension's training position);
                          ``pg``: the engine's process group (``LOCAL``: this process alone;
                          ``None``: the default group, each rank writing its part); ``extra_state``:
                          more app-state entries beside the target's ``"state"`` (the RNG states);
                          ``allow_pickle``: True to let this save hold values only pickle can store,
                          None to keep the writer's setting; ``incremental``: False for a save that
                          must be self-contained, None to keep the writer's setting
set                       ``incremental`` True by ``snapshot(incremental=True)``; ``base``: the snapshot
                          autoload resumed from, which the first incremental save references
read back                 ``last_stats`` (see :class:`SaveStats`), ``storage_options``, ``out_dir``,
                          ``allow_pickle``, ``base``; ``last_save`` (a ``Future`` done once the last save
                          ended, its exception the failure: the DISTRIBUTED saver rank tells the other
                          ranks from it; the default None: a save is taken as ended when the call returns)
called                    ``prepare_staging(target)`` once the state is known (after autoload, then after
                          the first optimizer step); ``lend_staged_image()`` before a save whose staged
                          image the local tier reuses; ``wait()`` before a snapshot on error;
                          ``finalize()`` at the end;
                          ppe's cleanup hooks (``pytorch_pfn_extras.writing.Writer``'s): each runs
                          after a committed save (retention prunes there)
========================  =====================================================================

``incremental``, ``base``, ``last_save``, ``prepare_staging`` and ``lend_staged_image`` have defaults here (a
writer without incremental saves refuses ``incremental = True``; ``prepare_staging`` does nothing;
``lend_staged_image`` lends nothing); a writer joining by ``SnapshotWriter.register`` gets those it does not
define on its class.
"""
from __future__ import annotations

import abc
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, Callable, TypedDict

from ppe_snapshot.engine import LOCAL, StagedImage

__all__ = ["ImageLoan", "SaveStats", "SnapshotWriter"]


class ImageLoan:
    """The staged image of a writer's next save, lent out (:meth:`SnapshotWriter.lend_staged_image`): once that
    save returned, :attr:`image` says where its tensors lie in its staging buffer (None where the save staged
    nothing: it ran in the caller, failed, or wrote a single file); the writer does not stage into that buffer
    again before :meth:`release` (idempotent)."""

    def __init__(self, cancel: Callable[[], None]) -> None:
        self.image: StagedImage | None = None
        self._release: Callable[[], None] | None = cancel  # before the save: the writer forgets the loan

    def lend(self, image: StagedImage, release: Callable[[], None]) -> None:
        """(The writer) the image staged, and how to end the loan."""
        self.image, self._release = image, release

    def release(self) -> None:
        """The borrower is done with the image: the writer may stage into its buffer again (before the save: the
        next save lends nothing)."""
        release, self._release, self.image = self._release, None, None
        if release is not None:
            release()


class _EverySaveStats(TypedDict):
    path: str
    bytes: int | None
    blocking_s: float
    write_s: float | None


class SaveStats(_EverySaveStats, total=False):
    """What a :class:`SnapshotWriter` tells of its last save (``last_stats``).

    An asynchronous writer returns before the write ends: ``write_s`` is None
    then, and set in the same dict once the snapshot is committed. ``bytes``:
    the size of the data the save wrote (an incremental save's changed blocks,
    once written; before that, the whole state's).
    """
    #: Async writers of engine snapshots: the part of ``blocking_s`` spent copying the state to the staging buffer.
    staging_s: float


class _Contract(abc.ABCMeta):
    """The contract's metaclass: a class registered as a :class:`SnapshotWriter` gets the defaults of the
    members it does not define."""

    def register(cls, subclass: type) -> type:
        registered = super().register(subclass)
        if cls is SnapshotWriter:
            for name in _DEFAULTS:
                if not hasattr(subclass, name):
                    setattr(subclass, name, vars(SnapshotWriter)[name])
        return registered


class SnapshotWriter(metaclass=_Contract):
    """A ppe writer that saves engine snapshots and takes what the extension records beside the target.

    An abstract base class rather than a structural ``Protocol``: the
    extension gives the engine's keywords only to writers that say they take
    them, never to a writer of ppe's protocol that happens to have such names.
    Retention registers with the writer as ppe's extension does, through ppe's
    writer protocol (``pytorch_pfn_extras.writing.Writer`` has it; see
    :mod:`ppe_snapshot.ppe_private`): a writer without it gets no pruning.
    """

    #: Where snapshots go (a local path or an fsspec URL); "" to use the ``out_dir`` of each call.
    out_dir: str
    #: Whether engine snapshots may hold values only pickle can store (and autoload may unpickle them).
    allow_pickle: bool
    #: The stats of the last save: ``{}`` before the first (see :class:`SaveStats`).
    last_stats: SaveStats | dict[str, Any]
    #: The snapshot an incremental save references (None: none yet).
    base: str | None = None
    #: The end of the last save: a ``Future`` done once it ended, whose exception is its failure (None: a save
    #: is taken as ended when the call returns).
    last_save: Future[None] | None = None

    @property
    def incremental(self) -> bool:
        """Whether each engine snapshot references the unchanged blocks of :attr:`base`; False here: a writer
        that saves incrementally overrides this property, and this one refuses True."""
        return False

    @incremental.setter
    def incremental(self, value: bool) -> None:
        if value:
            raise TypeError(f"incremental=True needs a ppe_snapshot writer (SimpleWriter, ThreadWriter, "
                            f"ProcessWriter, ...), got {type(self).__name__}")

    @property
    @abc.abstractmethod
    def storage_options(self) -> dict[str, Any] | None:
        """fsspec options of ``out_dir`` (credentials, endpoint, ...), or None."""

    @abc.abstractmethod
    def __call__(self, filename: str, out_dir: str, target: Any, *, savefun: Callable[..., Any] | None = None,
                 append: bool = False, metadata: dict[str, Any] | None = None, pg: Any = LOCAL,
                 extra_state: Mapping[str, Any] | None = None, allow_pickle: bool | None = None,
                 incremental: bool | None = None) -> None:
        """Save ``target`` (a state dict) as ``<self.out_dir or out_dir>/<filename>``.

        ``metadata``, ``pg``, ``extra_state``, ``allow_pickle`` and ``incremental``
        are ignored when a ``savefun`` writes a single file (ppe's format).
        """

    def prepare_staging(self, target: Any) -> None:
        """Have what a save of ``target`` (a state dict) needs ready before that save comes, e.g. a background
        writer's staging buffer, allocated and faulted in away from the loop; nothing here."""

    def lend_staged_image(self) -> ImageLoan | None:
        """Lend the staged image of the next save (see :class:`ImageLoan`), or None where this writer stages
        nothing (it saves in the caller, from the live state); None here."""
        return None

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise its failure."""

    @abc.abstractmethod
    def finalize(self) -> None:
        """Finish the saves in flight and release what the writer holds."""


#: The members the contract gives a default (see :meth:`_Contract.register`).
_DEFAULTS = ("base", "incremental", "last_save", "lend_staged_image", "prepare_staging")
