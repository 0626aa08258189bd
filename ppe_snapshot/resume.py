"""What autoload needs beside retention: reading ppe's single files, skipping, refusing to start fresh."""
from __future__ import annotations

import logging
import warnings
from typing import Any

import fsspec
import numpy as np
import torch

from ppe_snapshot.engine import LOCAL, Snapshot
from ppe_snapshot.errors import SnapshotError
from ppe_snapshot.retention import Candidate

logger = logging.getLogger("ppe_snapshot")


class Unusable(Exception):
    """A candidate that cannot be restored, found before any state was touched."""


def cannot_start_fresh(what: str) -> SnapshotError:
    return SnapshotError(
        f"autoload: restoring {what} failed part way, so the target's state may be partly overwritten, and no "
        "older snapshot could be restored; training cannot start fresh safely. Repair or remove the damaged "
        "snapshots, or start with autoload=False.")


def skip(candidate: Candidate, reason: str) -> None:
    """Warn (and log) that autoload does not use ``candidate``."""
    message = f"ppe_snapshot autoload: skipping snapshot {candidate.url}: {reason}"
    logger.warning(message)
    warnings.warn(message, stacklevel=4)


def load_file(url: str, storage_options: dict[str, Any] | None) -> Any:
    """A single-file (``torch.save``) snapshot, loaded with ``weights_only``.

    numpy arrays are allowed too: the numpy RNG state (``RNGState``) holds one.
    """
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    numpy_globals = [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with fsspec.open(url, "rb", **(storage_options or {})) as f, torch.serialization.safe_globals(numpy_globals):
        return torch.load(f, map_location=torch.device("cpu"), weights_only=True)


def holds_iteration(location: str, storage_options: dict[str, Any] | None, iteration: int) -> bool:
    """Whether a committed snapshot at ``location`` records training position ``iteration``."""
    try:
        metadata = Snapshot(location, pg=LOCAL, storage_options=storage_options).metadata
    except Exception:  # noqa: BLE001 - absent or unreadable: not a committed snapshot
        return False
    return isinstance(metadata, dict) and metadata.get("iteration") == iteration


def opened(candidate: Candidate, pg: Any, storage_options: dict[str, Any] | None,
           allow_pickle: bool) -> tuple[Snapshot, dict[str, Any]]:
    """The engine snapshot of ``candidate`` and its metadata; :class:`Unusable` when its manifest is not sound."""
    snap = Snapshot(candidate.url, pg=pg, storage_options=storage_options, allow_pickle=allow_pickle)
    try:
        metadata = snap.metadata
    except Exception as e:  # noqa: BLE001 - CorruptSnapshotError, UnsupportedFormatError, I/O: nothing touched yet
        raise Unusable(f"{type(e).__name__}: {e}") from e
    if not isinstance(metadata, dict):
        raise Unusable(f"its manifest's metadata is a {type(metadata).__name__}, not an object: the snapshot "
                       "is damaged")
    return snap, metadata
