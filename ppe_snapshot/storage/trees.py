"""The run-directory operations: what the floors above do with whole files and directories of a store.

:class:`Storage` covers the files inside one snapshot; a :class:`Tree` covers the places around them: listing a
run directory, removing a snapshot directory (a named file first, so it is never seen half-removed), moving one
(a named file last, so it is a snapshot only once whole), exchanging two, saving a single file atomically, and
the questions (exists, is a directory, size, time). :func:`open_tree` gives the local one for a local path and
the fsspec one for any other URL; nothing above this floor tells the two apart.

Every method takes a path of the tree's file system (:attr:`Tree.root` and names joined below it, or
:meth:`Tree.path` of another location on it).
"""
from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any, Callable

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ppe_snapshot.storage.base import forget_listings
from ppe_snapshot.storage.fsspec import remove_file, url_to_fs
from ppe_snapshot.storage.stores import profile_of_url
from ppe_snapshot.storage.swap import swap_entries, sync_directory
from ppe_snapshot.storage.tuning import split_tuning


def is_local(path: str) -> bool:
    """Whether ``path`` names the local file system (a plain path or ``file://``)."""
    return "://" not in path or path.startswith("file://")


def local_path(location: str, storage_options: dict[str, Any] | None = None) -> str | None:
    """The path on the local file system that ``location`` names (``file://`` stripped), or None where it is
    another file system's or ``storage_options`` ask for fsspec (the object-store knobs alone do not)."""
    location = str(location)
    if not is_local(location) or split_tuning(storage_options)[1]:
        return None
    return location.removeprefix("file://")


def absolute(location: str) -> str:
    """``location`` with a local path made absolute (``file://`` stripped); a URL as it is."""
    return os.path.abspath(location.removeprefix("file://")) if is_local(location) else location


