"""The snapshot extension in one process (SnapshotMode.DEFAULT): ppe's Extension protocol.

``initialize`` (autoload), ``__call__`` (a snapshot at each trigger),
``on_error`` and ``finalize``; the writer settled when the snapshot first
runs, the stats reported through ppe's reporter, retention run after each
committed save. What a snapshot holds is :mod:`.saved_state`'s; listing,
pruning and the choice of what to resume from are :mod:`ppe_snapshot.run_dir`'s;
the ranks of DISTRIBUTED / SHARDED modes agree in :mod:`.rank_agreement`.
"""
from __future__ import annotations

import logging
import time
import types
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Callable

from pytorch_pfn_extras import reporting
from pytorch_pfn_extras.training import ExtensionsManagerProtocol, extension
from pytorch_pfn_extras.writing import Writer

from ppe_snapshot import ppe_private, run_dir, stored_snapshot
from ppe_snapshot.engine import LOCAL, RNGState, StateDict
from ppe_snapshot.extension import ppe_compat, saved_state, stats_report
from ppe_snapshot.extension.local_steps import LocalSteps
from ppe_snapshot.extension.preemption import Preemption, preempt
from ppe_snapshot.extension.resuming import Resuming
from ppe_snapshot.extension.saved_state import RNG_KEY, state_to_save
from ppe_snapshot.extension.staging_ahead import prepare_staging_ahead
from ppe_snapshot.local_tier import local_tier
from ppe_snapshot.run_dir import Candidate, CandidateKind
from ppe_snapshot.storage import join
from ppe_snapshot.writing import ImageLoan, SnapshotWriter

logger = logging.getLogger(__name__)


def _always_true() -> bool:
    return True


