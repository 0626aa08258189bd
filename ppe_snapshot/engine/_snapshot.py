"""``Snapshot``: take, restore and inspect a snapshot."""
from __future__ import annotations

import operator
import threading
from functools import partial
from typing import Any, Callable, TypeVar

import torch

from ppe_snapshot.engine._files import verify_chunks
from ppe_snapshot.engine._format import Entry, Manifest
from ppe_snapshot.engine._ranks import group_rank
from ppe_snapshot.engine._restore import load_state, read_value
from ppe_snapshot.engine._state import check_app_state, restore_order, take_states
from ppe_snapshot.engine._take import (
    StagedImage, TakeJob, TensorPrepare, give_back, prepare_staging_buffer, prepare_take, release_staging_buffers,
    staging_estimate, take_staging_buffer,
)
from ppe_snapshot.engine._util import gc_paused
from ppe_snapshot.engine._versions import check_structure, read_manifest
from ppe_snapshot.errors import CorruptSnapshotError
from ppe_snapshot.storage import Storage, open_storage, snapshot_location

T = TypeVar("T")
#: Gives a host buffer of at least the requested number of bytes, for :meth:`Snapshot.async_take` to stage into.
StagingProvider = Callable[[int], torch.Tensor]


class Snapshot:
    """A reference to a committed snapshot at ``path`` (a local path or an fsspec URL)."""

    def __init__(self, path: str | Storage, pg: Any = None, storage_options: dict[str, Any] | None = None, *,
                 allow_pickle: bool = False) -> None:
        """``path``: where the snapshot is, or a storage already open on it (a copy read over the network, say)."""
        self._opened = path if isinstance(path, Storage) else None
        self.path = path.url if isinstance(path, Storage) else snapshot_location(path)
        self.pg = pg
        self.storage_options = storage_options
        #: Whether restore / read_object may unpickle entries saved with pickle (runs code from the snapshot).
        self.allow_pickle = allow_pickle
        self._manifest: Manifest | None = None

    def __repr__(self) -> str:
        return f"Snapshot(path={self.path!r})"

    def with_group(self, pg: Any, *, allow_pickle: bool | None = None) -> "Snapshot":
        """The same snapshot for the ranks of ``pg`` (and ``allow_pickle``, by default this one's), sharing
        its manifest once read: a caller that checked it hands it on without a second read."""
        other = Snapshot(self._opened or self.path, pg, self.storage_options,
                         allow_pickle=self.allow_pickle if allow_pickle is None else allow_pickle)
        other._manifest = self._manifest
        return other

    # -- taking -------------------------------------------------------------
    # The caller waits: no collection meanwhile, and the take's objects (an entry and more per dict, a list
    # element per tensor) are gone, with the call's locals, before the collector runs again. Left to it, they
    # cost the take of 10^5 tensors in 33,334 small dicts 25-45 ms of young collections, and now and then a
    # full one (0.12 s).
    @classmethod
    @gc_paused()
    def take(cls, path: str, app_state: dict[str, Any], pg: Any = None, replicated: list[str] | None = None,
             storage_options: dict[str, Any] | None = None,
             _custom_tensor_prepare_func: TensorPrepare | None = None, *, allow_pickle: bool = False,
             metadata: dict[str, Any] | None = None, base: str | None = None,
             block_bytes: int | None = None) -> "Snapshot":
        """Persist ``app_state`` at ``path``; returns once the snapshot is committed.

        Tensors are written straight from their memory (no copy of the state).
        ``replicated`` globs mark state that is identical on every rank: it is
        written once in total, spread over the ranks; a glob counts only when
        every rank gives it. A manifest that would not restore (ranks that
        disagree on the replicated state) is never committed: every rank
        raises. ``_custom_tensor_prepare_func(path, tensor, tracing)`` returns
        the tensor to store in place of each plain tensor (e.g. a cast to a
        smaller dtype; it must return a dense strided tensor). ``allow_pickle`` lets
        values that have no pickle-free encoding be pickled; ``metadata`` is a
        small JSON-able dict stored in the manifest (see :attr:`metadata`).

        Every take writes its data in checksummed blocks of ``block_bytes``
        (default ``PPE_SNAPSHOT_BLOCK_KB``, 1 MiB; a multiple of 64 up to
        64 MiB), so that any snapshot can be the base of an incremental take.
        ``base``: the path of an earlier snapshot in the same directory. The
        take is *incremental*: every block whose bytes the base holds is not
        written again (compared in the base's blocks); the new snapshot reads
        it from the base's files. It restores on its own as long as the
        snapshots it references stay beside it (:attr:`references`; retention
        keeps them).
        """
        job = prepare_take(path, app_state, pg=pg, replicated=replicated, storage_options=storage_options,
                           allow_pickle=allow_pickle, metadata=metadata, tensor_prepare=_custom_tensor_prepare_func,
                           base=base, block_bytes=block_bytes)
        job.write_and_commit()
        return cls(job.storage.url, pg, storage_options)

    @classmethod
    def async_take(cls, path: str, app_state: dict[str, Any], pg: Any = None,
                   replicated: list[str] | None = None, storage_options: dict[str, Any] | None = None,
                   _custom_tensor_prepare_func: TensorPrepare | None = None, *,
                   allow_pickle: bool = False, metadata: dict[str, Any] | None = None,
                   staging: StagingProvider | None = None, base: str | None = None,
                   block_bytes: int | None = None, staged_from: StagedImage | None = None) -> "PendingSnapshot":
        """Like :meth:`take`, but returns as soon as the state is copied to a staging buffer.

        The write and the commit go on in a background thread; mutating the
        state after this returns does not change the snapshot. ``staging``
        supplies a reusable buffer (writers use it); by default the buffer is
        kept when the write ends and reused by the next call (page-locked for
        state on a GPU, plain for state on the host; at most one idle buffer
        of each kind, see :meth:`release_staging`). ``base`` and
        ``block_bytes`` as for :meth:`take` (the blocks are compared in the
        background). ``staged_from``: another take's staged image of this
        state (see :meth:`TakeJob.stage`); the tensors it holds are copied
        from there in the background, not from the live state here (the
        caller keeps that image unchanged until this snapshot is written).
        """
        job = prepare_take(path, app_state, pg=pg, replicated=replicated, storage_options=storage_options,
                           allow_pickle=allow_pickle, metadata=metadata, tensor_prepare=_custom_tensor_prepare_func,
                           base=base, block_bytes=block_bytes)
        pin = job.layout.on_cuda()
        try:
            buffer = staging(job.layout.size) if staging is not None else take_staging_buffer(job.layout.size, pin)
        except BaseException as e:
            job.conclude(e)  # several ranks: the others hear of it rather than wait
            raise
        job.stage(buffer, image=staged_from)
        back_to_pool = None if staging is not None else partial(give_back, job.staged, pin)
        return PendingSnapshot(job, cls(job.storage.url, pg, storage_options), after_write=back_to_pool)

    @staticmethod
    def prepare_staging(app_state: dict[str, Any]) -> None:
        """Have the staging buffer of an :meth:`async_take` of ``app_state`` ready before that call: allocated in a
        background thread, every page faulted in (page-locked for state on a GPU), and kept as the buffer a
        finished write gives back is. The first ``async_take`` then blocks for its copy only, as later ones do;
        one that comes before the buffer is ready waits for it. Call it once the state exists (e.g. after the
        optimizer's first step made its state); it holds the memory until :meth:`release_staging`."""
        check_app_state(app_state)
        prepare_staging_buffer(*staging_estimate(take_states(app_state)))

    @staticmethod
    def release_staging() -> int:
        """Free the staging buffers :meth:`async_take` keeps between calls (at most one of each kind: plain
        and page-locked); returns their size in bytes. The next ``async_take`` allocates afresh."""
        return release_staging_buffers()

    # -- reading ------------------------------------------------------------
    def _storage(self) -> Storage:
        return self._opened if self._opened is not None else open_storage(self.path, self.storage_options)

    def _read_manifest(self, storage: Storage) -> Manifest:
        if self._manifest is None:
            self._manifest = read_manifest(storage)
        return self._manifest

    @property
    def references(self) -> tuple[str, ...]:
        """The names of the snapshots beside this one whose data files it reads (an incremental snapshot's
        bases); empty for a self-contained snapshot."""
        return self._read_manifest(self._storage()).references

    @property
    def metadata(self) -> dict[str, Any]:
        """The ``metadata`` given at take time."""
        return self._read_manifest(self._storage()).metadata

    def get_manifest(self) -> dict[str, Entry]:
        """Every entry keyed ``"<rank>/<logical path>"``; replicated entries appear under every rank."""
        manifest = self._read_manifest(self._storage())
        return {f"{r}/{path}": entry for r in range(manifest.world_size)
                for path, entry in sorted(manifest.paths_for(r).items())}

    def verify(self, deep: bool = True) -> None:
        """Raise unless the snapshot is committed and whole.

        Checks the manifest (every entry) and that every data file has its recorded size (the quick check, as
        autoload and retention make of every snapshot they list); with ``deep``, also that every child a
        container names has an entry, every entry below an app state key lies in one, every value decodes; and
        reads every chunk and checks its checksum.
        """
        storage = self._storage()
        try:
            manifest = self._read_manifest(storage)
            manifest.check_entries()
            for name, size in manifest.files.items():
                try:
                    stored = storage.size(name)
                except FileNotFoundError:
                    stored = None
                if stored != size:
                    raise CorruptSnapshotError(
                        f"{self.path}/{name} is {'missing' if stored is None else f'{stored} bytes'}, "
                        f"the manifest says {size} bytes: the snapshot is damaged")
            if deep:
                try:
                    check_structure(manifest)
                except CorruptSnapshotError as e:
                    raise CorruptSnapshotError(f"{self.path}: {e}; the snapshot is damaged") from None
                verify_chunks(storage, manifest)
        finally:
            storage.close()

    @gc_paused()  # the caller waits; thousands of entries are walked
    def restore(self, app_state: dict[str, Any], *, allow_pickle: bool | None = None) -> None:
        """Load the saved state into ``app_state`` (the same keys as the take, or a subset).

        Tensors are read in place into the objects' existing tensors.
        ``allow_pickle`` (default: the snapshot's) lets entries saved with
        pickle be unpickled; without it they raise ``UnsupportedValueError``.
        """
        check_app_state(app_state)  # before any storage is touched, as take does
        app_state = restore_order(app_state)  # RNG states last: other objects' loads may draw numbers
        allow_pickle = self.allow_pickle if allow_pickle is None else allow_pickle
        storage = self._storage()
        try:
            manifest = self._read_manifest(storage)
            rank, _ = group_rank(self.pg)
            for key, obj in app_state.items():
                obj.load_state_dict(load_state(storage, manifest, rank, key, obj, allow_pickle))
        finally:
            storage.close()

    @gc_paused()
    def read_object(self, path: str, obj_out: T | None = None, memory_budget_bytes: int | None = None, *,
                    allow_pickle: bool | None = None) -> T:
        """One entry (and everything under it), by its manifest key ``"<rank>/<path>"``.

        With ``obj_out`` a tensor, the data is read into it in place. Reading
        goes straight into the result's memory; a host buffer is needed only
        for device or non-contiguous targets and then stays under
        ``memory_budget_bytes``. ``allow_pickle`` as for :meth:`restore`.
        """
        memory_budget_bytes = _budget(memory_budget_bytes)
        allow_pickle = self.allow_pickle if allow_pickle is None else allow_pickle
        storage = self._storage()
        try:
            manifest = self._read_manifest(storage)
            rank, logical = self._split(manifest, path)
            if manifest.lookup(rank, logical, own_shards=True) is None:
                raise KeyError(f"{path!r} is not in snapshot {self.path}; get_manifest() lists its entries")
            return read_value(storage, manifest, rank, logical, obj_out, allow_pickle, memory_budget_bytes)
        finally:
            storage.close()

    def _split(self, manifest: Manifest, path: str) -> tuple[int, str]:
        head, slash, rest = path.partition("/")
        if head.isdigit() and slash and int(head) < manifest.world_size:  # ("0/": a DCP item of the empty FQN)
            return int(head), rest
        return group_rank(self.pg)[0], path