def memory_backed_dir() -> str:
    """A local directory whose files live in memory where the system has one (``/dev/shm``), else the temporary
    directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def is_known_location(location: str) -> bool:
    """Whether ``location`` is a local path, or a URL (chains like ``simplecache::s3://...`` too) whose every
    protocol names an fsspec file system."""
    if is_local(location) and "::" not in location:
        return True
    known = set(fsspec.available_protocols())
    return all(part.split("://", 1)[0] in known for part in location.split("::"))


def in_one_process(location: str) -> bool:
    """Whether what is stored at ``location`` lives in this process only (``memory://``, as its store's profile
    says): another process (a writer's worker) cannot reach it."""
    profile = profile_of_url(location)
    return profile is not None and profile.one_process


def anchored(location: str, base: str) -> str:
    """``location`` resolved against local directory ``base`` where it is a relative local path (as ppe's local
    file system resolves it); a URL or an absolute path as it is."""
    return os.path.join(base, location) if is_local(location) and not location.startswith("file://") else location


def remove_local_shadow(url: str) -> None:
    """A local-only writer (ppe's) made a local directory of URL ``url`` (``./s3:/bucket/run``): remove that empty
    stray, and its empty parents up to ``s3:``. A local path, or no such directory: nothing to do."""
    if is_local(url) or not os.path.isdir(url):
        return
    try:
        os.removedirs(url)  # empty directories only, bottom up; stops at the first that is not empty
    except OSError:
        pass


def _ignore_missing(action: Callable[[], Any]) -> None:
    try:
        action()
    except FileNotFoundError:
        pass


def _write_or_remove(opener: Callable[[str, str], Any], path: str, write: Callable[[Any], int],
                     remove: Callable[[str], Any]) -> int:
    """``write`` into a new file at ``path``; when it raises, the file (whatever of it was written, or closed into
    an object) is removed before the error goes on, so a failed save leaves no partial ``tmp_`` file."""
    try:
        with opener(path, "wb") as f:
            return write(f)
    except BaseException:
        try:
            remove(path)
        except Exception:  # the save's own error is the one to raise
            pass
        raise


class Tree:
    """Files and directories of one file system, reached from location :attr:`url` (its path there: :attr:`root`)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None) -> None:
        self.url, self.storage_options = url, storage_options

    @functools.cached_property
    def _opened(self) -> tuple[fsspec.AbstractFileSystem, str]:
        fs, root = url_to_fs(self.url, self.storage_options)  # once asked: opening one may import its client
        return fs, root.rstrip("/") or root

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return self._opened[0]

    @property
    def root(self) -> str:
        return self._opened[1]

    def path(self, location: str) -> str:
        """The path on this tree's file system of ``location`` (a path or URL of the same file system)."""
        return url_to_fs(location, self.storage_options)[1].rstrip("/")

    # -- questions ----------------------------------------------------------------------------------
    def exists(self, path: str) -> bool:
        """Whether anything is at ``path`` (a link too, wherever it points)."""
        return self.fs.exists(path)

    def is_dir(self, path: str) -> bool:
        return self.fs.isdir(path)

    def is_file(self, path: str) -> bool:
        return self.fs.isfile(path)

    def is_link(self, path: str) -> bool:
        """Whether ``path`` is a symbolic link (only a local file system has them)."""
        return False

    @property
    def local_dir(self) -> str | None:
        """:attr:`root` where this tree is the local file system, for tools that read and write only local files
        (torch DCP's own ``FileSystemReader`` / ``FileSystemWriter``); None elsewhere."""
        return None

    def size(self, path: str) -> int:
        """The bytes of the file at ``path``, or of every file below directory ``path``."""
        return int(self.fs.du(path, total=True)) if self.fs.isdir(path) else int(self.fs.size(path))

    def info(self, path: str) -> dict[str, Any]:
        """What the file system says of ``path`` (``name``, ``type``, ``size`` and its own keys, times among them)."""
        return self.fs.info(path)

    def list(self, path: str) -> list[dict[str, Any]]:
        """The entries of directory ``path`` as they are now (:meth:`info` of each; none where it is no
        directory). Listing caches of it and below it are dropped first: ``refresh`` is not every file system's
        word for it (adlfs ignores it and answered with the listing of its first call)."""
        forget_listings(self.fs, path)
        try:
            return self.fs.ls(path, detail=True, refresh=True)
        except (FileNotFoundError, NotADirectoryError):
            return []

    # -- files ----------------------------------------------------------------------------------------
    def open(self, path: str, mode: str = "rb") -> Any:
        return self.fs.open(path, mode)

    def read(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def save_file(self, path: str, write: Callable[[Any], int], *, append: bool = False, via: Any = None) -> int:
        """Write one file with ``write(file)`` (its result returned): at ``tmp_<name>`` beside ``path``, then moved
        over it, so ``path`` holds the old file or the new one, whole (a ``write`` that raises leaves the old file
        and no ``tmp_<name>``); ``append`` writes to ``path`` itself. ``via``:
        a ppe file-system object to do it with (local paths only; None: this tree's own calls)."""
        directory, _, name = path.rpartition("/")
        if directory:
            self.fs.makedirs(directory, exist_ok=True)
        if append:
            with self.fs.open(path, "ab") as f:
                return write(f)
        tmp = f"{directory}/tmp_{name}" if directory else f"tmp_{name}"
        written = _write_or_remove(self.fs.open, tmp, write, self._remove_file)
        self.fs.mv(tmp, path)
        return written

    def _remove_file(self, path: str) -> None:
        remove_file(self.fs, path)

    # -- directories ----------------------------------------------------------------------------------
    def make_directory(self, path: str, via: Any = None) -> None:
        """Create directory ``path`` and its parents where this file system has directories (object stores have
        none: nothing to do). ``via``: as in :meth:`save_file`."""

    def remove(self, path: str) -> None:
        """Remove the file or directory at ``path`` (with everything below it)."""
        self.fs.rm(path, recursive=self.fs.isdir(path))

    def remove_tree(self, path: str, first: Sequence[str]) -> None:
        """Remove directory ``path``, its files ``first`` (in that order, those there) before anything else, or
        the file at ``path``; nothing there: nothing to do."""
        if not self.fs.exists(path):
            return
        if not self.fs.isdir(path):
            self._remove_file(path)
            return
        for name in first:
            _ignore_missing(lambda: self._remove_file(f"{path}/{name}"))
        _ignore_missing(lambda: self.fs.rm(path, recursive=True))  # an object store drops it with its last object

    def move(self, source: str, dest: str) -> None:
        """Move the file or directory at ``source`` to ``dest``, where nothing is."""
        self.fs.mv(source, dest, recursive=self.fs.isdir(source))

    def move_tree(self, source: str, dest: str, last: str) -> None:
        """Move directory ``source`` to ``dest``, where nothing is, so that ``dest`` holds file ``last`` only
        once everything else is there; ``source`` is then removed, ``last`` first. Object stores have no rename:
        each file is copied."""
        if isinstance(self.fs, LocalFileSystem):
            self.fs.mv(source, dest, recursive=True)
            return
        files = sorted(self.fs.find(source), key=lambda p: p.endswith(f"/{last}"))
        for path in files:
            self.fs.copy(path, dest + path[len(source):])
        self._remove_file(f"{source}/{last}")
        self.fs.rm(source, recursive=True)

    def swap(self, first: str, second: str) -> bool:
        """Exchange the entries at two existing paths in one atomic step; False, having changed nothing, where this
        file system cannot."""
        return False


class LocalTree(Tree):
    """The local file system, with plain ``os`` calls where a link or atomicity matters."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None) -> None:
        super().__init__(url, storage_options)
        self._opened = LocalFileSystem(), self.path(url)

    def path(self, location: str) -> str:
        path = str(location).removeprefix("file://")
        return path.rstrip("/") or path

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    @property
    def local_dir(self) -> str | None:
        return self.root

    def is_link(self, path: str) -> bool:
        return os.path.islink(path)

    def save_file(self, path: str, write: Callable[[Any], int], *, append: bool = False, via: Any = None) -> int:
        directory, name = os.path.split(path)
        if directory:
            (via.makedirs if via is not None else os.makedirs)(directory, exist_ok=True)
        opener = via.open if via is not None else open
        if append:
            with opener(path, "ab") as f:
                return write(f)
        tmp = os.path.join(directory, f"tmp_{name}")
        written = _write_or_remove(opener, tmp, write, via.remove if via is not None else os.unlink)
        (via.rename if via is not None else os.replace)(tmp, path)
        return written

    def make_directory(self, path: str, via: Any = None) -> None:
        (via.makedirs if via is not None else os.makedirs)(path, exist_ok=True)

    def remove_tree(self, path: str, first: Sequence[str]) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            for name in first:
                _ignore_missing(lambda: os.unlink(os.path.join(path, name)))
            shutil.rmtree(path, ignore_errors=False)
        elif os.path.lexists(path):
            os.unlink(path)

    def move(self, source: str, dest: str) -> None:
        os.rename(source, dest)  # (one entry renamed, the same file: fsspec before 2024.9 copied a file moved)

    def move_tree(self, source: str, dest: str, last: str) -> None:
        os.rename(source, dest)
        sync_directory(os.path.dirname(os.path.abspath(dest)))

    def swap(self, first: str, second: str) -> bool:
        if not swap_entries(first, second):
            return False
        sync_directory(os.path.dirname(os.path.abspath(second)))
        return True


def open_tree(location: str, storage_options: dict[str, Any] | None = None) -> Tree:
    """The tree of the file system that ``location`` (a local path or any fsspec URL) is on, rooted there."""
    location = str(location)
    if local_path(location, storage_options) is not None:
        return LocalTree(location, storage_options)
    return Tree(location, storage_options)
