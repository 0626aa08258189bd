"""The run directory: the snapshots one training run keeps under its output directory.

=================  =========================================================================================
``names``          a filename format (``"snapshot_iter_{.iteration}"``) as a matcher of names
``listing``        the names under the output directory that match, classified (:class:`Candidate`), oldest
                   training position first; or only the iterations they name (:func:`named_positions`)
``single_files``   ppe's single-file snapshots (``torch.save``): the quick check, the recorded position, loading
``policies``       retention policies: which complete snapshots to keep (KeepLatest, KeepEvery, KeepBest, a | b)
``pruning``        retention: what to remove, and removing it
``resume``         what to resume from: the newest candidate that restores, the others skipped
=================  =========================================================================================

What one snapshot is (its names, what it records, the quick check, its
removal) is :mod:`ppe_snapshot.stored_snapshot`'s; this package does not
import the writers, nor pytorch_pfn_extras (``import ppe_snapshot`` loads it through
:mod:`ppe_snapshot.retention`).
"""
from ppe_snapshot.run_dir.listing import (
    COMPLETE_KINDS, Candidate, CandidateKind, NamedPositions, filesystem, leftover, list_snapshots, named_positions,
)
from ppe_snapshot.run_dir.names import FilenameFormat
from ppe_snapshot.run_dir.policies import KeepAll, KeepBest, KeepEvery, KeepLatest, Policy, Union, as_policy, combine
from ppe_snapshot.run_dir.pruning import prune, remove, select_prunable
from ppe_snapshot.run_dir.resume import Failure, Unusable, attempt, cannot_start_fresh, skip, target_changed
from ppe_snapshot.run_dir.single_files import load_file
from ppe_snapshot.stored_snapshot import METRICS_KEY

__all__ = ["COMPLETE_KINDS", "METRICS_KEY", "Candidate", "CandidateKind", "Failure", "FilenameFormat", "KeepAll",
           "KeepBest", "KeepEvery", "KeepLatest", "NamedPositions", "Policy", "Union", "Unusable", "as_policy",
           "attempt", "cannot_start_fresh", "combine", "filesystem", "leftover", "list_snapshots", "load_file",
           "named_positions", "prune", "remove", "select_prunable", "skip", "target_changed"]
