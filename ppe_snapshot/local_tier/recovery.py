"""Restoring from the local tier: the newest step every rank can restore, from its own part or a partner's copy.

Every rank says which complete parts and copies it holds (:class:`~.layout.Held`); rank 0 chooses the newest
step newer than the newest durable snapshot for which every rank has its own part or some rank holds a copy of
it (a copy counts only for the world size it was saved with: a resharding restore comes from durable snapshots).
The holders send the missing parts to their ranks, then every rank restores its part, every chunk checked
against its checksum as it is read (and, where no durable snapshot exists to fall back to, the whole part checked
before anything is loaded), and the ranks agree that all of them did; where any did not, every rank falls back to
the durable snapshots together. A copy was checked against the digest of what its sender sent when received.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from ppe_snapshot.engine import exchange
from ppe_snapshot.local_tier import layout, transfer
from ppe_snapshot.local_tier.saves import RESTORE_TAGS, LocalSaves
from ppe_snapshot.run_dir import Unusable
from ppe_snapshot.storage import join

logger = logging.getLogger(__name__)

#: The tier's tags at restore (before any save): the plan, the parts fetched, the outcome.
_PLAN, _FETCH, _OUTCOME = RESTORE_TAGS, RESTORE_TAGS + 1, RESTORE_TAGS + 2


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


def choose(summaries: list[dict[str, Any]], world_size: int, durable: int | None) -> dict[str, Any] | None:
    """The plan every rank follows (``{"step": s, "fetch": {rank: holder}}``), given each rank's
    :meth:`~.layout.Held.summary`, or None where no complete step is newer than iteration ``durable``."""
    own = [set(doc.get("own", ())) for doc in summaries]
    holders: dict[tuple[int, int], int] = {}
    for holder, doc in enumerate(summaries):
        for ward, steps in doc.get("copies", {}).items():
            for step in steps:
                holders.setdefault((int(ward), step), holder)
    for step in sorted(set().union(*own, {s for _, s in holders}), reverse=True):
        if durable is not None and step <= durable:
            break
        fetch: dict[str, int] = {}
        for rank in range(world_size):
            if step not in own[rank]:
                if (rank, step) not in holders:
                    break
                fetch[str(rank)] = holders[rank, step]
        else:
            return {"step": step, "fetch": fetch}
    return None


def recover(saves: LocalSaves, durable: int | None, restore: Callable[[str], None]) -> Recovered | Fallback | None:
    """Restore this rank with ``restore(part_path)`` from the newest usable local step newer than iteration
    ``durable`` (every rank calls it); None where there is none. ``restore`` raises
    :class:`~ppe_snapshot.run_dir.Unusable` when it failed before touching any state."""
    ranks = saves.ranks
    start = time.perf_counter()
    try:
        layout.remove_unfinished(saves.tree, ranks.rank, list(ranks.wards))
        summary = layout.held(saves.tree, ranks.rank, list(ranks.wards)).summary(ranks.world_size)
    except OSError as e:  # this rank holds nothing usable; the others may still fetch from no one else
        logger.warning("the local tier directory %s cannot be read: %s", saves.directory, e)
        summary = layout.Held().summary(ranks.world_size)
    if ranks.group is None:
        plan = choose([summary], 1, durable)
    else:
        plan = exchange(ranks.group, summary, _PLAN, lambda docs: choose(docs, ranks.world_size, durable))
    if plan is None:
        return None
    step, fetch = plan["step"], {int(r): q for r, q in plan["fetch"].items()}
    problem = _fetch(saves, step, fetch)
    if problem is None and durable is None:  # nothing to fall back to: every checksum checked before any load
        problem = transfer.verified(saves.part_path(step))
    touched = False
    if problem is None:
        try:
            restore(saves.part_path(step))
        except Exception as e:  # noqa: BLE001 - every rank falls back together
            problem = f"{type(e).__name__}: {e}"
            touched = not isinstance(e, Unusable)
    mine = None if problem is None else [problem, touched]
    outcome = _outcome([mine]) if ranks.group is None else exchange(ranks.group, mine, _OUTCOME, _outcome)
    if outcome is not None:
        return Fallback(f"local step {step}: {outcome[0]}", outcome[1])
    source = f"a partner copy from rank {fetch[ranks.rank]}" if ranks.rank in fetch else "its own local part"
    return Recovered(step, saves.part_path(step), source, time.perf_counter() - start)


def _outcome(docs: list[Any]) -> list[Any] | None:
    """None when every rank restored, else ``[why, whether any rank's state was touched]``."""
    failed = [(r, doc) for r, doc in enumerate(docs) if doc is not None]
    if not failed:
        return None
    return ["; ".join(f"rank {r}: {doc[0]}" for r, doc in failed), any(doc[1] for _, doc in failed)]


def _fetch(saves: LocalSaves, step: int, fetch: dict[int, int]) -> str | None:
    """The parts of ``step`` the plan fetches, each from its holder to its rank (marked there as the rank's own;
    its checksums are checked as it is restored); what went wrong on this rank, or None."""
    ranks, problem = saves.ranks, None
    for rank, holder in sorted(fetch.items()):
        if ranks.rank == holder:
            transfer.move(ranks.group, _FETCH, (rank, join(saves.directory, layout.copy_of(step, rank))), [])
        elif ranks.rank == rank:
            dest = saves.part_path(step)
            try:
                layout.remove_part(saves.tree, layout.own_part(step, rank))
            except OSError as e:
                problem = f"{type(e).__name__}: {e}"
            problem = transfer.move(ranks.group, _FETCH, None, [transfer.Incoming(holder, dest)])[holder] or problem
            if problem is None:
                try:
                    layout.write_marker(saves.tree, layout.own_part(step, rank),
                                        {"step": step, "world_size": ranks.world_size, "rank": rank})
                except OSError as e:
                    problem = f"{type(e).__name__}: {e}"
    return problem
