"""The snapshot extension for pytorch-pfn-extras training loops.

A drop-in for ``pytorch_pfn_extras.training.extensions.snapshot``: the same
signature, defaults, trigger and priority. With ``savefun=None`` each
snapshot is an engine snapshot (a directory, committed by its manifest);
``autoload`` restores the newest complete and valid one by training
position; ``n_retains`` prunes after each committed save.

RNG state: engine snapshots also hold each rank's global random number
generators (torch CPU and CUDA, numpy, Python ``random``), beside the
target's state, and autoload restores them, so training that draws random
numbers (dropout, shuffling) resumes bit-exactly. Single-file snapshots
(``savefun=torch.save``) keep ppe's format, which has no RNG state: there,
put ``ppe_snapshot.RNGState()`` in the manager's ``state_objects``.
"""
from __future__ import annotations

import logging
import time
import types
import warnings
from typing import Any, Callable

import fsspec
import numpy as np
import torch
import torch.distributed as dist
from pytorch_pfn_extras import reporting
from pytorch_pfn_extras.training import extension
from pytorch_pfn_extras.training._manager_protocol import ExtensionsManagerProtocol
from pytorch_pfn_extras.training.extensions import SnapshotMode
from pytorch_pfn_extras.writing import Writer

from ppe_snapshot import retention
from ppe_snapshot.engine import LOCAL, RNGState, Snapshot, StateDict
from ppe_snapshot.errors import SnapshotError
from ppe_snapshot.retention import Candidate, FilenameFormat
from ppe_snapshot.writing import SimpleWriter
from ppe_snapshot.writing._base import WriterBase

logger = logging.getLogger("ppe_snapshot")

__all__ = ["SnapshotMode", "snapshot", "snapshot_object"]

def snapshot_object(target: Any, filename: str, savefun: Any = None, **kwargs: Any) -> "_Snapshot":
    """An extension that snapshots ``target`` (an object with ``state_dict()`` or a dict of them).

    Takes the keyword arguments of :func:`snapshot`.
    """
    return snapshot(target=target, filename=filename, savefun=savefun, **kwargs)


