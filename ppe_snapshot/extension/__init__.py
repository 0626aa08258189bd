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

The modules: ``ppe_extension`` (ppe's Extension protocol, one process),
``rank_agreement`` (DISTRIBUTED and SHARDED modes), ``save_outcomes``
(DISTRIBUTED: how the saver's saves ended, told to every rank), ``saved_state`` (what a
snapshot holds and restoring it), ``ppe_compat`` (ppe's arguments and
writers), ``loading`` (``load_snapshot``: a snapshot read outside the
trainer), ``epoch_batches`` (the loop that resumes mid-epoch). Listing,
pruning and choosing what to resume from are :mod:`ppe_snapshot.run_dir`'s; writers meet the extension through
:class:`ppe_snapshot.writing.SnapshotWriter`.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable

from pytorch_pfn_extras.training.extensions import SnapshotMode
from pytorch_pfn_extras.writing import Writer

from ppe_snapshot.extension.epoch_batches import epoch_batches
from ppe_snapshot.extension.loading import load_snapshot
from ppe_snapshot.extension.ppe_extension import SnapshotExtension
from ppe_snapshot.extension.rank_agreement import DistributedSnapshot, ShardedSnapshot
from ppe_snapshot.extension.saved_state import RNG_KEY
from ppe_snapshot.local_tier import LocalTier
from ppe_snapshot.run_dir import Policy

__all__ = ["RNG_KEY", "SnapshotMode", "epoch_batches", "load_snapshot", "snapshot", "snapshot_object"]


def snapshot_object(target: Any, filename: str, savefun: Any = None, **kwargs: Any) -> SnapshotExtension:
    """An extension that snapshots ``target`` (an object with ``state_dict()`` or a dict of them).

    Takes the keyword arguments of :func:`snapshot`.
    """
    return snapshot(target=target, filename=filename, savefun=savefun, **kwargs)


def snapshot(savefun: Any = None, filename: str | Callable[[Any], str] = "snapshot_iter_{.iteration}", *,
             target: Any = None, condition: Callable[[], bool] | None = None, writer: Writer | None = None,
             snapshot_on_error: bool = False, n_retains: int = -1, autoload: bool = False,
             saver_rank: int | None = None, snapshot_mode: SnapshotMode = SnapshotMode.DEFAULT,
             allow_pickle: bool = False, keep: Policy | None = None, save_on_signals: Iterable[Any] = (),
             preempted_exit_code: int | None = None, incremental: bool = False,
             local: LocalTier | dict[str, Any] | None = None) -> SnapshotExtension:
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
        n_retains: Keep this many newest complete snapshots (an int; positive to enable).
            The same as ``keep=KeepLatest(n_retains)``. As in ppe, it prunes only names of a string
            ``filename``: with a callable one it is ignored (with a warning) and every snapshot kept.
        keep: Keyword-only, beyond ppe's signature: a retention policy of
            :mod:`ppe_snapshot.retention` (``KeepLatest(n)``, ``KeepEvery(n, unit)``,
            ``KeepBest(key, n, mode)``, ``a | b``); with ``n_retains``, their union. Retention runs
            after each committed save and once at start (after autoload). ``KeepBest`` reads its key
            from ``manager.observation`` when the snapshot is taken (report it from an extension of
            higher priority, e.g. an Evaluator) and records it in the snapshot's metadata; single-file
            snapshots (``savefun``) record nothing, so they are never KeepBest candidates.
        save_on_signals: Keyword-only: signals (e.g. ``(signal.SIGTERM,)``) that preempt the run. The
            handler only records the signal; at the end of the iteration it came in, the state is
            saved with the writer (whatever the trigger and ``condition``), waited for until durable, the
            manager is finalized and :class:`ppe_snapshot.Preempted` (a ``SystemExit``) is raised. In
            DISTRIBUTED / SHARDED modes every rank saves the same iteration, whichever rank got the
            signal (see :mod:`ppe_snapshot.extension.preemption`). The previous handlers are restored
            at finalize. Install at ``initialize()`` (the main thread).
        preempted_exit_code: The exit status ``Preempted`` carries; None (the default): 128 + the
            signal number (143 for SIGTERM).
        autoload: At start, restore the newest complete, valid snapshot; damaged ones
            are skipped with a warning. Needs a string ``filename``.
        saver_rank: The rank that writes in DISTRIBUTED mode (given in DEFAULT mode,
            it selects DISTRIBUTED mode). In SHARDED mode the rank that prunes (default 0).
        snapshot_mode: DEFAULT (one process), DISTRIBUTED (``saver_rank`` writes the
            state every rank holds) or SHARDED (every rank writes its part of one snapshot).
        allow_pickle: Keyword-only, beyond ppe's signature: let snapshots hold
            values only pickle can store, and let autoload unpickle them (which
            runs code from the snapshot: only for snapshots you trust).
        incremental: Keyword-only, beyond ppe's signature: each save writes
            only the blocks (``PPE_SNAPSHOT_BLOCK_KB``, 1 MiB) that changed since
            the previous complete snapshot (the writer's last, or the one autoload
            resumed from) and references the rest of that one's data files. Every
            snapshot still restores on its own inside the output directory;
            retention keeps the data files that kept snapshots reference. Needs a
            ppe_snapshot writer and no ``savefun``.
        local: Keyword-only, beyond ppe's signature: a local tier
            (:class:`ppe_snapshot.LocalTier`, or a dict of its arguments):
            frequent snapshots of each rank's state in node-local memory
            (``/dev/shm``) at the tier's own trigger, which must be more frequent
            than this extension's and divide it, with a copy of each rank's part
            on a partner rank of another node. Autoload restores from the newest
            local step every rank can restore (its own part, or a partner's copy)
            when it is newer than the newest durable snapshot. Whatever fails in
            the tier costs the tier only (a warning). See the README, "The local
            tier".

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
                   allow_pickle=allow_pickle, keep=keep, save_on_signals=save_on_signals,
                   preempted_exit_code=preempted_exit_code, incremental=incremental, local=local)
    if snapshot_mode == SnapshotMode.DEFAULT:
        if saver_rank is None:
            return SnapshotExtension(**options)
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
