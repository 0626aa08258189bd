"""One snapshot in a run directory: its names, what it records, the quick check, its removal.

Every other module asks here: the writers (where a replacement is written, what a crash left beside a name),
``run_dir`` (listing, retention, autoload), the extension (what a snapshot records) and the CLI.

* **Names.** A snapshot saved again under a name that holds one is written beside it, at :func:`side_name`,
  until it takes the name (``writing``'s replacement); :func:`replaced_name` reads a side name back.
* **What it records.** The training position and the observed values retention compares live in the
  manifest's metadata (:func:`recorded`, written by the extension); :func:`inspect` reads them back.
* **The quick check.** :func:`inspect`: the manifest parses and every data file has its recorded size
  (``Snapshot.verify(deep=False)``). It returns an :class:`Inspection` holding the opened snapshot, so its
  manifest is read once however many times it is asked about.
* **ppe's per-rank files.** SHARDED snapshots saved with a ``savefun`` keep ppe's layout: a directory of one
  ``torch.save`` file per rank (:func:`rank_file`), whole once it holds :data:`RANK_FILES_MARK`.
* **Removal.** :func:`remove_snapshot`: the manifest goes first, so a snapshot is never seen half-removed.
  :func:`retire_snapshot` removes a snapshot whose data files incremental snapshots beside it still read: it is
  marked retired (``RETIRED_NAME``), loses its manifest and index files, and keeps its data files.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ppe_snapshot.engine import INDEX_DIR, LOCAL, MANIFEST_NAME, PARTS_DIR, RETIRED_NAME, Snapshot
from ppe_snapshot.storage import join, open_storage, open_tree

#: Where a snapshot replacing ``<name>`` is written until it takes the name.
SIDE_SUFFIX = ".ppe-snapshot-next"

#: In ppe's layout of SHARDED snapshots saved with a ``savefun``: the file that marks directory ``<name>`` whole, its
#: ranks' files ``<name>/<rank>`` written (by the saver rank, after every rank's own file; see :func:`rank_file`).
RANK_FILES_MARK = "complete"

#: The metadata key under which the extension records observed values for retention (``KeepBest``).
METRICS_KEY = "ppe_snapshot_metrics"


def side_name(name: str) -> str:
    """Where a snapshot replacing the one at ``name`` (a name, path or URL) is written until it takes the name."""
    return name + SIDE_SUFFIX


def replaced_name(name: str) -> str | None:
    """The name that a snapshot written at side name ``name`` is to take; None when ``name`` is no side name."""
    return name[:-len(SIDE_SUFFIX)] if name.endswith(SIDE_SUFFIX) else None


def rank_file(name: str, rank: int) -> str:
    """Where rank ``rank``'s state lies in ppe's layout of SHARDED snapshots with a ``savefun`` (a ``torch.save``
    file per rank in directory ``name``, marked whole by :data:`RANK_FILES_MARK`)."""
    return f"{name}/{rank}"


def unmark_rank_files(location: str, storage_options: dict[str, Any] | None = None) -> None:
    """Take the mark off ppe's per-rank files at ``location`` (a path or URL) before they are saved again, so that
    a save cut short never leaves them marked whole; no mark there: nothing to do."""
    tree = open_tree(location, storage_options)
    mark = f"{tree.root}/{RANK_FILES_MARK}"
    if tree.exists(mark):
        tree.remove(mark)


def recorded(iteration: int, epoch: int, epoch_detail: float, metrics: Mapping[str, float] | None = None,
             **more: Any) -> dict[str, Any]:
    """The metadata of a snapshot taken at a training position: what :func:`inspect` reads back, ``metrics`` (the
    observed values retention compares) under :data:`METRICS_KEY` when there are any, and ``more``."""
    metadata = {"iteration": iteration, "epoch": epoch, "epoch_detail": epoch_detail, **more}
    if metrics:
        metadata[METRICS_KEY] = dict(metrics)
    return metadata


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def recorded_count(value: Any) -> int | None:
    """A recorded iteration or epoch (a manifest's, or the ``_start_iteration`` of ppe's file): an integer, not
    negative; None for anything else (a damaged manifest's ``-4`` would order its snapshot before every other)."""
    return value if type(value) is int and value >= 0 else None


def _finite(value: Any) -> float | None:
    """A recorded number as a float; None for anything else, NaN, an infinity, or an integer beyond floats."""
    if not _number(value):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _fraction(value: Any) -> float | None:
    """A recorded epoch detail: a finite number, not negative (a NaN would leave the snapshots without an order)."""
    number = _finite(value)
    return number if number is not None and number >= 0 else None


@dataclass(frozen=True)
class Inspection:
    """What :func:`inspect` found at ``location``: a sound snapshot (``problem`` None, ``snapshot`` opened, its
    manifest read) and the position and values it records, or why it is not sound."""
    location: str
    problem: str | None = None
    iteration: int | None = None
    epoch: int | None = None
    epoch_detail: float | None = None
    #: Values recorded when it was taken (metadata ``ppe_snapshot_metrics``), e.g. ``{"val/loss": 0.25}``.
    metrics: Mapping[str, float] = field(default_factory=dict)
    #: Its manifest metadata as written ({} when not sound).
    metadata: Mapping[str, Any] = field(default_factory=dict)
    snapshot: Snapshot | None = field(default=None, compare=False, repr=False)
    #: What the quick check raised, when it did (``problem`` says it in one line).
    error: Exception | None = field(default=None, compare=False, repr=False)
    #: An incremental snapshot's: the names of the snapshots beside it whose data files it reads.
    references: tuple[str, ...] = ()

    @property
    def sound(self) -> bool:
        return self.problem is None

    @property
    def position(self) -> tuple[float, float]:
        """(iteration, epoch detail) for ordering, -1 for what it does not record."""
        return (-1 if self.iteration is None else self.iteration,
                -1 if self.epoch_detail is None else self.epoch_detail)


def inspect(location: str, storage_options: dict[str, Any] | None = None, *, allow_pickle: bool = False
            ) -> Inspection:
    """The quick check of the snapshot at ``location`` and what it records (see :class:`Inspection`).

    Never raises for a snapshot that is absent, incomplete or damaged: ``problem`` says what is wrong."""
    snapshot = Snapshot(location, pg=LOCAL, storage_options=storage_options, allow_pickle=allow_pickle)
    try:
        snapshot.verify(deep=False)
        metadata, references = snapshot.metadata, snapshot.references
    except Exception as e:  # noqa: BLE001 - absent, incomplete or damaged: any failure makes it unusable
        return Inspection(location, problem=f"{type(e).__name__}: {e}", error=e)
    if not isinstance(metadata, dict):
        metadata = {}
    iteration, epoch, detail = (metadata.get(key) for key in ("iteration", "epoch", "epoch_detail"))
    recorded_metrics = metadata.get(METRICS_KEY)
    metrics = {k: v for k, v in ((k, _finite(v)) for k, v in recorded_metrics.items())
               if isinstance(k, str) and v is not None} if isinstance(recorded_metrics, dict) else {}
    return Inspection(location, iteration=recorded_count(iteration), epoch=recorded_count(epoch),
                      epoch_detail=_fraction(detail), metrics=metrics, metadata=metadata, snapshot=snapshot,
                      references=references)


def retire_snapshot(location: str, storage_options: dict[str, Any] | None = None) -> None:
    """Remove the engine snapshot at ``location`` but keep its data files, which incremental snapshots beside it
    read: first the retired mark (a crash then leaves a snapshot still whole, retired again at the next prune),
    then the manifest (from here on it is no snapshot), then its index files and anything of a take."""
    storage = open_storage(location, storage_options)
    try:
        storage.put_atomic(RETIRED_NAME, b'{"retired": "retention removed this snapshot; its data files stay '
                                         b'while snapshots beside it reference them"}\n')
        storage.remove(MANIFEST_NAME)
    finally:
        storage.close()
    for below in (INDEX_DIR, PARTS_DIR):
        remove_snapshot(join(location, below), storage_options)


def remove_snapshot(location: str, storage_options: dict[str, Any] | None = None) -> None:
    """Remove the snapshot at ``location`` (a path or URL): a directory loses its manifest (or the mark of ppe's
    per-rank files) first, so it is never seen half-removed, then the rest; a file (a single-file snapshot) is
    removed. Nothing there: nothing to do."""
    tree = open_tree(location, storage_options)
    tree.remove_tree(tree.root, first=(MANIFEST_NAME, RANK_FILES_MARK))