def _budget(value: Any) -> int | None:
    """``read_object``'s ``memory_budget_bytes``: None, or a positive integer (``TypeError`` / ``ValueError``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"memory_budget_bytes must be a number of bytes (or None), not {value!r}")
    number = operator.index(value)
    if number < 1:
        raise ValueError(f"memory_budget_bytes must be a positive number of bytes, not {value!r}")
    return number


class PendingSnapshot:
    """A snapshot being written in the background by :meth:`Snapshot.async_take`."""

    def __init__(self, job: TakeJob, snapshot: Snapshot, after_write: Callable[[], None] | None = None) -> None:
        """``after_write`` runs once the write ended, either way (:meth:`Snapshot.async_take` gives its staging
        buffer back to its pool there)."""
        #: The bytes of this rank's data file, and how many of them are copied from another take's staged image
        #: (``async_take(..., staged_from=)``) rather than from the live state.
        self.nbytes, self.from_image_bytes = job.layout.size, sum(n for _, _, n in job.deferred)
        self._snapshot = snapshot
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(job, after_write), name="ppe-snapshot-write")
        self._thread.start()

    def _run(self, job: TakeJob, after_write: Callable[[], None] | None) -> None:
        try:
            job.write_and_commit()
        except BaseException as e:  # handed to wait()
            self._error = e
        finally:
            if after_write is not None:
                after_write()

    def done(self) -> bool:
        """Whether the write has finished (successfully or not)."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Snapshot:
        """Block until committed; raises the background error if the write failed."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"snapshot {self._snapshot.path} is still being written")
        if self._error is not None:
            raise self._error
        return self._snapshot
