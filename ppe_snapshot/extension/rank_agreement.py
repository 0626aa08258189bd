"""The snapshot extension across ranks: how the ranks agree in SnapshotMode.DISTRIBUTED and SHARDED.

DISTRIBUTED: every rank gives its state, ``saver_rank`` writes it (and
every rank's RNG state) and tells the others whether it saved: at the
meeting of each save what failed so far, then how the save ended
(:mod:`.save_outcomes`). SHARDED:
every rank writes its part of one snapshot. At autoload every rank restores
the same snapshot at the same time and falls back together; the ranks
agree on the candidates before trying any.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch.distributed as dist
from pytorch_pfn_extras.training import ExtensionsManagerProtocol

from ppe_snapshot.engine import LOCAL, RNGState, exchange, side_group
from ppe_snapshot.errors import SnapshotAbortedError, SnapshotError
from ppe_snapshot.extension.ppe_extension import SnapshotExtension
from ppe_snapshot.extension.preemption import Preemption
from ppe_snapshot.extension.resuming import DurableListing
from ppe_snapshot.extension.save_outcomes import SaveOutcomes, summary
from ppe_snapshot.extension.saved_state import restore_rank_file, state_to_save
from ppe_snapshot.extension.staging_ahead import local_tensors
from ppe_snapshot.run_dir import Candidate, CandidateKind, attempt, cannot_start_fresh, target_changed
from ppe_snapshot.storage import join
from ppe_snapshot.stored_snapshot import RANK_FILES_MARK, rank_file, unmark_rank_files
from ppe_snapshot.writing import BackgroundAbortError, BackgroundSaveError

logger = logging.getLogger(__name__)


class _DistributedExtension:
    """What DISTRIBUTED and SHARDED share: a process group, a designated rank, restoring together. Placed before
    :class:`SnapshotExtension` among an extension's bases (its methods override and extend that class's)."""

    _mode = "DISTRIBUTED"
    #: The engine process group of a restore: each rank reads alone (LOCAL) or its own part (None).
    _restore_pg: Any = LOCAL

    def __init__(self, *, saver_rank: int, **options: Any) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"snapshot_mode={self._mode} requires torch.distributed to be initialized "
                               "(call torch.distributed.init_process_group first)")
        super().__init__(**options)
        self._rank = dist.get_rank()
        self._size = dist.get_world_size()
        if not 0 <= saver_rank < self._size:
            raise ValueError(f"Distributed snapshot requires a saver rank in the range [0-{self._size}); "
                             f"got saver_rank={saver_rank}")
        self._saver_rank = saver_rank
        self._rng_rank = self._rank

    def initialize(self, manager: ExtensionsManagerProtocol) -> str | None:  # type: ignore[override]
        if self._size > 1:  # the ranks' side group, made with every rank at the start rather than at a save
            side_group(None)
        return super().initialize(manager)

    def _watch(self, signals: Any, exit_code: int | None) -> Preemption:
        return Preemption.for_ranks(signals, exit_code)  # collective: every rank constructs the extension

    @property
    def _tier_ranks(self) -> tuple[int, int]:  # type: ignore[override]
        return self._rank, self._size

    @property
    def _is_saver(self) -> bool:
        return self._rank == self._saver_rank

    @property
    def _owns_out_dir(self) -> bool:
        return self._is_saver

    def _agree(self) -> tuple[list[Candidate], list[Candidate]]:
        """(what this rank listed, the complete snapshots every rank will try, oldest first)."""
        raise NotImplementedError

    def _autoload(self, manager: ExtensionsManagerProtocol) -> list[Candidate] | None:
        # Every rank restores the same snapshot at the same time, so a state_dict() or
        # load_state_dict() that is collective works; when any rank fails, all fall back together.
        target = self._resolve_target(manager)
        listing = DurableListing(self._agree)
        touched: list[str] = []
        local = self._resume_locally(manager, listing, target)
        if local is True:
            return listing.listed
        if local is not None:
            touched.append(f"{local[0]} ({local[1]})")
        listed, agreed = listing()
        found = None
        for candidate in reversed(agreed):
            failure = attempt(lambda: self._restore_at_position(candidate, target, self._restore_pg))
            # (why, whether state was touched, whether the target did not fit): exceptions may not pickle; every
            # rank then falls back (or raises) together
            outcome = None if failure is None else (f"rank {self._rank}: {failure.reason}", failure.error is not None,
                                                    failure.mismatch)
            problems = [tuple(o) for o in self._everyone(outcome, lambda docs: [o for o in docs if o is not None])]
            if not problems:
                found = candidate
                break
            if any(mismatch for _, _, mismatch in problems):
                raise target_changed(candidate.url, "; ".join(reason for reason, _, mismatch in problems if mismatch))
            self._skip(candidate, "; ".join(reason for reason, _, _ in problems))
            if any(partly for _, partly, _ in problems):
                touched.append(candidate.url)
        if found is None and touched:
            raise cannot_start_fresh(", ".join(touched))
        self._resumed(manager, found, listed)
        return listed

    def _staged_state(self, manager: ExtensionsManagerProtocol) -> Callable[[], Any] | None:
        """The tensors this rank holds, where the target is the manager: ``state_dict()`` may be a collective, which
        must not run outside a save (:func:`.staging_ahead.local_tensors`)."""
        return None if self._target is not None else lambda: local_tensors(manager)

    @property
    def _writes(self) -> bool:  # the saver rank's
        return self._is_saver

    def _everyone(self, doc: Any, decide: Any) -> Any:
        """``decide`` of every rank's ``doc`` (JSON values), on every rank; a rank that died is named
        (:class:`~ppe_snapshot.errors.SnapshotAbortedError`) rather than waited for."""
        if self._size == 1:
            return decide([doc])
        side = side_group(None)
        return exchange(side.group, doc, side.next_tag(), decide)


class DistributedSnapshot(_DistributedExtension, SnapshotExtension):
    """Every rank gives its state; ``saver_rank`` writes it; every rank can restore it."""

    _ppe_name = "_DistributedSnapshot"

    def __init__(self, *, saver_rank: int, **options: Any) -> None:
        super().__init__(saver_rank=saver_rank, **options)
        self._outcomes = SaveOutcomes(self._rank, self._saver_rank, self._size)

    def _make_snapshot(self, manager: ExtensionsManagerProtocol) -> None:
        # The ranks meet through the saver, point to point on the side gloo group of the engine's takes: a rank
        # that dies meanwhile is named on every other rank (a collective could leave some waiting for it). How a
        # save handed to a background writer ends, the saver tells the others later (save_outcomes).
        name = self._format_name(manager)
        state = state_to_save(self._resolve_target(manager))  # on every rank: state_dict() may be collective
        rng = self._gather_rng_states() if self._engine_writer is not None else None
        failure, ended = None, None
        if self._is_saver:
            try:
                self._save(manager, name, state, LOCAL, rng)
            except Exception as e:
                self._meet({"reason": summary(e), "background": isinstance(e, BackgroundSaveError)})
                raise
            writer = self._engine_writer
            ended = writer.last_save if writer is not None else None
        failure = self._meet(failure)  # also the barrier: every rank returns once the save is handed off
        if failure is not None:
            kind = BackgroundAbortError if failure["background"] else SnapshotAbortedError
            raise kind(f"snapshot {name}: saver rank {self._saver_rank} failed: {failure['reason']}")
        self._outcomes.met(name, ended)

    def finalize(self, manager: ExtensionsManagerProtocol) -> None:
        """Also every rank learns how the saver's last saves ended (:meth:`SaveOutcomes.finish`)."""
        try:
            super().finalize(manager)
        finally:
            self._outcomes.finish()

    def _meet(self, doc: Any, decide: Any = None) -> Any:
        """What the saver rank decides from every rank's ``doc`` (by default: its own), naming a rank that died."""
        if self._size == 1:
            return doc
        side = side_group(None)
        saver = self._saver_rank
        return exchange(side.group, doc, side.next_tag(), decide or (lambda docs: docs[saver]), root=saver)

    def _gather_rng_states(self) -> dict[int, Any] | None:
        """Every rank's RNG state, on the saver rank (it writes them all; each rank restores its own)."""
        if self._size == 1:
            return self._rng_states()
        states: dict[int, Any] = {}
        self._meet(RNGState.to_json(RNGState().state_dict()),
                   lambda docs: states.update((r, RNGState.from_json(doc)) for r, doc in enumerate(docs)))
        return states if self._is_saver else None

    def _broadcast(self, objects: list[Any]) -> None:
        if self._size > 1:
            dist.broadcast_object_list(objects, src=self._saver_rank)

    def _error_snapshot(self, manager: ExtensionsManagerProtocol) -> None:
        # No collective here: the other ranks have not failed and are not listening.
        if self._is_saver:
            self._save_on_error(manager, self._format_name(manager), LOCAL)
        else:
            logger.warning("training failed on rank %d; only saver rank %d writes snapshots, so "
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
                    self._skip(c, c.problem or f"it is {c.kind}")
            agreed[0] = [c for c in listed if c.complete]
        self._broadcast(agreed)
        if agreed[1] is not None:
            raise SnapshotError(f"autoload: saver rank {self._saver_rank} could not list {self._out_dir}: {agreed[1]}")
        return listed, agreed[0]


def _failures(docs: list[Any]) -> list[str]:
    """The failures the ranks told of (each rank's doc: None, or what failed there)."""
    return [doc for doc in docs if doc is not None]


#: What SHARDED mode restores: engine snapshots, and ppe's per-rank files (of as many ranks).
_RESTORABLE = (CandidateKind.SNAPSHOT, CandidateKind.RANK_FILES)


class ShardedSnapshot(_DistributedExtension, SnapshotExtension):
    """Every rank writes its own state into one snapshot with one manifest."""

    _ppe_name = "_ShardedSnapshot"

    _mode = "SHARDED"
    _restore_pg = None

    @property
    def _writes(self) -> bool:  # every rank writes its part
        return True

    def _make_snapshot(self, manager: ExtensionsManagerProtocol) -> None:
        name, state = self._format_name(manager), state_to_save(self._resolve_target(manager))
        if self._file_savefun is None:
            self._save(manager, name, state, None)
        else:
            self._save_rank_files(manager, name, state)

    def _save_rank_files(self, manager: ExtensionsManagerProtocol, name: str, state: Any) -> None:
        """ppe's layout for a ``savefun``: every rank saves its state as file ``<name>/<rank>``, and the saver rank
        marks the directory whole (:data:`~ppe_snapshot.stored_snapshot.RANK_FILES_MARK`) once every rank's file is
        written. The mark comes off first, before any rank writes. A ppe_snapshot writer is waited for at each step
        (ppe's own writers cannot be, as in ppe), so no save of the mark is in flight when the next save begins."""
        location = join(self._out_dir, name)
        self._together(name, lambda: self._unmark(location) if self._is_saver else None)
        self._together(name, lambda: self._save_rank_file(manager, name, state))
        if self._is_saver:
            self.writer(f"{name}/{RANK_FILES_MARK}", manager.out, {}, savefun=self._file_savefun)
            self._wait_for_writer()

    def _unmark(self, location: str) -> None:
        self._wait_for_writer()  # the previous save's mark, where the name is saved again
        unmark_rank_files(location, self._storage_options)

    def _save_rank_file(self, manager: ExtensionsManagerProtocol, name: str, state: Any) -> None:
        self._save(manager, rank_file(name, self._rank), state, LOCAL)
        self._wait_for_writer()

    def _wait_for_writer(self) -> None:
        if self._engine_writer is not None:
            self._engine_writer.wait()

    def _together(self, name: str, action: Callable[[], None]) -> None:
        """Run ``action`` on every rank, then meet: when it failed on any rank, every rank raises (that rank its
        own error, the others a ``SnapshotAbortedError`` naming it); a rank that died is named, not waited for."""
        try:
            action()
        except Exception as e:
            self._everyone(f"rank {self._rank}: {summary(e)}", _failures)
            raise
        problems = self._everyone(None, _failures)
        if problems:
            raise SnapshotAbortedError(f"snapshot {name}: {'; '.join(problems)}")

    def _restore(self, candidate: Candidate, target: Any, pg: Any) -> None:
        if candidate.kind == CandidateKind.RANK_FILES:
            restore_rank_file(candidate, target, self._rank, self._size, self._storage_options)
        else:
            super()._restore(candidate, target, pg)

    def _error_snapshot(self, manager: ExtensionsManagerProtocol) -> None:
        # The other ranks are not taking part, so a snapshot of the whole group cannot commit:
        # this rank saves its own state alone, under a name autoload does not pick up.
        name = f"{self._format_name(manager)}.error-rank{self._rank}"
        logger.warning("training failed on rank %d; saving this rank's state alone to %s "
                       "(a rank-local snapshot, not used by autoload)", self._rank, name)
        self._save_on_error(manager, name, LOCAL, self_contained=True)  # retention does not list it

    def _agree(self) -> tuple[list[Candidate], list[Candidate]]:
        listed: list[Candidate] = []
        problem = None
        try:
            listed = self._candidates()
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            problem = f"rank {self._rank}: {type(e).__name__}: {e}"
        for c in listed:
            if c.kind not in _RESTORABLE:
                self._skip(c, c.problem or "a single-file snapshot cannot hold the state of every rank")
        mine = [c for c in listed if c.kind in _RESTORABLE]
        problems, names = self._everyone(problem or [c.name for c in mine], _listed_everywhere)
        if problems:
            raise SnapshotError(f"autoload: could not list {self._out_dir}: {'; '.join(problems)}")
        everywhere = set(names)
        for c in mine:
            if c.name not in everywhere:
                self._skip(c, "it is not complete as seen from every rank")
        return listed, [c for c in mine if c.name in everywhere]


def _listed_everywhere(docs: list[Any]) -> tuple[list[str], list[str]]:
    """(why ranks could not list, the names every rank listed) from each rank's problem or names."""
    problems = [doc for doc in docs if isinstance(doc, str)]
    names = set.intersection(*(set(doc) for doc in docs)) if not problems else set()
    return problems, sorted(names)