def snapshot(savefun: Any = None, filename: str | Callable[[Any], str] = "snapshot_iter_{.iteration}", *,
             target: Any = None, condition: Callable[[], bool] | None = None, writer: Writer | None = None,
             snapshot_on_error: bool = False, n_retains: int = -1, autoload: bool = False,
             saver_rank: int | None = None, snapshot_mode: SnapshotMode = SnapshotMode.DEFAULT) -> "_Snapshot":
    """An extension that snapshots the training state (the manager, or ``target``).

    Args:
        savefun: None (the default) saves an engine snapshot, a directory at
            ``<out_dir>/<filename>``. A function such as ``torch.save`` saves
            one file the way pytorch-pfn-extras does. Not with ``writer``.
        filename: A format string the manager is passed to
            (``"snapshot_iter_{.iteration}"``), or a callable taking the manager.
        target: What to save: the manager (None), an object with
            ``state_dict()``/``load_state_dict()``, or a dict of them.
        condition: Called without arguments at each trigger; no snapshot when it returns False.
        writer: Where the save runs: a :mod:`ppe_snapshot.writing` writer
            (Simple, Thread, Process, ...) or any ppe writer. Default: a
            ``ppe_snapshot.writing.SimpleWriter`` on the manager's output directory.
        snapshot_on_error: Save once when the training loop raises (the error propagates).
        n_retains: Keep this many newest complete snapshots (positive to enable);
            needs a string ``filename``.
        autoload: At start, restore the newest complete, valid snapshot; damaged ones
            are skipped with a warning. Needs a string ``filename``.
        saver_rank: The rank that writes in DISTRIBUTED mode (given in DEFAULT mode,
            it selects DISTRIBUTED mode). In SHARDED mode the rank that prunes (default 0).
        snapshot_mode: DEFAULT (one process), DISTRIBUTED (``saver_rank`` writes the
            state every rank holds) or SHARDED (every rank writes its part of one snapshot).

    Each snapshot reports ``snapshot/blocking_s``, ``snapshot/write_s`` (the
    previous save's when the writer is asynchronous) and ``snapshot/bytes``
    through ppe's reporter, into the observation of the iteration that took
    it, and logs them on the ``ppe_snapshot`` logger. ppe runs snapshot
    extensions last in an iteration: ``manager.observation`` after
    ``run_iteration``, and extensions registered with ``PRIORITY_SNAPSHOT``
    after this one, see the values; a ``LogReport`` with its default priority
    has read the observation before they are reported.

    Autoload skips (with a warning and a log line) snapshots that are
    incomplete or damaged; a damaged one at a position the resumed run saves
    again is removed then. In DISTRIBUTED and SHARDED modes all ranks restore
    the same snapshot together and fall back together. ``snapshot_on_error``
    uses no collective: in DISTRIBUTED mode the saver rank saves when it is
    the one failing; in SHARDED mode the failing rank saves its own state
    alone as ``<filename>.error-rank<r>``, which autoload does not use.
    """
    if savefun is not None and writer is not None:
        raise TypeError("savefun and writer arguments cannot be specified together.")
    options = dict(target=target, condition=condition, writer=writer, filename=filename,
                   snapshot_on_error=snapshot_on_error, n_retains=n_retains, autoload=autoload, savefun=savefun)
    if snapshot_mode == SnapshotMode.DEFAULT:
        if saver_rank is None:
            return _Snapshot(**options)
        return _DistributedSnapshot(saver_rank=saver_rank, **options)
    if snapshot_mode == SnapshotMode.DISTRIBUTED:
        if saver_rank is None:
            raise ValueError("snapshot_mode=SnapshotMode.DISTRIBUTED needs saver_rank: the rank that writes "
                             "the snapshots (e.g. saver_rank=0)")
        return _DistributedSnapshot(saver_rank=saver_rank, **options)
    if snapshot_mode == SnapshotMode.SHARDED:
        return _ShardedSnapshot(saver_rank=0 if saver_rank is None else saver_rank, **options)
    raise RuntimeError(f"snapshot_mode must be one of {[m.name for m in SnapshotMode]} of SnapshotMode, "
                       f"got {snapshot_mode!r}")


#: The app-state key of the RNG states in engine snapshots written by the extension.
RNG_KEY = "rng"


def _always_true() -> bool:
    return True


def _state_of(target: Any) -> Any:
    if type(target) is dict:
        return {k: v.state_dict() for k, v in target.items()}
    return target.state_dict()


def _load_into(target: Any, state: Any) -> None:
    if type(target) is dict:
        for k in target:
            target[k].load_state_dict(state[k])
    else:
        target.load_state_dict(state)


