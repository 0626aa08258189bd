"""Find, order and prune the snapshots written under one output directory.

The snapshot extension names its snapshots with a format string
(``"snapshot_iter_{.iteration}"``). Here that format becomes a matcher, the
output directory (a local path or an fsspec URL) is listed for names it
matches, and each match is classified:

``snapshot``    an engine snapshot (a directory) whose manifest parses and whose data files have their sizes
``file``        a single-file snapshot written with a ``savefun`` (ppe's ``torch.save`` format)
``incomplete``  a directory without manifest: a save in progress, or the leftover of a crashed one
``damaged``     a directory whose manifest or data files are broken, or a file that is not a torch.save file

Snapshots are ordered by the training position recorded in them (the
iteration, then the epoch detail) and never by modification time. For a
format without fields, the snapshot being written beside the name to
replace it (``<name>`` + ``SIDE_SUFFIX``) is listed too: a crash may have
left the newest complete snapshot there.
"""
from __future__ import annotations

import io
import logging
import pickle
import posixpath
import re
import string
import zipfile
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import fsspec

from ppe_snapshot.engine import LOCAL, Snapshot
from ppe_snapshot.engine.commit import PARTS_DIR
from ppe_snapshot.engine.manifest import MANIFEST_NAME
from ppe_snapshot.storage import join
from ppe_snapshot.writing._replace import SIDE_SUFFIX

logger = logging.getLogger("ppe_snapshot")

COMPLETE_KINDS = ("snapshot", "file")

# Regular expressions for the manager attributes a filename format usually holds.
_FIELD_PATTERNS = {
    "iteration": r"\d+",
    "epoch": r"\d+",
    "execution": r"\d+",
    "epoch_detail": r"\d+(?:\.\d*)?(?:[eE][-+]?\d+)?",
}
_ANY = r"[^/]+?"


class FilenameFormat:
    """A filename format string (``"snap/iter_{.iteration:06d}"``) turned into a matcher.

    Each ``/``-separated component becomes one regular expression; replacement
    fields become groups, and the manager attribute they name (``iteration``,
    ``epoch``, ``epoch_detail``) is parsed back from a matching name.
    """

    def __init__(self, fmt: str) -> None:
        if not isinstance(fmt, str):
            raise TypeError(f"a filename format must be a str, got {type(fmt).__name__}")
        try:
            tokens = list(string.Formatter().parse(fmt))
        except ValueError as e:
            raise ValueError(f"filename {fmt!r} is not a valid format string: {e}") from None
        self.fmt = fmt
        components: list[tuple[str, list[str | None]]] = [("", [])]
        for literal, field, _spec, _conversion in tokens:
            pieces = literal.split("/")
            for i, piece in enumerate(pieces):
                if i:
                    components.append(("", []))
                pattern, attrs = components[-1]
                components[-1] = (pattern + re.escape(piece), attrs)
            if field is not None:
                attr = _attribute(field)
                pattern, attrs = components[-1]
                components[-1] = (pattern + f"({_FIELD_PATTERNS.get(attr or '', _ANY)})", attrs + [attr])
        if any(not pattern for pattern, _ in components):
            raise ValueError(f"filename {fmt!r} has an empty path component")
        self._components = [(re.compile(pattern), attrs) for pattern, attrs in components]

    @property
    def fixed(self) -> bool:
        """Whether the format has no replacement fields: it names one snapshot, saved again and again."""
        return not any(attrs for _, attrs in self._components)

    @property
    def depth(self) -> int:
        """The number of path components of a matching name."""
        return len(self._components)

    def match_component(self, level: int, name: str) -> dict[str, str] | None:
        """The field values of path component ``level`` of a name, or None when it does not match."""
        regex, attrs = self._components[level]
        m = regex.fullmatch(name)
        if m is None:
            return None
        values: dict[str, str] = {}
        for attr, value in zip(attrs, m.groups()):
            if attr is not None:
                values.setdefault(attr, value)
        return values

    def match(self, name: str) -> dict[str, str] | None:
        """The field values of a relative name (``"snap/iter_10"``), or None when it does not match."""
        parts = name.split("/")
        if len(parts) != self.depth:
            return None
        values: dict[str, str] = {}
        for level, part in enumerate(parts):
            found = self.match_component(level, part)
            if found is None:
                return None
            for k, v in found.items():
                values.setdefault(k, v)
        return values


def _attribute(field: str) -> str | None:
    """The manager attribute a replacement field reads (``".iteration"`` -> ``"iteration"``)."""
    if "[" in field or "." not in field:
        return None
    return field.rsplit(".", 1)[1] or None


