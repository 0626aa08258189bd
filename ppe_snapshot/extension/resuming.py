"""Autoload of the snapshot extension: the newest snapshot that restores, from the local tier or the output
directory, and what the run keeps of it (``resumed_from``, the names it saves again); without autoload, the
warning of a run that an earlier one in its output directory outranks.

:class:`Resuming` is a base of :class:`~.ppe_extension.SnapshotExtension` holding these steps; the ranks of
DISTRIBUTED / SHARDED modes extend them in :mod:`.rank_agreement`.
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any, Callable

from pytorch_pfn_extras.training import ExtensionsManagerProtocol

from ppe_snapshot import run_dir
from ppe_snapshot.engine import LOCAL
from ppe_snapshot.errors import CorruptSnapshotError
from ppe_snapshot.extension import saved_state
from ppe_snapshot.local_tier import Fallback
from ppe_snapshot.run_dir import Candidate, attempt, cannot_start_fresh, skip, target_changed

logger = logging.getLogger(__name__)


class DurableListing:
    """The durable snapshots as ``agree()`` lists them ((what this rank listed, those every rank will try)), listed
    once, when first asked: a restart from the local tier whose step is newer than every durable name needs none."""

    def __init__(self, agree: Callable[[], tuple[list[Candidate], list[Candidate]]]) -> None:
        self._agree = agree
        self._result: tuple[list[Candidate], list[Candidate]] | None = None

    def __call__(self) -> tuple[list[Candidate], list[Candidate]]:
        if self._result is None:
            self._result = self._agree()
        return self._result

    @property
    def listed(self) -> list[Candidate] | None:
        """What this rank listed; None where nothing was."""
        return None if self._result is None else self._result[0]

    @property
    def agreed(self) -> list[Candidate]:
        return [] if self._result is None else self._result[1]

    def newest_complete(self) -> int | None:
        """The iteration of the newest complete snapshot every rank will try (listing them now if not yet)."""
        return max((c.iteration for c in self()[1] if c.complete and c.iteration is not None), default=None)


class Resuming:
    """Autoload's steps; the attributes they use are the extension's (``_format``, ``_out_dir``, ``_local``...)."""

    # -- autoload ----------------------------------------------------------------
    def _candidates(self) -> list[Candidate]:
        assert self._format is not None
        return run_dir.list_snapshots(self._out_dir, self._format, self._storage_options, keep_newest_open=True)

    def _autoload(self, manager: ExtensionsManagerProtocol) -> list[Candidate] | None:
        """Restore the newest candidate that restores, skipping (with a warning) those that fail; returns what
        was listed (the start-up pruning needs no second listing), None where nothing was."""
        listing = DurableListing(lambda: (self._candidates(),) * 2)
        target = self._resolve_target(manager)
        touched: tuple[str, Exception | str] | None = None
        local = self._resume_locally(manager, listing, target)
        if local is True:
            return listing.listed
        if local is not None:
            touched = local
        candidates, _ = listing()
        found = None
        for candidate in reversed(candidates):
            failure = attempt(lambda: self._restore_at_position(candidate, target, LOCAL))
            if failure is None:
                found = candidate
                break
            if failure.mismatch:
                raise target_changed(candidate.url, failure.reason) from failure.error
            self._skip(candidate, failure.reason)
            if failure.error is not None:
                touched = (candidate.url, failure.error)
        if found is None and touched is not None:
            error = touched[1]
            raise cannot_start_fresh(f"{touched[0]} ({error})") from (error if isinstance(error, Exception) else None)
        self._resumed(manager, found, candidates)
        return candidates

    def _warn_of_later_runs(self, manager: ExtensionsManagerProtocol) -> None:
        """At the first save of a run without autoload: warn where the output directory's names hold a later
        position (an earlier run's snapshots, which outrank this run's: every snapshot is ordered by the training
        position it records). Not at ``initialize``: another extension may autoload the manager after it."""
        if self._format is None or not self._owns_out_dir:
            return
        try:
            named = run_dir.named_positions(self._out_dir, self._format, self._storage_options)
        except Exception as e:  # noqa: BLE001 - only a warning: the saves will say what is wrong with the directory
            logger.debug("listing %s at the first save failed: %s: %s", self._out_dir, type(e).__name__, e)
            return
        if named is None or not named.complete or named.newest is None or named.newest <= manager.iteration:
            return
        warnings.warn(
            f"ppe_snapshot: {self._out_dir} holds snapshots named up to iteration {named.newest}, past this run's "
            f"first save at iteration {manager.iteration}, and autoload=False resumed none of them. Snapshots are "
            "ordered by training position, so theirs outrank this run's: n_retains keeps them first (and of this "
            "run's only the newest), and autoload=True would resume from them rather than from this run. To "
            "continue that run, pass autoload=True; to start over, save to another out_dir or remove them.",
            stacklevel=3)

    def _durable_names(self) -> dict[str, Any] | None:
        """What the names under the output directory tell of the durable snapshots (JSON), opening none."""
        assert self._format is not None
        named = run_dir.named_positions(self._out_dir, self._format, self._storage_options)
        return None if named is None else dataclasses.asdict(named)

    def _resume_locally(self, manager: ExtensionsManagerProtocol, listing: DurableListing,
                        target: Any) -> bool | tuple[str, str] | None:
        """Restore from the local tier where it holds a step newer than the newest complete durable snapshot
        (every rank calls it; ``listing`` lists those only where their names leave it open): True when it did;
        ``(where, why)`` when it failed after touching the state; None otherwise (durable snapshots are tried as
        without a tier)."""
        if self._local is None:
            return None
        result = self._local.resume(self._durable_names, listing.newest_complete, lambda part: (
            saved_state.restore_part(part, target, self._target_kind, self._rng_rank, self._reads_pickle)))
        if result is None:
            return None
        if isinstance(result, Fallback):
            logger.warning("the local tier was not used: %s; resuming from durable snapshots", result.reason)
            return (self._local.saves.directory, result.reason) if result.touched else None
        self.resumed_from, self.resumed_name = result.path, None
        if self._owns_out_dir:  # durable names at or after the resumed step are saved again
            self._superseded = {c.name: dataclasses.replace(c, snapshot=None) for c in listing.agreed
                                if c.iteration is not None and c.iteration >= result.step}
        logger.info("resumed from local step %d (%s, %s) at iteration %s in %.3f s", result.step, result.source,
                    result.path, manager.iteration, result.seconds)
        if self._stats_reporter is not None:
            self._stats_reporter.add_once({"snapshot/restore_s": result.seconds})
        return True

    def _skip(self, candidate: Candidate, reason: str) -> None:
        skip(candidate, reason)
        self._rejected.add(candidate.name)

    def _restore(self, candidate: Candidate, target: Any, pg: Any) -> None:
        saved_state.restore(candidate, target, self._target_kind, pg, self._rng_rank, self._storage_options,
                            self._reads_pickle)

    def _restore_at_position(self, candidate: Candidate, target: Any, pg: Any) -> None:
        """:meth:`_restore`, then raise unless a manager resumed at the iteration the candidate is listed at (what
        it records, or its name): a damaged record of iteration 10^6 would outrank every snapshot saved after it,
        and retention would remove each of them."""
        self._restore(candidate, target, pg)
        if self._target_kind == "manager" and candidate.iteration is not None \
                and target.iteration != candidate.iteration:
            raise CorruptSnapshotError(f"it is listed at iteration {candidate.iteration} (what it records, or its "
                                       f"name), but the state it holds is at iteration {target.iteration}")

    def _resumed(self, manager: ExtensionsManagerProtocol, found: Candidate | None,
                 candidates: list[Candidate]) -> None:
        if self._owns_out_dir:
            self._superseded = {c.name: dataclasses.replace(c, snapshot=None)  # kept for the run: no manifest
                                for c in candidates if found is None or found.is_older_than(c)}
        if found is None:
            logger.info("autoload found no usable snapshot matching %r under %s; starting fresh",
                        self.filename, self._out_dir)
            return
        for c in candidates:  # (what a name says otherwise is not trusted, but said: a damaged record may be wrong)
            if c.complete and c.is_older_than(found) and c.named_iteration is not None \
                    and found.iteration is not None and c.named_iteration > found.iteration:
                skip(c, f"its name says iteration {c.named_iteration}, but it records iteration {c.iteration}, "
                        f"before {found.name}, which autoload resumes from")
        self.resumed_from = found.url
        self.resumed_name = found.name
        logger.info("resumed from %s at iteration %s (epoch %s)", found.url, manager.iteration,
                    manager.epoch)