class _TargetState:
    """The extension's target as one app-state value, so the engine restores it in place."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def state_dict(self) -> Any:
        return _state_of(self._target)

    def load_state_dict(self, state: Any) -> None:
        _load_into(self._target, state)


class _Unusable(Exception):
    """A candidate that cannot be restored, found before any state was touched."""


class _Snapshot(extension.Extension):
    """Snapshots in one process (SnapshotMode.DEFAULT)."""

    trigger = 1, "epoch"
    priority = extension.PRIORITY_SNAPSHOT
    needs_model_state = True

    def __init__(self, target: Any = None, condition: Callable[[], bool] | None = None,
                 writer: Writer | None = None, filename: str | Callable[[Any], str] = "snapshot_iter_{.iteration}",
                 snapshot_on_error: bool = False, n_retains: int = -1, autoload: bool = False,
                 savefun: Any = None) -> None:
        self._target = target
        self.filename = filename
        self.condition = _always_true if condition is None else condition
        self.writer = writer
        self._snapshot_on_error = snapshot_on_error
        self.n_retains = n_retains
        self.autoload = autoload
        self._savefun = savefun
        self._format: FilenameFormat | None = None
        if isinstance(filename, str):
            self._format = FilenameFormat(filename)
        elif not callable(filename):
            raise TypeError(f"filename must be a format string or a callable, got {type(filename).__name__}")
        elif autoload:
            raise ValueError("autoload needs filename to be a format string (it is matched against the "
                             "names in the output directory); got a callable")
        elif n_retains > 0:
            raise ValueError("n_retains needs filename to be a format string (it is matched against the "
                             "names in the output directory); got a callable")
        self._out_dir = ""
        self._storage_options: dict[str, Any] | None = None
        #: Where ``autoload`` restored from (a path or URL), or None.
        self.resumed_from: str | None = None
        # Names newer than the resumed position that autoload skipped; replaced when saved again.
        self._superseded: dict[str, Candidate] = {}

    # -- what and where -------------------------------------------------------
    @property
    def _target_kind(self) -> str:
        if self._target is None:
            return "manager"
        return "dict" if type(self._target) is dict else "object"

    def _resolve_target(self, manager: ExtensionsManagerProtocol) -> Any:
        return manager if self._target is None else self._target

    def _format_name(self, manager: ExtensionsManagerProtocol) -> str:
        return self.filename(manager) if callable(self.filename) else self.filename.format(manager)

    def _metadata(self, manager: ExtensionsManagerProtocol) -> dict[str, Any]:
        return {"iteration": manager.iteration, "epoch": manager.epoch, "epoch_detail": manager.epoch_detail,
                "ppe_snapshot_target": self._target_kind}

    @property
    def _owns_out_dir(self) -> bool:
        """Whether this process removes snapshots (one process per output directory)."""
        return True

    @property
    def _engine_writer(self) -> bool:
        return isinstance(self.writer, WriterBase)

    # -- extension protocol ----------------------------------------------------
    def initialize(self, manager: ExtensionsManagerProtocol) -> str | None:  # type: ignore[override]
        if self.writer is None:
            self.writer = SimpleWriter(savefun=self._savefun, out_dir=manager.out)
        self._out_dir = self.writer.out_dir or manager.out
        self._storage_options = getattr(self.writer, "storage_options", None)
        if self.n_retains > 0 and self._format is not None and self._prunes():
            self.writer._add_cleanup_hook(self._prune)
        if self.autoload:
            self._autoload(manager)
        return self.resumed_from

    def __call__(self, manager: ExtensionsManagerProtocol) -> None:
        if self.condition():
            self._make_snapshot(manager)

    def on_error(self, manager: ExtensionsManagerProtocol, exc: Exception, tb: types.TracebackType) -> None:
        super().on_error(manager, exc, tb)
        if not self._snapshot_on_error or self.writer is None:
            return
        # An extension that raised in an iteration where no snapshot was due leaves the models marked
        # unavailable (ppe's guard for extensions without needs_model_state); the snapshot needs them.
        available = getattr(manager, "_model_available", None)
        if available is False:
            manager._model_available = True  # type: ignore[attr-defined]
        try:
            self._wait_in_flight()
            self._error_snapshot(manager)
        except Exception as e:  # noqa: BLE001 - the training error is the one that must propagate
            logger.error("ppe_snapshot: the snapshot on error failed: %s: %s", type(e).__name__, e)
            warnings.warn(f"ppe_snapshot: the snapshot on error failed: {type(e).__name__}: {e}")
        finally:
            if available is False:
                manager._model_available = False  # type: ignore[attr-defined]

    def finalize(self, manager: ExtensionsManagerProtocol) -> None:
        if self.writer is not None:
            self.writer.finalize()

    # -- saving ------------------------------------------------------------------
    def _make_snapshot(self, manager: ExtensionsManagerProtocol) -> None:
        self._save(manager, self._format_name(manager), _state_of(self._resolve_target(manager)), LOCAL)

    #: This process's key in the saved RNG states (its global rank in distributed modes).
    _rng_rank = 0

    def _rng_states(self) -> dict[int, Any]:
        """The RNG states to save, by rank: this process's own."""
        return {self._rng_rank: RNGState().state_dict()}

    def _save(self, manager: ExtensionsManagerProtocol, name: str, state: Any, pg: Any,
              rng: dict[int, Any] | None = None) -> None:
        writer = self.writer
        assert writer is not None, "initialize() sets the writer"
        if not self._engine_writer:
            start = time.perf_counter()
            writer(name, manager.out, state, savefun=self._savefun)
            self._report(manager, name, {"blocking_s": time.perf_counter() - start}, None)
            return
        stale = self._superseded.pop(name, None)
        if stale is not None and self._savefun is None:
            retention.remove(stale, self._storage_options)
            logger.warning("ppe_snapshot: removed %s, which autoload skipped as %s, to save this position again",
                           stale.url, stale.kind if stale.kind != "snapshot" else "damaged")
        previous = getattr(writer, "last_stats", None)
        rng = self._rng_states() if rng is None else rng
        writer(name, manager.out, state, savefun=self._savefun, metadata=self._metadata(manager), pg=pg,
               extra_state={RNG_KEY: StateDict(rng)})
        self._report(manager, name, writer.last_stats, previous)

    def _report(self, manager: ExtensionsManagerProtocol, name: str, stats: dict[str, Any],
                previous: dict[str, Any] | None) -> None:
        write_s = stats.get("write_s")
        if write_s is None and previous is not None and previous is not stats:
            write_s = previous.get("write_s")
        values = {"snapshot/blocking_s": stats.get("blocking_s"), "snapshot/write_s": write_s,
                  "snapshot/bytes": stats.get("bytes")}
        values = {k: v for k, v in values.items() if v is not None}
        reporting.report(values)
        logger.info("ppe_snapshot: snapshot %s at iteration %d: %s", name, manager.iteration,
                    ", ".join(f"{k.split('/')[1]}={v:.3f}" if k.endswith("_s") else f"{k.split('/')[1]}={v}"
                              for k, v in values.items()))

    def _wait_in_flight(self) -> None:
        wait = getattr(self.writer, "wait", None)
        if wait is None:
            return
        try:
            wait()
        except Exception as e:  # noqa: BLE001 - reported; the snapshot on error is still taken
            logger.error("ppe_snapshot: the snapshot in flight when training failed did not complete: %s: %s",
                         type(e).__name__, e)

    def _error_snapshot(self, manager: ExtensionsManagerProtocol) -> None:
        self._save_on_error(manager, self._format_name(manager), LOCAL)

    def _save_on_error(self, manager: ExtensionsManagerProtocol, name: str, pg: Any) -> None:
        location = retention.join(self._out_dir, name)
        if (self._engine_writer and self._savefun is None and name not in self._superseded
                and _is_committed(location, self._storage_options)):
            logger.warning("ppe_snapshot: training failed at iteration %d; snapshot %s already holds this "
                           "position, so no snapshot on error is taken", manager.iteration, location)
            return
        self._save(manager, name, _state_of(self._resolve_target(manager)), pg)
        self._wait_in_flight()
        logger.warning("ppe_snapshot: training failed at iteration %d; saved snapshot %s", manager.iteration,
                       location)

    # -- retention ---------------------------------------------------------------
    def _prunes(self) -> bool:
        return self._owns_out_dir and hasattr(self.writer, "_add_cleanup_hook")

    def _prune(self) -> None:
        assert self._format is not None
        try:
            retention.prune(self._out_dir, self._format, self.n_retains, self._storage_options)
        except Exception as e:  # noqa: BLE001 - a failed cleanup must not fail the save or the training
            logger.warning("ppe_snapshot: removing old snapshots under %s failed: %s: %s", self._out_dir,
                           type(e).__name__, e)

    # -- autoload ----------------------------------------------------------------
    def _candidates(self) -> list[Candidate]:
        assert self._format is not None
        return retention.list_snapshots(self._out_dir, self._format, self._storage_options)

    def _autoload(self, manager: ExtensionsManagerProtocol) -> None:
        candidates = self._candidates()
        found = self._restore_newest(self._resolve_target(manager), candidates, LOCAL)
        self._resumed(manager, found, candidates)

    def _restore_newest(self, target: Any, candidates: list[Candidate], pg: Any) -> Candidate | None:
        """Restore the newest usable candidate, skipping (with a warning) those that are not."""
        touched: tuple[Candidate, BaseException] | None = None
        for candidate in reversed(candidates):
            try:
                self._restore(candidate, target, pg)
                return candidate
            except _Unusable as e:
                _skip(candidate, str(e))
            except Exception as e:  # noqa: BLE001 - a damaged snapshot is skipped, the next older one tried
                _skip(candidate, f"{type(e).__name__}: {e}")
                touched = (candidate, e)
        if touched is not None:
            raise _cannot_start_fresh(f"{touched[0].url} ({touched[1]})") from touched[1]
        return None

    def _restore(self, candidate: Candidate, target: Any, pg: Any) -> None:
        if not candidate.complete:
            raise _Unusable(candidate.problem or f"it is {candidate.kind}")
        if candidate.kind == "file":
            try:
                state = _load_file(candidate.url, self._storage_options)
            except Exception as e:  # noqa: BLE001 - nothing was loaded yet
                raise _Unusable(f"cannot be read by torch.load: {type(e).__name__}: {e}") from e
            _load_into(target, state)
            return
        snap = Snapshot(candidate.url, pg=pg, storage_options=self._storage_options)
        saved_kind = snap.metadata.get("ppe_snapshot_target", self._target_kind)
        if saved_kind != self._target_kind:
            raise _Unusable(f"it holds a {saved_kind} target and this extension's target is a {self._target_kind}")
        snap.restore({"state": _TargetState(target)})
        self._restore_rng(snap, pg)

    def _restore_rng(self, snap: Snapshot, pg: Any) -> None:
        section = 0 if pg is LOCAL else self._rng_rank  # a LOCAL snapshot's entries are all rank 0's
        prefix = f"{section}/{RNG_KEY}/"
        saved = sorted(int(k[len(prefix):]) for k in snap.get_manifest()
                       if k.startswith(prefix) and k[len(prefix):].isdigit())
        if self._rng_rank in saved:
            source = self._rng_rank
        elif saved:
            # A DISTRIBUTED snapshot on error holds the saver's state only (no collective there); ranks
            # seeded alike, as data-parallel ranks usually are, continue exactly from it.
            source = saved[0]
            logger.info("ppe_snapshot: %s holds no RNG state for rank %d; restoring rank %d's", snap.path,
                        self._rng_rank, source)
        else:
            logger.info("ppe_snapshot: %s holds no RNG state for rank %d; the random number generators "
                        "continue from their current state", snap.path, self._rng_rank)
            return
        RNGState().load_state_dict(snap.read_object(f"{prefix}{source}"))

    def _resumed(self, manager: ExtensionsManagerProtocol, found: Candidate | None,
                 candidates: list[Candidate]) -> None:
        if self._owns_out_dir:
            self._superseded = {c.name: c for c in candidates if found is None or found.is_older_than(c)}
        if found is None:
            logger.info("ppe_snapshot: autoload found no usable snapshot matching %r under %s; starting fresh",
                        self.filename, self._out_dir)
            return
        self.resumed_from = found.url
        logger.info("ppe_snapshot: resumed from %s at iteration %d (epoch %d)", found.url, manager.iteration,
                    manager.epoch)