@dataclass(frozen=True)
class Candidate:
    """One name under the output directory that matches the filename format."""
    name: str
    url: str
    kind: str
    iteration: int | None
    epoch_detail: float | None
    problem: str | None = None
    busy: bool = False

    @property
    def complete(self) -> bool:
        return self.kind in COMPLETE_KINDS

    def sort_key(self) -> tuple:
        return (-1 if self.iteration is None else self.iteration,
                -1.0 if self.epoch_detail is None else self.epoch_detail, self.name)

    def is_older_than(self, other: "Candidate") -> bool:
        """Whether this name is known to hold an earlier training position than ``other``."""
        if self.iteration is not None and other.iteration is not None:
            return self.iteration < other.iteration
        if self.epoch_detail is not None and other.epoch_detail is not None:
            return self.epoch_detail < other.epoch_detail
        return False

    def describe(self) -> str:
        where = f"iteration {self.iteration}" if self.iteration is not None else "unknown position"
        return f"{self.url} ({where})"


def _filename_position(values: dict[str, str]) -> tuple[int | None, float | None]:
    iteration = int(values["iteration"]) if "iteration" in values else None
    if "epoch_detail" in values:
        epoch_detail: float | None = float(values["epoch_detail"])
    elif "epoch" in values:
        epoch_detail = float(values["epoch"])
    else:
        epoch_detail = None
    return iteration, epoch_detail


