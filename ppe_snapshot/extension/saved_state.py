"""What the extension's engine snapshots hold, and putting it back.

An engine snapshot taken by the extension holds the target's state as the
app-state entry ``"state"`` and every rank's global RNG state under
:data:`RNG_KEY` (``"rng/<rank>"``); its manifest metadata records the
training position and the kind of target (:func:`metadata`). A single-file
snapshot (``savefun=torch.save``) holds the target's state alone.
"""
from __future__ import annotations

import logging
import math
from typing import Any

from ppe_snapshot import ppe_private
from ppe_snapshot.engine import LOCAL, RNGState, Snapshot
from ppe_snapshot.run_dir import Candidate, CandidateKind, Unusable, load_file
from ppe_snapshot.storage import Storage
from ppe_snapshot.stored_snapshot import rank_file, recorded

logger = logging.getLogger(__name__)

#: The app-state key of the target's state in engine snapshots written by the extension.
STATE_KEY = "state"
#: The app-state key of the RNG states in engine snapshots written by the extension.
RNG_KEY = "rng"


def state_to_save(target: Any) -> Any:
    """The state to save of a target: an object with ``state_dict()``, or a dict of them."""
    if type(target) is dict:
        return {k: v.state_dict() for k, v in target.items()}
    return target.state_dict()


#: The names earlier releases gave the DISTRIBUTED and SHARDED extensions in a manager's state, by the names of
#: ppe's classes they use now (``SnapshotExtension.default_name``).
_EARLIER_NAMES = {"_DistributedSnapshot": "DistributedSnapshot", "_ShardedSnapshot": "ShardedSnapshot"}


def load_into(target: Any, state: Any) -> None:
    """Load ``state`` (as :func:`state_to_save` gave it) into ``target``."""
    if type(target) is dict:
        for k in target:
            target[k].load_state_dict(state[k])
    else:
        target.load_state_dict(_with_ppe_names(state))


def _with_ppe_names(state: Any) -> Any:
    """A manager's state whose extensions' states an earlier release keyed by its own names, keyed by ppe's too."""
    extensions = ppe_private.extension_states(state)
    if extensions is not None:
        for name, earlier in _EARLIER_NAMES.items():
            if name not in extensions and earlier in extensions:
                extensions[name] = extensions[earlier]
    return state


