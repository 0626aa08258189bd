"""Knowing a local directory's files unchanged since they were recorded, so that reading them need not check
their checksums again (the local tier's own parts, which it wrote and read back only at a restart).

:func:`record_files` describes each file: one of at least ``STAT_BYTES`` by its size, inode, and modification and
change times (``os.stat``), a smaller one by its size and the xxh3 of its bytes. :func:`open_unchanged` finds
them exactly so (the same names, each described the same) and opens the directory as :class:`UnchangedFiles`, a
storage whose data is read without checksums checked; else None. Every write to a file sets its change time,
which no one can set back; a file replaced is another inode.

The kernel may stamp a change with a clock that advances in ticks (up to 10 ms), so a change made within a tick
of a file's last write could keep its change time: a record waits until the change times of the files it
describes by ``os.stat`` are at least ``SETTLED_S`` old.
"""
from __future__ import annotations

import os
import time
from typing import Any

import xxhash

from ppe_snapshot.storage.local import LocalStorage
from ppe_snapshot.storage.trees import local_path

#: How old the change time of a file described by ``os.stat`` must be before it is recorded.
SETTLED_S = 0.02
#: Files of at least this size are described by ``os.stat``; smaller ones by their bytes' xxh3.
STAT_BYTES = 1 << 20


class UnchangedFiles(LocalStorage):
    """A directory found unchanged since its record (:func:`open_unchanged`): its data is read unchecked."""

    verify_data = False


def record_files(location: str) -> dict[str, list[Any]] | None:
    """Each file under ``location`` (relative name -> its description), or None where it is not on the local file
    system, holds no file, or cannot be read."""
    root = local_path(location)
    if root is None:
        return None
    try:
        names = _files(root)
        stats = {name: os.stat(os.path.join(root, name)) for name in names}
        newest = max((st.st_ctime_ns for st in stats.values() if st.st_size >= STAT_BYTES), default=0)
        wait = SETTLED_S - (time.time_ns() - newest) / 1e9
        if wait > 0:  # (a write meanwhile leaves the record older than the file: the file counts as changed)
            time.sleep(wait)
        return {name: _described(root, name, stats[name]) for name in names} or None
    except OSError:
        return None


def open_unchanged(location: str, recorded: Any) -> UnchangedFiles | None:
    """``location`` opened as :class:`UnchangedFiles` where its files are exactly those ``recorded`` (of
    :func:`record_files`); else None."""
    root = local_path(location)
    if root is None or not isinstance(recorded, dict) or not recorded:
        return None
    try:
        names = _files(root)
        same = sorted(recorded) == names and all(
            _described(root, name, os.stat(os.path.join(root, name))) == recorded[name] for name in names)
    except OSError:
        return None
    return UnchangedFiles(root, url=location) if same else None


def _files(root: str) -> list[str]:
    """The files under ``root``, relative (``/``-separated), sorted."""
    return sorted(os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
                  for folder, _, names in os.walk(root) for name in names)


def _described(root: str, name: str, st: os.stat_result) -> list[Any]:
    """File ``name`` as a record holds it, ``st`` its ``os.stat``."""
    if st.st_size >= STAT_BYTES:
        return [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]
    with open(os.path.join(root, name), "rb") as f:
        data = f.read(STAT_BYTES)
    return [len(data), xxhash.xxh3_64_hexdigest(data)]
