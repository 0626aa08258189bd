"""Find, order and prune the snapshots written under one output directory.

The public names of :mod:`ppe_snapshot.run_dir` that users of retention
import: :func:`list_snapshots` (each name under the output directory that
matches a filename format, classified as a :class:`Candidate`, oldest
training position first), :func:`select_prunable` / :func:`prune`
(retention), :func:`remove` and :class:`FilenameFormat`; the retention
policies :class:`KeepLatest`, :class:`KeepEvery`, :class:`KeepBest`, their
union ``a | b`` (:class:`Union`) and the base :class:`Policy` to write one
(its protocol: :mod:`ppe_snapshot.run_dir.policies`).
"""
from ppe_snapshot.run_dir import (
    COMPLETE_KINDS, METRICS_KEY, Candidate, CandidateKind, FilenameFormat, KeepAll, KeepBest, KeepEvery, KeepLatest,
    Policy, Union, as_policy, filesystem, list_snapshots, prune, remove, select_prunable,
)

__all__ = ["COMPLETE_KINDS", "METRICS_KEY", "Candidate", "CandidateKind", "FilenameFormat", "KeepAll", "KeepBest",
           "KeepEvery", "KeepLatest", "Policy", "Union", "as_policy", "filesystem", "list_snapshots", "prune",
           "remove", "select_prunable"]
