"""Saving local steps: each rank's part into the tier directory, its partner copy, the agreement, retention.

:meth:`LocalSaves.save` (the training loop's thread) stages the rank's state into a reused buffer and returns
(``Snapshot.async_take``); a worker thread then, step after step in the same order on every rank: waits for the
part to be written, sends it to the rank's partner while receiving its wards' parts (:mod:`.transfer`: each copy
checked against the digest of what its sender sent), and agrees with every rank that the step is complete (an ``exchange`` over the tier's gloo
group, as a take's commit is agreed); only then does each rank write the markers of its part and copies, and
prune its older steps. One step is in flight at a time: a save that finds the previous step still in flight
waits for it (the tier's memory stays bounded, and the work a failure loses stays within about one interval).

Whatever fails costs the tier only: a full or read-only directory, a copy cut off, a bad checksum leave the
step incomplete (never restored) with a warning; a rank lost from the group stops the tier.
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ppe_snapshot.engine import LOCAL, PendingSnapshot, Snapshot, StagedImage, exchange, staging_estimate
from ppe_snapshot.local_tier import layout, transfer
from ppe_snapshot.storage import Tree, join, open_tree, record_files
from ppe_snapshot.writing import StagingBuffers

logger = logging.getLogger(__name__)

#: The tier's tags on the ranks' side group: above a take's own (at most 2^28, see the engine's rank channel) and
#: below the side group's exchanges (from 2^29). The start's exchange, then the restore's (:mod:`.recovery`), then
#: two per step (its copies, its agreement).
START_TAG = (1 << 28) + 16
RESTORE_TAGS = START_TAG + 1
_TAGS = START_TAG + 16


@dataclass
class Ranks:
    """Where this rank stands among the ranks of the tier: its rank and the world size, the gloo group they speak
    over (the side group of the ranks' takes; None: one process), its partner (None: no copy) and its wards (whose
    copies it holds)."""
    rank: int = 0
    world_size: int = 1
    group: Any = None
    partner: int | None = None
    wards: tuple[int, ...] = ()


@dataclass
class _Step:
    step: int
    tag: int
    pending: PendingSnapshot | None
    problem: str | None
    #: Ends the loan of the durable save's staged image the part copies from (None: no loan).
    release: Callable[[], None] | None = None


class LocalSaves:
    """The local tier's saves of one rank (see the module's docstring)."""

    def __init__(self, directory: str, ranks: Ranks, keep: int, recheck: bool = False) -> None:
        """``recheck``: a restore checks this rank's own part against its checksums even where its files are
        unchanged since it was completed (its marker records them: ``storage.record_files``)."""
        self.directory, self.ranks, self.keep, self.recheck = directory, ranks, keep, recheck
        self.tree: Tree = open_tree(directory)
        self._queue: queue.Queue[_Step | None] = queue.Queue()
        self._slots = threading.Semaphore(1)  # one step in flight: a save waits for the previous one
        self._tags = 0
        #: The staging buffer of the step in flight, reused by the next (one step in flight at a time).
        self._buffers = StagingBuffers(1)
        #: Why the tier stopped (a rank lost from its group), or None.
        self.stopped: str | None = None
        self._thread = threading.Thread(target=self._work, name="ppe-snapshot-local-tier", daemon=True)
        self._thread.start()

    def part_path(self, step: int, rank: int | None = None) -> str:
        return join(self.directory, layout.own_part(step, self.ranks.rank if rank is None else rank))

    def save(self, step: int, app_state: dict[str, Any], metadata: dict[str, Any],
             staged_from: StagedImage | None = None, release: Callable[[], None] | None = None) -> None:
        """Stage this rank's ``app_state`` as its part of local ``step``; written, copied and agreed on in the
        background. Returns once the state is copied (or the save failed: warned, the step stays incomplete).

        ``staged_from``: the staged image of a durable save of this step; the tensors it holds are copied from
        there in the background (the state is copied out of training once); ``release()`` is called once they
        are (or the save failed)."""
        if self.stopped is not None:
            if release is not None:
                release()
            return
        self._slots.acquire()
        self._tags += 1
        pending, problem = None, None
        self._reuse_spares([layout.own_part(step, self.ranks.rank)])
        try:
            pending = Snapshot.async_take(self.part_path(step), app_state, pg=LOCAL, staging=self._staging,
                                          metadata={**metadata, "ppe_snapshot_local_step": step},
                                          staged_from=staged_from)
        except Exception as e:  # noqa: BLE001 - the tier fails alone; the other ranks still hear of it
            problem = f"{type(e).__name__}: {e}"
            if release is not None:
                release()
            release = None
        else:
            logger.debug("local step %d: %d bytes staged, %d of them copied from the durable save's image", step,
                         pending.nbytes, pending.from_image_bytes)
        self._queue.put(_Step(step, _TAGS + 2 * (self._tags % (1 << 26)), pending, problem, release))

    def _reuse_spares(self, parts: list[str]) -> None:
        """Put the spares of ``parts``' slots where they are about to be written (:func:`~.layout.reuse_spare`);
        where that fails, they are written into fresh memory."""
        try:
            for part in parts:
                layout.reuse_spare(self.tree, part)
        except OSError as e:
            logger.debug("the local tier's spares were not reused: %s: %s", type(e).__name__, e)

    def _staging(self, nbytes: int) -> torch.Tensor:
        """The staging buffer of a save: the tier's own, free again once the step before is complete, grown when
        the state grew; page-locked once CUDA is in use."""
        return self._buffers.get(0, nbytes, torch.cuda.is_initialized())[:nbytes]

    def prepare_staging(self, state: Any) -> None:
        """Make the staging buffer of a save of ``state`` (or of a stand-in of its size) ready in a background
        thread, so that the first local save blocks only for its copy (see ``StagingBuffers.reserve``)."""
        self._buffers.reserve(*staging_estimate(state))

    def finish(self, timeout: float | None = None) -> None:
        """Let the steps in flight end (their copies and agreement), then stop the worker."""
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the local tier's last steps did not end within %s s; they stay incomplete", timeout)

    # -- the worker ---------------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                if self.stopped is None:
                    self._complete(item)
            except Exception as e:  # noqa: BLE001 - a peer lost: the tier stops; training goes on
                self.stopped = f"{type(e).__name__}: {e}"
                logger.warning("the local tier stopped at step %d: %s; durable snapshots go on", item.step,
                               self.stopped)
            finally:
                self._wait_written(item)  # a stopped tier too: the write may read a durable save's image
                self._slots.release()

    def _wait_written(self, item: _Step) -> str | None:
        """Wait for ``item``'s part to be written (once), end its loan of a durable save's image and give its
        staging buffer back; why the write failed, or None."""
        pending, item.pending = item.pending, None
        if pending is None:
            return None
        try:
            pending.wait()
        except Exception as e:  # noqa: BLE001 - a full tmpfs, a read-only directory, ...
            return f"{type(e).__name__}: {e}"
        finally:
            if item.release is not None:
                item.release()
        return None

    def _complete(self, item: _Step) -> None:
        """Step ``item`` to its end on this rank: nothing on this rank's files may keep it from its part of the
        copies and the agreement (the other ranks wait for it there); only a lost peer stops the tier."""
        ranks = self.ranks
        problem = item.problem if item.pending is None else self._wait_written(item)
        if ranks.partner is not None or ranks.wards:
            problem = self._copy(item, problem) or problem
        decided = self._agree(item, problem)
        mine = [layout.own_part(item.step, ranks.rank)] + [layout.copy_of(item.step, w) for w in ranks.wards]
        try:
            if decided is None:
                self._mark(item.step)
                layout.prune_parts(self.tree, ranks.rank, list(ranks.wards), self.keep)
                return
            logger.warning("local step %d is incomplete and will not be restored: %s", item.step, decided)
            for part in mine:
                layout.remove_part(self.tree, part)
        except OSError as e:  # a part without its marker is never restored; the next start removes it
            logger.warning("local step %d: %s: %s", item.step, type(e).__name__, e)

    def _copy(self, item: _Step, problem: str | None) -> str | None:
        """Send this rank's part to its partner and receive its wards' copies; what went wrong with the copies
        received (a peer that died raises)."""
        ranks = self.ranks
        send = None if ranks.partner is None else (ranks.partner, None if problem else self.part_path(item.step))
        wrong = None
        try:
            for ward in ranks.wards:
                layout.remove_part(self.tree, layout.copy_of(item.step, ward))
        except OSError as e:  # the copies are received all the same (and dropped where they cannot be written)
            wrong = f"{type(e).__name__}: {e}"
        self._reuse_spares([layout.copy_of(item.step, ward) for ward in ranks.wards])
        incoming = [transfer.Incoming(w, join(self.directory, layout.copy_of(item.step, w))) for w in ranks.wards]
        sent = transfer.move(ranks.group, item.tag, send, incoming)
        for part in incoming:
            if wrong is None and sent[part.peer] is not None:
                wrong = f"the copy of rank {part.peer}'s part: {sent[part.peer]}"
        return wrong

    def _agree(self, item: _Step, problem: str | None) -> str | None:
        """None when every rank's part and copies of ``item`` are complete, else why not (the same on every rank)."""
        ranks = self.ranks
        if ranks.group is None:
            return problem

        def decide(docs: list[Any]) -> Any:
            wrong = [f"rank {r}: {p}" for r, p in enumerate(docs) if p is not None]
            return "; ".join(wrong) if wrong else None

        return exchange(ranks.group, problem, item.tag + 1, decide)

    def _mark(self, step: int) -> None:
        ranks = self.ranks
        doc = {"step": step, "world_size": ranks.world_size}
        files = None if self.recheck else record_files(self.part_path(step))
        layout.write_marker(self.tree, layout.own_part(step, ranks.rank),
                            {**doc, "rank": ranks.rank, **({"files": files} if files else {})})
        for ward in ranks.wards:
            layout.write_marker(self.tree, layout.copy_of(step, ward), {**doc, "rank": ward})
