"""Restoring from the local tier: the newest step every rank can restore, from its own part or a partner's copy.

Every rank says which complete parts and copies it holds (:class:`~.layout.Held`); rank 0 chooses the newest
step for which every rank has its own part or some rank holds a copy of it (a copy counts only for the world size
it was saved with: a resharding restore comes from durable snapshots), used only if newer than the newest durable
snapshot. Each rank's view of the durable snapshots' names goes with its holdings: where the chosen step is newer
than every name, the durable snapshots need not be listed nor opened (:func:`settled`).
Every rank restores its part: its own, or the copy a partner holds, read over the side group straight into its
tensors while the holder serves it (:mod:`.peer_reads`); every chunk is checked against its checksum as it is read
(and, where no durable snapshot exists to fall back to, the whole part checked before anything is loaded), but for
an own part whose files are those its marker recorded when it completed (``storage.open_unchanged``), and the
ranks agree that all of them did. Where a rank's own part failed and another rank holds a copy of it, that copy is
read and restored in a second round; where a rank still failed, every rank falls back to the durable snapshots
together. A copy was checked against the digest of what its sender sent when it was made.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ppe_snapshot.engine import exchange
from ppe_snapshot.errors import SnapshotAbortedError
from ppe_snapshot.local_tier import layout, transfer
from ppe_snapshot.local_tier.peer_reads import PeerFiles, open_peer_files, serve_copy
from ppe_snapshot.local_tier.saves import RESTORE_TAGS, LocalSaves
from ppe_snapshot.run_dir import Unusable
from ppe_snapshot.storage import Storage, UnchangedFiles, join, open_unchanged

logger = logging.getLogger(__name__)

#: The tier's tags at restore (before any save): the plan, the parts fetched, the outcome; the copies fetched for
#: own parts that failed, and the second outcome.
_PLAN, _FETCH, _OUTCOME, _REFETCH, _REOUTCOME = range(RESTORE_TAGS, RESTORE_TAGS + 5)


@dataclass(frozen=True)
class Recovered:
    """Where this rank's state came from: local ``step``, read from ``path``; ``source`` says whether this rank's
    own part was there or it was fetched from a partner; ``seconds`` from the start of the choice to the end of
    the restore."""
    step: int
    path: str
    source: str
    seconds: float


@dataclass(frozen=True)
class Fallback:
    """The tier was tried and not used: why, and whether this rank's state was partly overwritten."""
    reason: str
    touched: bool


def choose(summaries: list[dict[str, Any]], world_size: int) -> dict[str, Any] | None:
    """The plan every rank follows (``{"step": s, "fetch": {rank: holder}, "spare": {rank: holder}}``: the ranks
    whose part is fetched from a copy, and those restoring their own part of which another rank holds a copy) for
    the newest step every rank can restore, given each rank's :meth:`~.layout.Held.summary`; None where there is
    none. Whether it is newer than the durable snapshots is :func:`usable`'s question."""
    own = [set(doc.get("own", ())) for doc in summaries]
    holders: dict[tuple[int, int], int] = {}
    for holder, doc in enumerate(summaries):
        for ward, steps in doc.get("copies", {}).items():
            for step in steps:
                holders.setdefault((int(ward), step), holder)
    for step in sorted(set().union(*own, {s for _, s in holders}), reverse=True):
        fetch: dict[str, int] = {}
        for rank in range(world_size):
            if step not in own[rank]:
                if (rank, step) not in holders:
                    break
                fetch[str(rank)] = holders[rank, step]
        else:
            spare = {str(rank): holders[rank, step] for rank in range(world_size)
                     if str(rank) not in fetch and holders.get((rank, step), rank) != rank}
            return {"step": step, "fetch": fetch, "spare": spare}
    return None


def usable(plan: dict[str, Any] | None, durable: int | None) -> bool:
    """Whether ``plan`` (of :func:`choose`) restores a step newer than iteration ``durable`` (older steps, which the
    plan passed over, are older still)."""
    return plan is not None and (durable is None or plan["step"] > durable)


def agreed_plan(saves: LocalSaves, names: Callable[[], Any] | None = None) -> tuple[dict[str, Any] | None, Any]:
    """The plan of the newest step every rank can restore from the tier (:func:`choose`; every rank calls it), or
    None; and what the durable snapshots' names tell, agreed (:func:`settled_by_names`): ``names()`` is this rank's
    view of them (JSON, or None where it cannot tell)."""
    ranks = saves.ranks
    try:
        layout.remove_unfinished(saves.tree, ranks.rank, list(ranks.wards))
        summary = layout.held(saves.tree, ranks.rank, list(ranks.wards)).summary(ranks.world_size)
    except OSError as e:  # this rank holds nothing usable; the others may still fetch from no one else
        logger.warning("the local tier directory %s cannot be read: %s", saves.directory, e)
        summary = layout.Held().summary(ranks.world_size)
    summary["named"] = _names(names)
    decide = lambda docs: (choose(docs, ranks.world_size), settled_by_names(docs))  # noqa: E731
    return decide([summary]) if ranks.group is None else tuple(exchange(ranks.group, summary, _PLAN, decide))


