"""Saving again under a name that already holds a snapshot, crash-safely.

ppe's writers overwrite: a filename without format fields
(``"snapshot_latest"``) is saved again at every trigger. An engine snapshot
is a directory, so it cannot be overwritten in one step. Instead the new one
is taken beside it, at ``<name>`` + :data:`SIDE_SUFFIX`, and then takes the
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
where it was taken.

At every moment one complete snapshot exists under the name or beside it,
and :func:`ppe_snapshot.retention.list_snapshots` lists both names for a
format without fields, so autoload finds the newest complete one. The next
save first settles what a crash left beside the name.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any, Optional

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ppe_snapshot.engine import LOCAL, MANIFEST_NAME, Snapshot
from ppe_snapshot.storage import exchange, is_local, sync_directory, url_to_fs

#: Where a snapshot replacing ``<name>`` is written until it takes the name.
SIDE_SUFFIX = ".ppe-snapshot-next"


def side_name(name: str) -> str:
    """Where a snapshot replacing the one at ``name`` (a name, path or URL) is written until it takes the name."""
    return name + SIDE_SUFFIX


def replaced_name(name: str) -> str | None:
    """The name that a snapshot written at side name ``name`` is to take; None when ``name`` is no side name."""
    return name[:-len(SIDE_SUFFIX)] if name.endswith(SIDE_SUFFIX) else None


def _local_path(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def remove_snapshot(location: str, storage_options: dict[str, Any] | None = None) -> None:
    """Remove the snapshot at ``location`` (a path or URL): a directory loses its manifest first, so it is
    never seen half-removed, then the rest; a file (a single-file snapshot) is removed. Nothing there: nothing
    to do."""
    if is_local(location) and not storage_options:
        local = _local_path(location)
        if os.path.isdir(local) and not os.path.islink(local):
            try:
                os.unlink(os.path.join(local, MANIFEST_NAME))
            except FileNotFoundError:
                pass
            shutil.rmtree(local, ignore_errors=False)
        elif os.path.lexists(local):
            os.unlink(local)
        return
    fs, target = url_to_fs(location, storage_options)
    target = target.rstrip("/")
    if not fs.exists(target):
        return
    if fs.isdir(target):
        try:
            fs.rm_file(f"{target}/{MANIFEST_NAME}")
        except FileNotFoundError:
            pass
        try:
            fs.rm(target, recursive=True)
        except FileNotFoundError:  # an object store drops the "directory" with its last object
            pass
    else:
        fs.rm_file(target)


@dataclass
class Replacement:
    """Moves a committed snapshot from beside ``final`` to ``final``; picklable for the writer process."""
    final: str
    storage_options: dict[str, Any] | None = None

    @property
    def side(self) -> str:
        return side_name(self.final)

    @property
    def _local(self) -> bool:
        return is_local(self.final) and not self.storage_options

    def _fs(self) -> tuple[fsspec.AbstractFileSystem, str]:
        fs, path = url_to_fs(self.final, self.storage_options)
        return fs, path.rstrip("/")

    def exists(self, path: str) -> bool:
        if self._local:
            return os.path.lexists(_local_path(path))
        fs, _ = self._fs()
        return fs.exists(url_to_fs(path, self.storage_options)[1])

    def occupied(self, path: str) -> bool:
        """Whether ``path`` holds something a take there would not simply complete: a committed (or
        damaged) snapshot, or a file. A directory without manifest is a crashed take's leftover."""
        if self._local:
            local = _local_path(path)
            if os.path.isdir(local) and not os.path.islink(local):
                return os.path.lexists(os.path.join(local, MANIFEST_NAME))
            return os.path.lexists(local)
        fs, _ = self._fs()
        target = url_to_fs(path, self.storage_options)[1].rstrip("/")
        return fs.exists(f"{target}/{MANIFEST_NAME}") or fs.isfile(target)

    def remove(self, path: str) -> None:
        """Remove the snapshot or file at ``path`` (see :func:`remove_snapshot`)."""
        remove_snapshot(path, self.storage_options)

    def promote(self) -> None:
        """Give the committed snapshot beside the name the name; the one it replaces is removed."""
        if not self._local:
            self.remove(self.final)
            fs, final = self._fs()
            _move(fs, side_name(final), final)
            return
        final, side = _local_path(self.final), _local_path(self.side)
        if os.path.lexists(final) and exchange(side, final):
            sync_directory(os.path.dirname(os.path.abspath(final)))
            self.remove(side)  # now the old one
            return
        if os.path.lexists(final):
            self.remove(final)  # no exchange here: for a moment only the new one, beside, is complete
        os.rename(side, final)
        sync_directory(os.path.dirname(os.path.abspath(final)))


def _move(fs: fsspec.AbstractFileSystem, source: str, dest: str) -> None:
    """Move a committed snapshot directory to ``dest``, where nothing is.

    A local file system renames it. Elsewhere (object stores have no rename)
    each file is copied, the manifest last, so ``dest`` is a snapshot only
    once all its data is there; the source is then removed, manifest first.
    """
    if isinstance(fs, LocalFileSystem):
        fs.mv(source, dest, recursive=True)
        return
    files = sorted(fs.find(source), key=lambda p: p.endswith(f"/{MANIFEST_NAME}"))
    for path in files:
        fs.copy(path, dest + path[len(source):])
    fs.rm_file(f"{source}/{MANIFEST_NAME}")
    fs.rm(source, recursive=True)


def _checked(path: str, storage_options: dict[str, Any] | None) -> tuple[bool, tuple[float, float]]:
    """Whether ``path`` holds a committed snapshot that passes the quick check, and the training
    position in its metadata ((-1, -1) when it records none)."""
    snapshot = Snapshot(path, pg=LOCAL, storage_options=storage_options)
    try:
        snapshot.verify(deep=False)
        metadata = snapshot.metadata
    except Exception:  # noqa: BLE001 - absent, incomplete or damaged
        return False, (-1, -1)
    position = tuple(value if isinstance(value, (int, float)) and not isinstance(value, bool) else -1
                     for value in (metadata.get("iteration"), metadata.get("epoch_detail")))
    return True, position  # type: ignore[return-value]


def plan(path: str, storage_options: dict[str, Any] | None) -> tuple[str, Replacement | None]:
    """Where to take a snapshot that must end up at ``path``, and the step that moves it there after.

    Settles first what an interrupted replacement left: a complete snapshot
    beside the name takes the name when the name holds none, or an older one
    by the training position in the metadata; any other leftover beside it
    is removed.
    """
    replacement = Replacement(path, storage_options)
    if replacement.exists(replacement.side):
        side_complete, side_position = _checked(replacement.side, storage_options)
        final_complete, final_position = _checked(path, storage_options)
        if side_complete and (not final_complete or side_position > final_position):
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


def commit_in_place(job: Any, step: AfterCommit) -> None:
    """Write and commit a take job, then run its :func:`after_commit` step."""
    job.write_and_commit()
    if step is not None:
        step.promote()