def filesystem(out_dir: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec file system of ``out_dir`` and its root path there."""
    fs, root = fsspec.core.url_to_fs(str(out_dir), **(storage_options or {}))
    return fs, root.rstrip("/")


def _ls(fs: fsspec.AbstractFileSystem, path: str) -> list[dict[str, Any]]:
    try:
        return fs.ls(path, detail=True, refresh=True)
    except (FileNotFoundError, NotADirectoryError):
        return []


def list_snapshots(out_dir: str, fmt: str | FilenameFormat,
                   storage_options: dict[str, Any] | None = None) -> list[Candidate]:
    """Every name under ``out_dir`` matching ``fmt``, classified, oldest training position first."""
    matcher = fmt if isinstance(fmt, FilenameFormat) else FilenameFormat(fmt)
    fs, root = filesystem(out_dir, storage_options)
    level: list[tuple[str, str, dict[str, str]]] = [("", root, {})]  # (relative name, fs path, values)
    found: list[tuple[str, str, dict[str, str], bool]] = []
    for depth in range(matcher.depth):
        last = depth == matcher.depth - 1
        below = []
        for rel, path, values in level:
            for info in _ls(fs, path):
                base = posixpath.basename(info["name"].rstrip("/"))
                is_dir = info.get("type") == "directory"
                matched = matcher.match_component(depth, base)
                if matched is None and last and matcher.fixed and base.endswith(SIDE_SUFFIX):
                    matched = matcher.match_component(depth, base[:-len(SIDE_SUFFIX)])
                if matched is None or (not last and not is_dir):
                    continue
                entry = (f"{rel}/{base}" if rel else base, f"{path}/{base}", {**matched, **values})
                if last:
                    found.append((*entry, is_dir))
                else:
                    below.append(entry)
        level = below
    candidates = [_classify(fs, out_dir, rel, path, values, is_dir, storage_options)
                  for rel, path, values, is_dir in found]
    return sorted(candidates, key=Candidate.sort_key)


def _classify(fs: fsspec.AbstractFileSystem, out_dir: str, rel: str, path: str, values: dict[str, str],
              is_dir: bool, storage_options: dict[str, Any] | None) -> Candidate:
    url = join(str(out_dir), rel)
    iteration, epoch_detail = _filename_position(values)
    if not is_dir:
        problem = _file_problem(fs, path)
        if problem is not None:
            return Candidate(rel, url, "damaged", iteration, epoch_detail, problem=problem)
        stored = _peek_iteration(fs, path)
        return Candidate(rel, url, "file", stored if stored is not None else iteration, epoch_detail)
    if not fs.exists(f"{path}/{MANIFEST_NAME}"):
        return Candidate(rel, url, "incomplete", iteration, epoch_detail,
                         problem=f"it has no {MANIFEST_NAME} (still being written, or its save crashed)",
                         busy=_take_in_progress(fs, path))
    snapshot = Snapshot(url, pg=LOCAL, storage_options=storage_options)
    try:
        snapshot.verify(deep=False)
        metadata = snapshot.metadata
    except Exception as e:  # noqa: BLE001 - any failure to read it makes it unusable
        return Candidate(rel, url, "damaged", iteration, epoch_detail, problem=f"{type(e).__name__}: {e}")
    if not isinstance(metadata, dict):
        return Candidate(rel, url, "damaged", iteration, epoch_detail,
                         problem=f"its manifest's metadata is a {type(metadata).__name__}, not an object")
    if isinstance(metadata.get("iteration"), int):
        iteration = metadata["iteration"]
    if isinstance(metadata.get("epoch_detail"), (int, float)):
        epoch_detail = float(metadata["epoch_detail"])
    return Candidate(rel, url, "snapshot", iteration, epoch_detail)


#: How a ``torch.save`` file begins: a zip archive (the default), or a pickle (the legacy format).
_FILE_MAGIC = (b"PK\x03\x04", b"\x80")


def _file_problem(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    """Why the file at ``path`` is not a ``torch.save`` file (the quick check: its first bytes), or None."""
    try:
        with fs.open(path, "rb") as f:
            head = f.read(4)
    except Exception as e:  # noqa: BLE001 - unreadable: not a usable snapshot
        return f"cannot be read: {type(e).__name__}: {e}"
    if not head:
        return "it is an empty file"
    if not head.startswith(_FILE_MAGIC):
        return "it is neither a directory with a manifest nor a torch.save file"
    return None


def _take_in_progress(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """Whether ``path`` holds the published parts of a take that has not been aborted."""
    names = [posixpath.basename(i["name"]) for i in _ls(fs, f"{path}/{PARTS_DIR}")]
    aborted = {n[: -len(".abort")] for n in names if n.endswith(".abort")}
    return any(n.endswith(".json") and n.split(".", 1)[0] not in aborted for n in names)


class _Stub:
    """Stands for any object a pickle refers to, so a pickle can be read without running its code."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _PeekUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return _Stub

    def persistent_load(self, pid: Any) -> Any:
        return None


def _peek_iteration(fs: fsspec.AbstractFileSystem, path: str) -> int | None:
    """``_start_iteration`` of a ``torch.save``'d manager state, reading only its small pickle record.

    No code from the file runs and no tensor data is read. None for other
    targets, the legacy (non-zip) format or an unreadable file.
    """
    try:
        with fs.open(path, "rb") as f, zipfile.ZipFile(f) as archive:
            records = [n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            if not records:
                return None
            state = _PeekUnpickler(io.BytesIO(archive.read(min(records, key=len)))).load()
    except Exception:  # noqa: BLE001 - the position then comes from the file name
        return None
    value = state.get("_start_iteration") if isinstance(state, dict) else None
    return value if type(value) is int else None


def select_prunable(candidates: list[Candidate], n_retains: int,
                    rejected: Collection[str] = ()) -> list[Candidate]:
    """What retention removes from ``candidates`` (oldest first, as :func:`list_snapshots` gives them).

    Keeps the ``n_retains`` newest complete snapshots; removes older complete
    ones, and incomplete or damaged ones known to be older than the newest
    complete one whose directory holds no take in progress. Never the newest
    complete one, nor anything newer (a save may be writing it). Names in
    ``rejected`` (those autoload could not restore, though they pass the
    quick check) count as damaged: they are never kept in place of a good one.
    """
    complete = [c for c in candidates if c.complete and c.name not in rejected]
    if n_retains <= 0 or not complete:
        return []
    newest = complete[-1]
    stale = set(id(c) for c in complete[:-n_retains])
    for c in candidates:
        if c not in complete and not c.busy and c.is_older_than(newest):
            stale.add(id(c))
    return [c for c in candidates if id(c) in stale]


def remove(candidate: Candidate, storage_options: dict[str, Any] | None = None) -> None:
    """Delete one snapshot; an engine snapshot loses its manifest first, so it is never seen half-removed."""
    fs, path = filesystem(candidate.url, storage_options)
    if candidate.kind == "file" or fs.isfile(path):  # a damaged one may be a file too
        fs.rm_file(path)
        return
    try:
        fs.rm_file(f"{path}/{MANIFEST_NAME}")
    except FileNotFoundError:
        pass
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass


def prune(out_dir: str, fmt: str | FilenameFormat, n_retains: int,
          storage_options: dict[str, Any] | None = None, *, rejected: Collection[str] = ()) -> list[str]:
    """Apply retention to ``out_dir``: see :func:`select_prunable`. Returns the removed locations."""
    removed = []
    for c in select_prunable(list_snapshots(out_dir, fmt, storage_options), n_retains, rejected):
        remove(c, storage_options)
        logger.info("ppe_snapshot: removed %s: %s (keeping the %d newest)", c.describe(), c.kind, n_retains)
        removed.append(c.url)
    return removed
