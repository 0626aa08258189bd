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
from typing import Any, Callable

from pytorch_pfn_extras import reporting
from pytorch_pfn_extras.training import extension
from pytorch_pfn_extras.training._manager_protocol import ExtensionsManagerProtocol
from pytorch_pfn_extras.training.extensions import SnapshotMode
from pytorch_pfn_extras.writing import Writer

from ppe_snapshot import ppe_glue, retention
from ppe_snapshot.engine import LOCAL, RNGState, Snapshot, StateDict
from ppe_snapshot.resume import Unusable, cannot_start_fresh, holds_iteration, load_file, opened, skip
from ppe_snapshot.retention import Candidate, FilenameFormat
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
             saver_rank: int | None = None, snapshot_mode: SnapshotMode = SnapshotMode.DEFAULT,
             allow_pickle: bool = False) -> "_Snapshot":
    """An extension that snapshots the training state (the manager, or ``target``).

    Args:
        savefun: None (the default) saves an engine snapshot, a directory at
            ``<out_dir>/<filename>``. A function such as ``torch.save`` saves
            one file the way pytorch-pfn-extras does. Not with ``writer``.
        filename: A format string the manager is passed to
            (``"snapshot_iter_{.iteration}"``), or a callable taking the manager.
            It names a place inside the output directory. A name without
            format fields (``"snapshot_latest"``) is saved again at every
            trigger, replacing the previous snapshot crash-safely.
        target: What to save: the manager (None), an object with
            ``state_dict()``/``load_state_dict()``, or a dict of them.
        condition: Called without arguments at each trigger; no snapshot when it returns False.
        writer: Where the save runs: a :mod:`ppe_snapshot.writing` writer
            (Simple, Thread, Process, ...) or any ppe writer. None (the
            default): the manager's writer, looked up when the snapshot first
            runs. ppe's own built-in writers are stood in for by the
            ``ppe_snapshot`` writer of the same kind on their ``out_dir``, so
            snapshots are engine snapshots unless ``savefun`` is given.
        snapshot_on_error: Save once when the training loop raises (the error propagates).
        n_retains: Keep this many newest complete snapshots (an int; positive to enable);
            needs a string ``filename``.
        autoload: At start, restore the newest complete, valid snapshot; damaged ones
            are skipped with a warning. Needs a string ``filename``.
        saver_rank: The rank that writes in DISTRIBUTED mode (given in DEFAULT mode,
            it selects DISTRIBUTED mode). In SHARDED mode the rank that prunes (default 0).
        snapshot_mode: DEFAULT (one process), DISTRIBUTED (``saver_rank`` writes the
            state every rank holds) or SHARDED (every rank writes its part of one snapshot).
        allow_pickle: Keyword-only, beyond ppe's signature: let snapshots hold
            values only pickle can store, and let autoload unpickle them (which
            runs code from the snapshot: only for snapshots you trust).

    ``initialize()`` (called by the manager at start) returns the name of the
    snapshot autoload restored, relative to the output directory (as ppe
    does), or None; ``resumed_from`` holds its full path or URL.

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
                   snapshot_on_error=snapshot_on_error, n_retains=n_retains, autoload=autoload, savefun=savefun,
                   allow_pickle=allow_pickle)
    from ppe_snapshot.extension_distributed import DistributedSnapshot, ShardedSnapshot
    if snapshot_mode == SnapshotMode.DEFAULT:
        if saver_rank is None:
            return _Snapshot(**options)
        return DistributedSnapshot(saver_rank=saver_rank, **options)
    if snapshot_mode == SnapshotMode.DISTRIBUTED:
        if saver_rank is None:
            raise ValueError("snapshot_mode=SnapshotMode.DISTRIBUTED needs saver_rank: the rank that writes "
                             "the snapshots (e.g. saver_rank=0)")
        return DistributedSnapshot(saver_rank=saver_rank, **options)
    if snapshot_mode == SnapshotMode.SHARDED:
        return ShardedSnapshot(saver_rank=0 if saver_rank is None else saver_rank, **options)
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


class _Snapshot(extension.Extension):
    """Snapshots in one process (SnapshotMode.DEFAULT)."""

    trigger = 1, "epoch"
    priority = extension.PRIORITY_SNAPSHOT
    needs_model_state = True

    def __init__(self, target: Any = None, condition: Callable[[], bool] | None = None,
                 writer: Writer | None = None, filename: str | Callable[[Any], str] = "snapshot_iter_{.iteration}",
                 snapshot_on_error: bool = False, n_retains: int = -1, autoload: bool = False,
                 savefun: Any = None, allow_pickle: bool = False) -> None:
        ppe_glue.check_writer(writer)
        ppe_glue.check_n_retains(n_retains)
        if not isinstance(allow_pickle, bool):
            raise TypeError(f"allow_pickle must be True or False, got {allow_pickle!r}")
        self._target = target
        self.filename = filename
        self.condition = _always_true if condition is None else condition
        #: The writer that saves: the one given, or (once the snapshot first runs) the manager's
        #: writer, or the ppe_snapshot writer standing in for ppe's built-in one.
        self.writer = writer
        self._writer_given = writer is not None
        self._bound = False
        self._stood_in_for: Any = None  # the ppe writer that self.writer stands in for
        self._snapshot_on_error = snapshot_on_error
        self.n_retains = n_retains
        self.autoload = autoload
        self._savefun = savefun
        self._allow_pickle = allow_pickle
        self._format: FilenameFormat | None = None
        if isinstance(filename, str):
            ppe_glue.check_inside(filename)
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
        #: The same relative to the output directory, as ``initialize()`` returns it (ppe's ``loaded_fn``).
        self.resumed_name: str | None = None
        # Names newer than the resumed position that autoload skipped; replaced when saved again.
        self._superseded: dict[str, Candidate] = {}
        # Names autoload skipped: retention never counts them as kept snapshots until saved again.
        self._rejected: set[str] = set()

    # -- what and where -------------------------------------------------------
    @property
    def _target_kind(self) -> str:
        if self._target is None:
            return "manager"
        return "dict" if type(self._target) is dict else "object"

    def _resolve_target(self, manager: ExtensionsManagerProtocol) -> Any:
        return manager if self._target is None else self._target

    def _format_name(self, manager: ExtensionsManagerProtocol) -> str:
        name = self.filename(manager) if callable(self.filename) else self.filename.format(manager)
        ppe_glue.check_inside(name)  # a callable's names, and fields' values, are known only now
        return name

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

    @property
    def _reads_pickle(self) -> bool:
        """Whether autoload may unpickle: opted in here or on the writer."""
        return self._allow_pickle or getattr(self.writer, "allow_pickle", False) is True

    def _bind(self, manager: ExtensionsManagerProtocol) -> None:
        """Settle the writer and output directory when the snapshot first runs (ppe looks up
        ``manager.writer`` then too), so calling it or ``on_error`` before ``initialize()`` works."""
        if self._bound:
            return
        chosen = self.writer if self._writer_given else manager.writer
        if chosen is None:
            raise RuntimeError("snapshot: no writer; the manager has none and none was given (writer=...)")
        ppe_glue.check_writer(chosen)
        writer = chosen
        if self._savefun is None and not isinstance(chosen, WriterBase):
            writer = ppe_glue.counterpart(chosen) or chosen
            if writer is not chosen:
                self._stood_in_for = chosen
        self.writer = writer
        out_dir = getattr(writer, "out_dir", "")  # a writer of the ppe protocol only may have none
        self._out_dir = out_dir if isinstance(out_dir, str) and out_dir else manager.out
        options = getattr(writer, "storage_options", None)
        self._storage_options = options if isinstance(options, dict) else None
        if self.n_retains > 0 and self._format is not None and self._prunes():
            writer._add_cleanup_hook(self._prune)
        self._bound = True

    # -- extension protocol ----------------------------------------------------
    def initialize(self, manager: ExtensionsManagerProtocol) -> str | None:  # type: ignore[override]
        """Restore with ``autoload``; returns the restored snapshot's name relative to the output
        directory (as ppe does), or None."""
        self._bind(manager)
        if self.autoload:
            self._autoload(manager)
        return self.resumed_name

    def __call__(self, manager: ExtensionsManagerProtocol) -> None:
        self._bind(manager)
        if self.condition():
            self._make_snapshot(manager)

    def on_error(self, manager: ExtensionsManagerProtocol, exc: Exception, tb: types.TracebackType) -> None:
        super().on_error(manager, exc, tb)
        if not self._snapshot_on_error:
            return
        # An extension that raised in an iteration where no snapshot was due leaves the models marked
        # unavailable (ppe's guard for extensions without needs_model_state); the snapshot needs them.
        available = getattr(manager, "_model_available", None)
        if available is False:
            manager._model_available = True  # type: ignore[attr-defined]
        try:
            self._bind(manager)
            self._wait_in_flight()
            self._error_snapshot(manager)
        except Exception as e:  # noqa: BLE001 - the training error is the one that must propagate
            # Logged, not warned: a test setup turning warnings into errors must still see the training error.
            logger.error("ppe_snapshot: the snapshot on error failed: %s: %s", type(e).__name__, e,
                         exc_info=(type(e), e, e.__traceback__))
        finally:
            if available is False:
                manager._model_available = False  # type: ignore[attr-defined]

    def finalize(self, manager: ExtensionsManagerProtocol) -> None:
        try:
            if self.writer is not None:
                self.writer.finalize()
        finally:
            if self._stood_in_for is not None:
                ppe_glue.stand_down(self._stood_in_for, self._writer_given)

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
        self._rejected.discard(name)
        previous = getattr(writer, "last_stats", None)
        rng = self._rng_states() if rng is None else rng
        writer(name, manager.out, state, savefun=self._savefun, metadata=self._metadata(manager), pg=pg,
               extra_state={RNG_KEY: StateDict(rng)}, allow_pickle=True if self._allow_pickle else None)
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
        logger.info("ppe_snapshot: snapshot %s at iteration %s: %s", name, manager.iteration,
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
                and holds_iteration(location, self._storage_options, manager.iteration)):
            logger.warning("ppe_snapshot: training failed at iteration %s; snapshot %s already holds this "
                           "position, so no snapshot on error is taken", manager.iteration, location)
            return
        self._save(manager, name, _state_of(self._resolve_target(manager)), pg)
        self._wait_in_flight()
        logger.warning("ppe_snapshot: training failed at iteration %s; saved snapshot %s", manager.iteration,
                       location)

    # -- retention ---------------------------------------------------------------
    def _prunes(self) -> bool:
        return self._owns_out_dir and hasattr(self.writer, "_add_cleanup_hook")

    def _prune(self) -> None:
        assert self._format is not None
        try:
            retention.prune(self._out_dir, self._format, self.n_retains, self._storage_options,
                            rejected=self._rejected)
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
            except Unusable as e:
                self._skip(candidate, str(e))
            except Exception as e:  # noqa: BLE001 - a damaged snapshot is skipped, the next older one tried
                self._skip(candidate, f"{type(e).__name__}: {e}")
                touched = (candidate, e)
        if touched is not None:
            raise cannot_start_fresh(f"{touched[0].url} ({touched[1]})") from touched[1]
        return None

    def _skip(self, candidate: Candidate, reason: str) -> None:
        skip(candidate, reason)
        self._rejected.add(candidate.name)

    def _restore(self, candidate: Candidate, target: Any, pg: Any) -> None:
        if not candidate.complete:
            raise Unusable(candidate.problem or f"it is {candidate.kind}")
        if candidate.kind == "file":
            try:
                state = load_file(candidate.url, self._storage_options)
            except Exception as e:  # noqa: BLE001 - nothing was loaded yet
                raise Unusable(f"cannot be read by torch.load: {type(e).__name__}: {e}") from e
            _load_into(target, state)
            return
        snap, metadata = opened(candidate, pg, self._storage_options, self._reads_pickle)
        saved_kind = metadata.get("ppe_snapshot_target", self._target_kind)
        if saved_kind != self._target_kind:
            raise Unusable(f"it holds a {saved_kind} target and this extension's target is a {self._target_kind}")
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
        self.resumed_name = found.name
        logger.info("ppe_snapshot: resumed from %s at iteration %s (epoch %s)", found.url, manager.iteration,
                    manager.epoch)