def _cannot_start_fresh(what: str) -> SnapshotError:
    return SnapshotError(
        f"autoload: restoring {what} failed part way, so the target's state may be partly overwritten, and no "
        "older snapshot could be restored; training cannot start fresh safely. Repair or remove the damaged "
        "snapshots, or start with autoload=False.")


def _skip(candidate: Candidate, reason: str) -> None:
    message = f"ppe_snapshot autoload: skipping snapshot {candidate.url}: {reason}"
    logger.warning(message)
    warnings.warn(message, stacklevel=3)


def _load_file(url: str, storage_options: dict[str, Any] | None) -> Any:
    """A single-file (``torch.save``) snapshot, loaded with ``weights_only``.

    numpy arrays are allowed too: the numpy RNG state (``RNGState``) holds one.
    """
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    numpy_globals = [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with fsspec.open(url, "rb", **(storage_options or {})) as f, torch.serialization.safe_globals(numpy_globals):
        return torch.load(f, map_location=torch.device("cpu"), weights_only=True)


def _is_committed(location: str, storage_options: dict[str, Any] | None) -> bool:
    try:
        Snapshot(location, pg=LOCAL, storage_options=storage_options).metadata
    except Exception:  # noqa: BLE001 - absent or unreadable: not a committed snapshot
        return False
    return True


class _DistributedExtension(_Snapshot):
    """What DISTRIBUTED and SHARDED share: a process group, a designated rank, restoring together."""

    _mode = "DISTRIBUTED"
    #: The engine process group of a restore: each rank reads alone (LOCAL) or its own part (None).
    _restore_pg: Any = LOCAL

    def __init__(self, *, saver_rank: int, **options: Any) -> None:
        super().__init__(**options)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"snapshot_mode={self._mode} requires torch.distributed to be initialized "
                               "(call torch.distributed.init_process_group first)")
        self._rank = dist.get_rank()
        self._size = dist.get_world_size()
        if not 0 <= saver_rank < self._size:
            raise ValueError(f"Distributed snapshot requires a saver rank in the range [0-{self._size}); "
                             f"got saver_rank={saver_rank}")
        self._saver_rank = saver_rank
        self._rng_rank = self._rank

    @property
    def _is_saver(self) -> bool:
        return self._rank == self._saver_rank

    @property
    def _owns_out_dir(self) -> bool:
        return self._is_saver

    def _agree(self) -> tuple[list[Candidate], list[Candidate]]:
        """(what this rank listed, the complete snapshots every rank will try, oldest first)."""
        raise NotImplementedError

    def _autoload(self, manager: ExtensionsManagerProtocol) -> None:
        # Every rank restores the same snapshot at the same time, so a state_dict() or
        # load_state_dict() that is collective works; when any rank fails, all fall back together.
        target = self._resolve_target(manager)
        listed, agreed = self._agree()
        touched: list[str] = []
        found = None
        for candidate in reversed(agreed):
            outcome: tuple[str, bool] | None = None
            try:
                self._restore(candidate, target, self._restore_pg)
            except _Unusable as e:
                outcome = (f"rank {self._rank}: {e}", False)
            except Exception as e:  # noqa: BLE001 - every rank then falls back together
                outcome = (f"rank {self._rank}: {type(e).__name__}: {e}", True)
            outcomes: list[tuple[str, bool] | None] = [None] * self._size
            dist.all_gather_object(outcomes, outcome)
            problems = [o for o in outcomes if o is not None]
            if not problems:
                found = candidate
                break
            _skip(candidate, "; ".join(reason for reason, _ in problems))
            if any(partly for _, partly in problems):
                touched.append(candidate.url)
        if found is None and touched:
            raise _cannot_start_fresh(", ".join(touched))
        self._resumed(manager, found, listed)


