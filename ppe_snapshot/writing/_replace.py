"""Saving again under a name that already holds a snapshot, crash-safely.

ppe's writers overwrite: a filename without format fields
(``"snapshot_latest"``) is saved again at every trigger. An engine snapshot
is a directory, so it cannot be overwritten in one step. Instead the new one
is taken beside it, at its side name (``stored_snapshot.side_name``), then takes the
name (a directory without manifest, left by a crashed take, is simply
taken into):

* local paths: the two directories are exchanged atomically
  (``renameat2(RENAME_EXCHANGE)``), then the old one is removed; where the
  platform cannot exchange, the old one is removed (manifest first) and the
  new one renamed;
* other file systems (object stores): the old one is removed (manifest
  first), then the new one is copied to the name, its manifest last, and
  removed from beside it.

A snapshot of several ranks is moved by rank 0 once it told every other
rank of the commit (the take's rank channel): none of them looks for it
where it was taken, nor touches it there (each rank's writer record, which
a take ends by removing, is removed by rank 0 before the move).

At every moment one complete snapshot exists under the name or beside it,
and :func:`ppe_snapshot.retention.list_snapshots` lists both names for a
format without fields, so autoload finds the newest complete one. The next
save first settles what a crash left beside the name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ppe_snapshot.engine import MANIFEST_NAME, PARTS_DIR
from ppe_snapshot.storage import Tree, join, open_tree
from ppe_snapshot.stored_snapshot import inspect, remove_snapshot, side_name


@dataclass
class Replacement:
    """Moves a committed snapshot from beside ``final`` to ``final``; picklable for the writer process."""
    final: str
    storage_options: dict[str, Any] | None = None

    @property
    def side(self) -> str:
        return side_name(self.final)

    def _tree(self) -> Tree:
        return open_tree(self.final, self.storage_options)

    def exists(self, path: str) -> bool:
        tree = self._tree()
        return tree.exists(tree.path(path))

    def occupied(self, path: str) -> bool:
        """Whether ``path`` holds something a take there would not simply complete: a committed (or
        damaged) snapshot, or a file. A directory without manifest is a crashed take's leftover."""
        tree = self._tree()
        target = tree.path(path)
        if tree.is_dir(target) and not tree.is_link(target):
            return tree.exists(f"{target}/{MANIFEST_NAME}")
        return tree.exists(target)

    def remove(self, path: str) -> None:
        """Remove the snapshot or file at ``path`` (see :func:`remove_snapshot`)."""
        remove_snapshot(path, self.storage_options)

    def promote(self) -> None:
        """Give the committed snapshot beside the name the name; the one it replaces is removed. The take's
        ``.parts/`` (the writer records the other ranks left, see ``TakeJob.moved_after_commit``) goes first."""
        self.remove(join(self.side, PARTS_DIR))
        tree = self._tree()
        final, side = tree.root, tree.path(self.side)
        if tree.exists(final) and tree.swap(side, final):
            self.remove(self.side)  # now the old one
            return
        if tree.exists(final):
            self.remove(self.final)  # no exchange here: for a moment only the new one, beside, is complete
        tree.move_tree(side, final, last=MANIFEST_NAME)


def plan(path: str, storage_options: dict[str, Any] | None) -> tuple[str, Replacement | None]:
    """Where to take a snapshot that must end up at ``path``, and the step that moves it there after.

    Settles first what an interrupted replacement left: a complete snapshot
    beside the name takes the name when the name holds none, or an older one
    by the training position in the metadata; any other leftover beside it
    is removed.
    """
    replacement = Replacement(path, storage_options)
    if replacement.exists(replacement.side):
        side, final = inspect(replacement.side, storage_options), inspect(path, storage_options)
        if side.sound and (not final.sound or side.position > final.position):
            replacement.promote()  # the newer one, interrupted before it had the name
        else:
            replacement.remove(replacement.side)
    if not replacement.occupied(path):
        return path, None  # nothing there, or a crashed take's leftover: the take completes it in place
    return replacement.side, replacement


#: What rank 0 does once its take committed: move it to the name (every other rank learnt of the commit from
#: rank 0 before, through the take's rank channel, so the move cannot hide it from them).
AfterCommit = Optional[Replacement]


def after_commit(job: Any, replacement: Replacement | None) -> AfterCommit:
    """The step after ``job`` commits: rank 0's ``replacement`` (nothing on other ranks)."""
    return replacement if job.rank == 0 else None


def commit_in_place(job: Any, step: AfterCommit) -> int:
    """Write and commit a take job, then run its :func:`after_commit` step; the bytes it wrote."""
    job.write_and_commit()
    if step is not None:
        step.promote()
    return job.written_bytes