class TargetState:
    """The extension's target as one app-state value, so the engine restores it in place."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def state_dict(self) -> Any:
        return state_to_save(self._target)

    def load_state_dict(self, state: Any) -> None:
        load_into(self._target, state)


def target_kind(target: Any) -> str:
    """What the extension saves: ``"manager"`` (target None), ``"dict"`` of objects, or one ``"object"``."""
    if target is None:
        return "manager"
    return "dict" if type(target) is dict else "object"


def metadata(manager: Any, kind: str, metrics: dict[str, float] | None = None) -> dict[str, Any]:
    """The manifest metadata of a snapshot of a target of ``kind`` taken at the manager's training position,
    with the observed values retention reads back (``KeepBest``) when there are any."""
    return recorded(manager.iteration, manager.epoch, manager.epoch_detail, metrics, ppe_snapshot_target=kind)


def observed(manager: Any, keys: tuple[str, ...]) -> tuple[dict[str, float], list[str]]:
    """(the values of ``keys`` in the manager's observation of this iteration as finite floats, the keys
    missing or not a finite number)."""
    observation = getattr(manager, "observation", None) or {}
    found: dict[str, float] = {}
    for key in keys:
        try:
            value = float(observation[key])
        except (KeyError, TypeError, ValueError, RuntimeError):
            continue
        if math.isfinite(value):
            found[key] = value
    return found, [k for k in keys if k not in found]


def restore(candidate: Candidate, target: Any, kind: str, pg: Any, rng_rank: int,
            storage_options: dict[str, Any] | None, allow_pickle: bool) -> None:
    """Restore ``candidate`` into ``target`` (of ``kind``), and this rank's RNG state when the snapshot has it.

    Raises :class:`~ppe_snapshot.run_dir.Unusable` when the candidate cannot be
    used and nothing was touched yet.
    """
    if not candidate.complete:
        raise Unusable(candidate.problem or f"it is {candidate.kind}")
    if candidate.kind == CandidateKind.RANK_FILES:
        raise Unusable(f"it holds ppe's per-rank files of a SHARDED run ({candidate.ranks} ranks); resume it with "
                       "snapshot_mode=SnapshotMode.SHARDED and as many ranks")
    if candidate.kind == CandidateKind.FILE:
        load_into(target, _loaded(candidate.url, storage_options))
        return
    snap = _opened(candidate, pg, storage_options, allow_pickle)
    if candidate.snapshot is None:
        _check_readable(snap)
    _restore_opened(snap, candidate.metadata, target, kind, pg, rng_rank)


def restore_rank_file(candidate: Candidate, target: Any, rank: int, size: int,
                      storage_options: dict[str, Any] | None) -> None:
    """Restore rank ``rank``'s file of ``candidate`` (ppe's per-rank files of a SHARDED run, written by ``size``
    ranks as this run has) into ``target``, as ppe does; :class:`~ppe_snapshot.run_dir.Unusable` when it cannot be
    used and nothing was touched yet."""
    if candidate.ranks != size:
        raise Unusable(f"it holds ppe's per-rank files of {candidate.ranks} ranks and this run has {size}; each "
                       "rank's file restores only into the same rank (engine snapshots, savefun=None, reshard)")
    load_into(target, _loaded(rank_file(candidate.url, rank), storage_options))


def _loaded(url: str, storage_options: dict[str, Any] | None) -> Any:
    try:
        return load_file(url, storage_options)
    except Exception as e:  # noqa: BLE001 - nothing was loaded yet
        raise Unusable(f"{url} cannot be read by torch.load: {type(e).__name__}: {e}") from e


def restore_part(path: str | Storage, target: Any, kind: str, rng_rank: int, allow_pickle: bool) -> None:
    """Restore the one-rank snapshot at local ``path`` (a local tier's part; or a storage reading one: a partner's
    copy) into ``target`` as :func:`restore` does, raising :class:`~ppe_snapshot.run_dir.Unusable` when it cannot
    be used and nothing was touched yet."""
    snap = Snapshot(path, pg=LOCAL, allow_pickle=allow_pickle)
    _check_readable(snap)
    _restore_opened(snap, snap.metadata, target, kind, LOCAL, rng_rank)


def _restore_opened(snap: Snapshot, metadata: Any, target: Any, kind: str, pg: Any, rng_rank: int) -> None:
    saved_kind = metadata.get("ppe_snapshot_target", kind)
    if saved_kind != kind:
        raise Unusable(f"it holds a {saved_kind} target and this extension's target is a {kind}")
    snap.restore({STATE_KEY: TargetState(target)})
    restore_rng(snap, pg, rng_rank)


def _opened(candidate: Candidate, pg: Any, storage_options: dict[str, Any] | None, allow_pickle: bool) -> Snapshot:
    """The engine snapshot of ``candidate`` for the ranks of ``pg``: the one its listing kept open (its manifest
    read once), else opened here (an older candidate, or one another rank listed)."""
    if candidate.snapshot is not None:
        return candidate.snapshot.with_group(pg, allow_pickle=allow_pickle)
    return Snapshot(candidate.url, pg=pg, storage_options=storage_options, allow_pickle=allow_pickle)


def _check_readable(snap: Snapshot) -> None:
    """:class:`Unusable` unless this process reads ``snap``'s manifest (opened here, not by the listing), so that
    a failure here counts as nothing touched."""
    try:
        snap.metadata  # noqa: B018 - reads the manifest
    except Exception as e:  # noqa: BLE001 - CorruptSnapshotError, UnsupportedFormatError, I/O: nothing touched yet
        raise Unusable(f"{type(e).__name__}: {e}") from e


def restore_rng(snap: Snapshot, pg: Any, rng_rank: int) -> None:
    """Set the global random number generators to rank ``rng_rank``'s state in ``snap`` (or the one saved)."""
    section = 0 if pg is LOCAL else rng_rank  # a LOCAL snapshot's entries are all rank 0's
    prefix = f"{section}/{RNG_KEY}"
    try:
        state = snap.read_object(f"{prefix}/{rng_rank}")
    except KeyError:  # not this rank's: read what there is (an entry per rank saved, small)
        try:
            saved = snap.read_object(prefix)
        except KeyError:
            saved = {}
        if not saved:
            logger.info("%s holds no RNG state for rank %d; the random number generators "
                        "continue from their current state", snap.path, rng_rank)
            return
        # A DISTRIBUTED snapshot on error holds the saver's state only (no collective there); ranks
        # seeded alike, as data-parallel ranks usually are, continue exactly from it.
        source = min(saved, key=int)
        logger.info("%s holds no RNG state for rank %d; restoring rank %s's", snap.path, rng_rank, source)
        state = saved[source]
    RNGState().load_state_dict(state)