class _DistributedSnapshot(_DistributedExtension):
    """Every rank gives its state; ``saver_rank`` writes it; every rank can restore it."""

    def _make_snapshot(self, manager: ExtensionsManagerProtocol) -> None:
        name = self._format_name(manager)
        state = _state_of(self._resolve_target(manager))  # on every rank: state_dict() may be collective
        rng = self._gather_rng_states() if self._engine_writer else None
        failure: list[str | None] = [None]
        if self._is_saver:
            try:
                self._save(manager, name, state, LOCAL, rng)
            except Exception as e:
                failure[0] = f"{type(e).__name__}: {e}"
                self._broadcast(failure)
                raise
        self._broadcast(failure)  # also the barrier: every rank returns once the save is handed off
        if failure[0] is not None:
            raise SnapshotError(f"snapshot {name} failed on saver rank {self._saver_rank}: {failure[0]}")

    def _gather_rng_states(self) -> dict[int, Any] | None:
        """Every rank's RNG state, on the saver rank (it writes them all; each rank restores its own)."""
        if self._size == 1:
            return self._rng_states()
        states: list[Any] | None = [None] * self._size if self._is_saver else None
        dist.gather_object(RNGState().state_dict(), states, dst=self._saver_rank)
        return dict(enumerate(states)) if states is not None else None

    def _broadcast(self, objects: list[Any]) -> None:
        if self._size > 1:
            dist.broadcast_object_list(objects, src=self._saver_rank)

    def _error_snapshot(self, manager: ExtensionsManagerProtocol) -> None:
        # No collective here: the other ranks have not failed and are not listening.
        if self._is_saver:
            self._save_on_error(manager, self._format_name(manager), LOCAL)
        else:
            logger.warning("ppe_snapshot: training failed on rank %d; only saver rank %d writes snapshots, so "
                           "no snapshot on error is taken here", self._rank, self._saver_rank)

    def _agree(self) -> tuple[list[Candidate], list[Candidate]]:
        listed: list[Candidate] = []
        agreed: list[Any] = [[], None]  # the saver rank's view of the output directory decides
        if self._is_saver:
            try:
                listed = self._candidates()
            except Exception as e:  # noqa: BLE001 - every rank raises it below
                agreed[1] = f"{type(e).__name__}: {e}"
            for c in listed:
                if not c.complete:
                    _skip(c, c.problem or f"it is {c.kind}")
            agreed[0] = [c for c in listed if c.complete]
        self._broadcast(agreed)
        if agreed[1] is not None:
            raise SnapshotError(f"autoload: saver rank {self._saver_rank} could not list {self._out_dir}: {agreed[1]}")
        return listed, agreed[0]


