"""Find, order and prune the snapshots written under one output directory.

The public names of :mod:`ppe_snapshot.run_dir` that users of retention
import: :func:`list_snapshots` (each name under the output directory that
matches a filename format, classified as a :class:`Candidate`, oldest
training position first), :func:`select_prunable` / :func:`prune`
(retention), :func:`remove` and :class:`FilenameFormat`.
"""
from ppe_snapshot.run_dir import (
    COMPLETE_KINDS, Candidate, CandidateKind, FilenameFormat, filesystem, list_snapshots, prune, remove,
    select_prunable,
)

__all__ = ["COMPLETE_KINDS", "Candidate", "CandidateKind", "FilenameFormat", "filesystem", "list_snapshots", "prune",
           "remove", "select_prunable"]