class SnapshotExtension(Resuming, extension.Extension):
    """Snapshots in one process (SnapshotMode.DEFAULT)."""

    trigger = 1, "epoch"
    priority = extension.PRIORITY_SNAPSHOT
    needs_model_state = True

    #: ppe's name for its class of this mode: the manager keys each extension's state by it, so ppe's snapshots and
    #: ours restore each other's managers.
    _ppe_name = "_Snapshot"

    @property
    def default_name(self) -> str:
        """ppe's name for its class of this mode (``_Snapshot``, ``_DistributedSnapshot``, ``_ShardedSnapshot``); a
        subclass of ours keeps its own class name."""
        return self._ppe_name if "_ppe_name" in type(self).__dict__ else type(self).__name__

    def __init__(self, target: Any = None, condition: Callable[[], bool] | None = None,
                 writer: Writer | None = None, filename: str | Callable[[Any], str] = "snapshot_iter_{.iteration}",
                 snapshot_on_error: bool = False, n_retains: int = -1, autoload: bool = False,
                 savefun: Any = None, allow_pickle: bool = False, keep: run_dir.Policy | None = None,
                 save_on_signals: Iterable[Any] = (), preempted_exit_code: int | None = None,
                 incremental: bool = False, local: Any = None) -> None:
        ppe_compat.check_writer(writer)
        #: The local tier asked for (``local=``), or None; :attr:`_local` runs it once initialized.
        self.local_tier = local_tier(local)
        if self.local_tier is not None and savefun is not None:
            raise ValueError("local= keeps engine snapshots in node-local memory; a savefun writes single files: "
                             "give one or the other")
        self._local: LocalSteps | None = None
        if not isinstance(incremental, bool):
            raise TypeError(f"incremental must be True or False, got {incremental!r}")
        if incremental and savefun is not None:
            raise ValueError("incremental=True writes engine snapshots, which reference the blocks of the previous "
                             "one; a savefun writes whole single files: give one or the other")
        #: Each save references the unchanged blocks of the previous complete snapshot (the writer's).
        self.incremental = incremental
        self._missing_warned = False
        #: Preemption (``save_on_signals``): the signals watched and the agreement on the iteration to save.
        self.preemption = self._watch(save_on_signals, preempted_exit_code) if save_on_signals else None
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
        self._file_savefun = savefun
        self._allow_pickle = allow_pickle
        #: Retention: ``n_retains`` (KeepLatest) and ``keep`` together, or None.
        self.policy: run_dir.Policy | None
        self._format, self.policy = ppe_compat.naming_and_retention(filename, autoload=autoload, n_retains=n_retains,
                                                                    keep=keep)
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
        # Names this run saved: retention keeps the newest of them, even where an earlier run's outrank them.
        self._saved: set[str] = set()
        # Reports the stats into the next iteration's observation (set when the manager starts its extensions).
        self._stats_reporter: stats_report.StatsReporter | None = None

    # -- what and where -------------------------------------------------------
    @property
    def _target_kind(self) -> str:
        return saved_state.target_kind(self._target)

    def _resolve_target(self, manager: ExtensionsManagerProtocol) -> Any:
        return manager if self._target is None else self._target

    def _format_name(self, manager: ExtensionsManagerProtocol) -> str:
        name = self.filename(manager) if callable(self.filename) else self.filename.format(manager)
        ppe_compat.check_inside(name)  # a callable's names, and fields' values, are known only now
        return name

    #: What removes the optimizer hooks that have the writer and the local tier make their staging memory ready
    #: again after the first step (:mod:`.staging_ahead`).
    _end_staging_ahead: Callable[[], None] = staticmethod(lambda: None)

    def _prepare_staging(self, manager: ExtensionsManagerProtocol) -> None:
        """Have the writer (where this rank's saves stage through it) and the local tier make their staging memory
        ready before the first save (:mod:`.staging_ahead`)."""
        state = self._staged_state(manager)
        writer = self._engine_writer
        prepares = []
        if writer is not None and self._file_savefun is None and self._writes:
            prepares.append(writer.prepare_staging)
        if self._local is not None:
            prepares.append(self._local.saves.prepare_staging)
        if state is not None and prepares:
            self._end_staging_ahead = prepare_staging_ahead(prepares, manager, state,
                                                            restored=self.resumed_from is not None)

    def _staged_state(self, manager: ExtensionsManagerProtocol) -> Callable[[], Any] | None:
        """What tells the size of this rank's saves, None where it cannot be known outside a save: here the state
        itself."""
        target = self._resolve_target(manager)
        return lambda: state_to_save(target)

    @property
    def _writes(self) -> bool:
        """Whether this rank's saves write a state (its writer stages it)."""
        return True

    @property
    def _owns_out_dir(self) -> bool:
        """Whether this process removes snapshots (one process per output directory)."""
        return True

    @property
    def _engine_writer(self) -> SnapshotWriter | None:
        """The writer when it takes engine snapshots with what the extension records (our contract), else None:
        a writer of ppe's protocol only, called as ppe calls it."""
        return self.writer if isinstance(self.writer, SnapshotWriter) else None

    @property
    def _reads_pickle(self) -> bool:
        """Whether autoload may unpickle: opted in here or on the writer."""
        writer = self._engine_writer
        return self._allow_pickle or (writer is not None and writer.allow_pickle is True)

    def _bind(self, manager: ExtensionsManagerProtocol) -> None:
        """Settle the writer and output directory when the snapshot first runs (ppe looks up
        ``manager.writer`` then too), so calling it or ``on_error`` before ``initialize()`` works."""
        if self._bound:
            return
        chosen = self.writer if self._writer_given else manager.writer
        if chosen is None:
            raise RuntimeError("snapshot: no writer; the manager has none and none was given (writer=...)")
        ppe_compat.check_writer(chosen)
        writer = chosen
        if self._file_savefun is None and not isinstance(chosen, SnapshotWriter):
            writer = ppe_compat.counterpart(chosen) or chosen
            if writer is not chosen:
                self._stood_in_for = chosen
        self.writer = writer
        if isinstance(writer, SnapshotWriter):
            out_dir: Any = writer.out_dir
            options = writer.storage_options
        else:  # a writer of ppe's protocol only may have no out_dir; it has no storage options
            out_dir, options = getattr(writer, "out_dir", ""), None
        self._out_dir = out_dir if isinstance(out_dir, str) and out_dir else manager.out
        self._storage_options = options if isinstance(options, dict) else None
        if self.policy is not None and self._format is not None and self._prunes():
            ppe_private.add_cleanup_hook(writer, self._prune)
        if self.incremental:
            if not isinstance(writer, SnapshotWriter):
                raise TypeError(f"incremental=True needs a ppe_snapshot writer (SimpleWriter, ThreadWriter, "
                                f"ProcessWriter, ...), got {type(writer).__name__}")
            writer.incremental = True  # a SnapshotWriter that saves only full snapshots refuses, saying the same
        self._bound = True

    # -- extension protocol ----------------------------------------------------
    def initialize(self, manager: ExtensionsManagerProtocol) -> str | None:  # type: ignore[override]
        """Restore with ``autoload``; returns the restored snapshot's name relative to the output
        directory (as ppe does), or None."""
        self._bind(manager)
        self._stats_reporter = stats_report.attach(manager)
        if self.local_tier is not None and self._local is None:
            rank, size = self._tier_ranks
            self._local = LocalSteps.start(self.local_tier, self, manager, self._out_dir, rank, size)
        listed = self._autoload(manager) if self.autoload else None
        writer = self._engine_writer
        if (self.incremental and self.resumed_name is not None and writer is not None
                and writer.base is None):  # not a local tier's part: outside the output directory
            writer.base = self.resumed_from  # the first save references it
        if self.policy is not None and self._format is not None and self._prunes():
            self._prune(listed)  # a run killed between a commit and its pruning left more than the policy keeps
        self._prepare_staging(manager)
        if self.preemption is not None:
            self.preemption.install()
            if not self.preemption.wrap_trigger(manager, self):
                logger.warning("save_on_signals: the manager has no entry for this snapshot; a signal "
                               "is acted on only when the snapshot's own trigger fires")
        return self.resumed_name

    def __call__(self, manager: ExtensionsManagerProtocol) -> None:
        self._bind(manager)
        self._end_staging_ahead()  # its hooks have fired by now, or the state has no optimizer step before a save
        if self.preemption is not None and self.preemption.decided is not None:
            preempt(self, manager, self.preemption)  # raises Preempted
        durable = self._local is None or self._local.durable_due
        local = self._local is not None and self._local.local_due
        # A local step saved with a durable snapshot copies the state from the durable save's staged image.
        writer = self._engine_writer if local and durable and self._file_savefun is None else None
        loan = writer.lend_staged_image() if writer is not None else None
        try:
            if durable and self.condition():
                self._make_snapshot(manager)
            if local:
                self._save_local(manager, loan)
                loan = None  # the local tier ends it
        finally:
            if loan is not None:
                loan.release()

    def on_error(self, manager: ExtensionsManagerProtocol, exc: Exception, tb: types.TracebackType) -> None:
        super().on_error(manager, exc, tb)
        if not self._snapshot_on_error:
            return
        # An extension that raised in an iteration where no snapshot was due leaves the models marked
        # unavailable (ppe's guard for extensions without needs_model_state); the snapshot needs them.
        with ppe_private.models_available(manager):
            try:
                self._bind(manager)
                self._wait_in_flight()
                self._error_snapshot(manager)
            except Exception as e:  # noqa: BLE001 - the training error is the one that must propagate
                # Logged, not warned: a test setup turning warnings into errors must still see the training error.
                logger.error("the snapshot on error failed: %s: %s", type(e).__name__, e,
                             exc_info=(type(e), e, e.__traceback__))

    def finalize(self, manager: ExtensionsManagerProtocol) -> None:
        self._end_staging_ahead()
        if self.preemption is not None:
            self.preemption.uninstall()
        if self._local is not None:
            self._local.finish()
        try:
            if self.writer is not None:
                self.writer.finalize()
        finally:
            if self._stood_in_for is not None:
                ppe_compat.stand_down(self._stood_in_for, self._writer_given)

    def _watch(self, signals: Iterable[Any], exit_code: int | None) -> Preemption:
        return Preemption(signals, exit_code)

    # -- saving ------------------------------------------------------------------
    #: (this process's rank, the world size) among the ranks of the local tier.
    _tier_ranks = (0, 1)

    def _save_local(self, manager: ExtensionsManagerProtocol, loan: ImageLoan | None) -> None:
        assert self._local is not None
        state = state_to_save(self._resolve_target(manager))
        self._local.save(manager, state, self._rng_rank, saved_state.metadata(manager, self._target_kind), loan)

    def _make_snapshot(self, manager: ExtensionsManagerProtocol) -> None:
        self._save(manager, self._format_name(manager), state_to_save(self._resolve_target(manager)), LOCAL)

    #: This process's key in the saved RNG states (its global rank in distributed modes).
    _rng_rank = 0

    def _rng_states(self) -> dict[int, Any]:
        """The RNG states to save, by rank: this process's own."""
        return {self._rng_rank: RNGState().state_dict()}

    def _save(self, manager: ExtensionsManagerProtocol, name: str, state: Any, pg: Any,
              rng: dict[int, Any] | None = None, self_contained: bool = False) -> None:
        """Save ``state`` as ``name``; ``self_contained``: never incremental (a snapshot retention does not see)."""
        if not self._saved and not self.autoload:
            self._warn_of_later_runs(manager)
        self._saved.add(name)
        writer = self._engine_writer
        if writer is None:  # ppe's protocol
            start = time.perf_counter()
            self.writer(name, manager.out, state, savefun=self._file_savefun)
            self._report(manager, name, {"blocking_s": time.perf_counter() - start}, None)
            return
        stale = self._superseded.pop(name, None)
        if stale is not None and self._file_savefun is None:
            stored_snapshot.remove_snapshot(stale.url, self._storage_options)
            logger.warning("removed %s, which autoload skipped as %s, to save this position again",
                           stale.url, stale.kind if stale.kind != CandidateKind.SNAPSHOT else CandidateKind.DAMAGED)
        self._rejected.discard(name)
        previous = writer.last_stats
        rng = self._rng_states() if rng is None else rng
        more = {"incremental": False} if self_contained and self.incremental else {}
        writer(name, manager.out, state, savefun=self._file_savefun,
               metadata=saved_state.metadata(manager, self._target_kind, self._metrics(manager)), pg=pg,
               extra_state={RNG_KEY: StateDict(rng)}, allow_pickle=True if self._allow_pickle else None, **more)
        self._report(manager, name, writer.last_stats, previous)

    def _report(self, manager: ExtensionsManagerProtocol, name: str, stats: Mapping[str, Any],
                previous: Mapping[str, Any] | None) -> None:
        write_s = stats.get("write_s")
        if write_s is None and previous is not None and previous is not stats:
            write_s = previous.get("write_s")
        values = {"snapshot/blocking_s": stats.get("blocking_s"), "snapshot/write_s": write_s,
                  "snapshot/bytes": stats.get("bytes")}
        values = {k: v for k, v in values.items() if v is not None}
        if self._stats_reporter is not None:  # reported before LogReport reads the next iteration's observation
            self._stats_reporter.add(stats)
        else:  # a manager that did not start its extensions: into this iteration's observation
            reporting.report(values)
        logger.info("snapshot %s at iteration %s: %s", name, manager.iteration,
                    ", ".join(f"{k.split('/')[1]}={v:.3f}" if k.endswith("_s") else f"{k.split('/')[1]}={v}"
                              for k, v in values.items()))

    def _wait_in_flight(self) -> None:
        writer = self._engine_writer
        if writer is None:  # ppe's protocol has nothing to wait for
            return
        try:
            writer.wait()
        except Exception as e:  # noqa: BLE001 - reported; the snapshot on error is still taken
            logger.error("the snapshot in flight when training failed did not complete: %s: %s",
                         type(e).__name__, e)

    def _error_snapshot(self, manager: ExtensionsManagerProtocol) -> None:
        self._save_on_error(manager, self._format_name(manager), LOCAL)

    def _save_on_error(self, manager: ExtensionsManagerProtocol, name: str, pg: Any,
                       self_contained: bool = False) -> None:
        location = join(self._out_dir, name)
        if (self._engine_writer is not None and self._file_savefun is None and name not in self._superseded
                and stored_snapshot.inspect(location, self._storage_options).iteration == manager.iteration):
            logger.warning("training failed at iteration %s; snapshot %s already holds this "
                           "position, so no snapshot on error is taken", manager.iteration, location)
            return
        self._save(manager, name, state_to_save(self._resolve_target(manager)), pg, self_contained=self_contained)
        if self._engine_writer is not None:
            self._engine_writer.wait()  # a failed save raises here: on_error logs it, never as saved
        logger.warning("training failed at iteration %s; saved snapshot %s", manager.iteration,
                       location)

    # -- retention ---------------------------------------------------------------
    def _metrics(self, manager: ExtensionsManagerProtocol) -> dict[str, float]:
        """The observed values the policy needs (``KeepBest``'s key), recorded in the snapshot's metadata."""
        keys = self.policy.recorded_keys if self.policy is not None else ()
        if not keys:
            return {}
        found, missing = saved_state.observed(manager, keys)
        if missing and not self._missing_warned:
            self._missing_warned = True
            warnings.warn(f"ppe_snapshot: the observation of iteration {manager.iteration} has no number for "
                          f"{missing} (report it from an extension of higher priority than the snapshot, e.g. an "
                          f"Evaluator); snapshots without it are not candidates for KeepBest", stacklevel=3)
        return found

    def _prunes(self) -> bool:
        return self._owns_out_dir and ppe_private.takes_cleanup_hooks(self.writer)  # ppe's own check, for any writer

    def _prune(self, listed: list[Candidate] | None = None) -> None:
        """Apply the policy to the output directory (as ``listed`` there, when autoload just listed it)."""
        assert self._format is not None
        try:
            assert self.policy is not None
            run_dir.prune(self._out_dir, self._format, self.policy, self._storage_options, rejected=self._rejected,
                          protect=() if self.resumed_name is None else (self.resumed_name,), own=self._saved,
                          listed=listed)
        except Exception as e:  # noqa: BLE001 - a failed cleanup must not fail the save or the training
            logger.warning("removing old snapshots under %s failed: %s: %s", self._out_dir,
                           type(e).__name__, e)