class _ShardedSnapshot(_DistributedExtension):
    """Every rank writes its own state into one snapshot with one manifest."""

    _mode = "SHARDED"
    _restore_pg = None

    def _make_snapshot(self, manager: ExtensionsManagerProtocol) -> None:
        self._save(manager, self._format_name(manager), _state_of(self._resolve_target(manager)), None)

    def _error_snapshot(self, manager: ExtensionsManagerProtocol) -> None:
        # The other ranks are not taking part, so a snapshot of the whole group cannot commit:
        # this rank saves its own state alone, under a name autoload does not pick up.
        name = f"{self._format_name(manager)}.error-rank{self._rank}"
        logger.warning("ppe_snapshot: training failed on rank %d; saving this rank's state alone to %s "
                       "(a rank-local snapshot, not used by autoload)", self._rank, name)
        self._save_on_error(manager, name, LOCAL)

    def _agree(self) -> tuple[list[Candidate], list[Candidate]]:
        listed: list[Candidate] = []
        problem = None
        try:
            listed = self._candidates()
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            problem = f"rank {self._rank}: {type(e).__name__}: {e}"
        for c in listed:
            if c.kind != "snapshot":
                _skip(c, c.problem or "a single-file snapshot cannot hold the state of every rank")
        mine = [c for c in listed if c.kind == "snapshot"]
        seen: list[Any] = [None] * self._size
        dist.all_gather_object(seen, problem or [c.name for c in mine])
        problems = [p for p in seen if isinstance(p, str)]
        if problems:
            raise SnapshotError(f"autoload: could not list {self._out_dir}: {'; '.join(problems)}")
        everywhere = set.intersection(*(set(names) for names in seen))
        for c in mine:
            if c.name not in everywhere:
                _skip(c, "it is not complete as seen from every rank")
        return listed, [c for c in mine if c.name in everywhere]