def _names(names: Callable[[], Any] | None) -> Any:
    if names is None:
        return None
    try:
        return names()
    except Exception as e:  # noqa: BLE001 - the durable snapshots are then listed in full, and fail there
        logger.debug("the durable snapshots' names could not be read: %s: %s", type(e).__name__, e)
        return None


def settled_by_names(summaries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What every rank's view of the durable snapshots' names (``{"newest": iteration or None, "complete":
    bool}``, None where a rank cannot tell) says of all of them: the newest iteration any name holds and whether
    every rank saw one seemingly complete; None where some rank cannot tell."""
    named = [doc.get("named") for doc in summaries]
    if any(n is None for n in named):
        return None
    newest = [n["newest"] for n in named if n["newest"] is not None]
    return {"newest": max(newest, default=None), "complete": all(n["complete"] for n in named)}


class Planning:
    """The choice of the step to resume from, as :func:`agreed_plan` makes it (every rank at once), with the time it
    began; ``names`` as there. Made on the caller's thread: autoload lists the durable snapshots only after it, and
    only where the names leave the choice open (a thread of its own cost the 4-rank restart a wake-up of 3-6 ms on
    this project's VM)."""

    def __init__(self, saves: LocalSaves, names: Callable[[], Any] | None = None) -> None:
        self.started = time.perf_counter()
        self.plan, self.named = agreed_plan(saves, names)

    def durable_by_names(self) -> Settled | None:
        """:func:`settled` by the plan and the names (every rank's)."""
        return settled(self.plan, self.named)


@dataclass(frozen=True)
class Settled:
    """The newest durable snapshot's iteration as the names tell it: a bound on the newest complete one, or None
    where no name seems complete (none to fall back to: a local part is then checked whole before it is loaded)."""
    newest: int | None


def settled(plan: dict[str, Any] | None, named: dict[str, Any] | None) -> Settled | None:
    """Where the ``plan``'s step is newer than every durable snapshot's name (``named``, of
    :func:`settled_by_names`), what stands for the newest complete durable snapshot; else None: the durable
    snapshots must be listed and checked to know."""
    if plan is None or named is None or (named["newest"] is not None and plan["step"] <= named["newest"]):
        return None
    return Settled(named["newest"] if named["complete"] else None)


def recover(saves: LocalSaves, durable: int | None, restore: Callable[[str | Storage], None],
            planned: Planning | None = None) -> Recovered | Fallback | None:
    """Restore this rank with ``restore(part)`` (the part's path, or a storage reading a partner's copy) from the
    newest usable local step newer than iteration ``durable`` (every rank calls it); None where there is none.
    ``planned``: the plan, made already (else it is made here). ``restore`` raises
    :class:`~ppe_snapshot.run_dir.Unusable` when it failed before touching any state."""
    ranks = saves.ranks
    planned = Planning(saves) if planned is None else planned
    start, chosen = planned.started, planned.plan
    if not usable(chosen, durable):
        return None
    step, fetch, spare = chosen["step"], _by_rank(chosen["fetch"]), _by_rank(chosen["spare"])
    mine, where = _restore_and_serve(saves, step, fetch, _FETCH, durable, restore)
    failed = _failures(ranks.group, mine, _OUTCOME)
    touched = any(t for _, t in failed.values())
    retry = {rank: spare[rank] for rank in failed if rank in spare}
    if failed and len(retry) == len(failed):  # every rank that failed has a copy elsewhere: a second round
        if ranks.rank in retry:
            logger.warning("local step %d: this rank's own part failed (%s); restoring the copy rank %d holds",
                           step, failed[ranks.rank][0], retry[ranks.rank])
        mine, again = _restore_and_serve(saves, step, retry, _REFETCH, durable,
                                         restore if ranks.rank in retry else None)
        where = again if ranks.rank in retry else where
        failed = _failures(ranks.group, mine, _REOUTCOME)
        touched |= any(t for _, t in failed.values())
        fetch = {**fetch, **retry}
    if failed:
        why = "; ".join(f"rank {rank}: {reason}" for rank, (reason, _) in sorted(failed.items()))
        return Fallback(f"local step {step}: {why}", touched)
    source = f"a partner copy from rank {fetch[ranks.rank]}" if ranks.rank in fetch else "its own local part"
    return Recovered(step, where, source, time.perf_counter() - start)


def _by_rank(holders: dict[str, int]) -> dict[int, int]:
    return {int(rank): holder for rank, holder in holders.items()}


def _restore_and_serve(saves: LocalSaves, step: int, fetch: dict[int, int], tag: int, durable: int | None,
                       restore: Callable[[str | Storage], None] | None) -> tuple[list[Any] | None, str]:
    """Restore this rank's part of ``step`` with ``restore`` (None: this rank only serves copies), read from the
    partner's copy that ``fetch`` names for it, else from its own part, while serving the copies this rank holds of
    the others ``fetch`` names. Returns None when this rank did its share, else ``[why, whether its state was
    touched]``; and where its part was read."""
    ranks = saves.ranks
    serving = [_Serving(ranks.group, rank, tag, join(saves.directory, layout.copy_of(step, rank)))
               for rank, holder in sorted(fetch.items()) if holder == ranks.rank]
    try:
        if restore is None:
            return None, saves.part_path(step)
        return _restore_part(saves, step, fetch.get(ranks.rank), tag, durable, restore)
    finally:
        for work in serving:
            work.join()


def _restore_part(saves: LocalSaves, step: int, holder: int | None, tag: int, durable: int | None,
                  restore: Callable[[str | Storage], None]) -> tuple[list[Any] | None, str]:
    """Restore this rank's part of ``step``: its own, or (``holder``) the copy that rank holds, read over the side
    group (:mod:`.peer_reads`). Returns None or ``[why, whether the state was touched]``, and where the part
    was."""
    if holder is None:
        source: str | Storage = _own_part(saves, step)
    else:
        try:
            layout.remove_part(saves.tree, layout.own_part(step, saves.ranks.rank))  # a part that failed
        except OSError as e:
            logger.warning("local step %d: %s: %s", step, type(e).__name__, e)
        try:
            peer = open_peer_files(saves.ranks.group, holder, tag)
        except SnapshotAbortedError as e:
            return [str(e), False], saves.part_path(step)
        if peer is None:
            return [f"rank {holder} had no copy of this rank's part to send", False], saves.part_path(step)
        source = peer
    try:
        if durable is None and not isinstance(source, UnchangedFiles):  # nothing to fall back to:
            problem = transfer.verified(source)  # every checksum checked before any load
            if problem is not None:
                return [problem, False], _where(source)
        restore(source)
    except Exception as e:  # noqa: BLE001 - every rank falls back together
        return [f"{type(e).__name__}: {e}", not isinstance(e, Unusable)], _where(source)
    finally:
        if isinstance(source, PeerFiles):
            source.end()
    return None, _where(source)


def _own_part(saves: LocalSaves, step: int) -> str | Storage:
    """This rank's own part of ``step``: its path; or, where its files are unchanged since it was completed (and
    the tier does not recheck such parts), a storage reading its data without hashing it
    (``storage.open_unchanged``)."""
    path = saves.part_path(step)
    if saves.recheck:
        return path
    recorded = (layout.read_marker(saves.tree, layout.own_part(step, saves.ranks.rank)) or {}).get("files")
    unchanged = open_unchanged(path, recorded)
    if unchanged is None and recorded is not None:
        logger.info("local step %d: this rank's part changed since it completed; every chunk is checked", step)
    return unchanged or path


def _where(source: str | Storage) -> str:
    return source if isinstance(source, str) else source.url


class _Serving:
    """This rank serving its copy of rank ``peer``'s part (at ``path``) to it, in a thread of its own."""

    def __init__(self, group: Any, peer: int, tag: int, path: str) -> None:
        self.peer, self.path = peer, path
        self._thread = threading.Thread(target=self._run, args=(group, tag), name="ppe-snapshot-local-tier-serve",
                                         daemon=True)
        self._thread.start()

    def _run(self, group: Any, tag: int) -> None:
        try:
            serve_copy(group, self.peer, tag, self.path)
        except Exception as e:  # noqa: BLE001 - the peer's own restore fails and says so
            logger.warning("serving %s to rank %d failed: %s: %s", self.path, self.peer, type(e).__name__, e)

    def join(self) -> None:
        self._thread.join()


def _failures(group: Any, mine: list[Any] | None, tag: int) -> dict[int, tuple[str, bool]]:
    """Every rank's failure (``rank -> (why, touched)``), the same on every rank."""
    docs = [mine] if group is None else exchange(group, mine, tag, lambda docs: docs)
    return {rank: (doc[0], bool(doc[1])) for rank, doc in enumerate(docs) if doc is not None}
