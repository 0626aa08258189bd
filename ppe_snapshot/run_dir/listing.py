"""List the snapshots written under one output directory, classified and ordered.

The snapshot extension names its snapshots with a format string
(``"snapshot_iter_{.iteration}"``). Here that format becomes a matcher, the
output directory (a local path or an fsspec URL) is listed for names it
matches (:mod:`.names`), and each match is classified:

``snapshot``    an engine snapshot (a directory) whose manifest parses and whose data files have their sizes
``file``        a single-file snapshot written with a ``savefun`` (ppe's ``torch.save`` format)
``rank files``  a directory of ppe's SHARDED layout with a ``savefun``: a ``torch.save`` file per rank (``0``,
                ``1``, ...) and the mark ``complete`` (:data:`ppe_snapshot.stored_snapshot.RANK_FILES_MARK`)
``incomplete``  a directory without manifest: a save in progress (``busy``), the leftover of a crashed one whose
                writers are provably gone (``abandoned``: see :func:`ppe_snapshot.engine.judge_writers`), or
                either (where that cannot be known here: another host, no writer recorded)
``damaged``     a directory whose manifest or data files are broken, or a file that is not a torch.save file
``retired``     a directory whose manifest retention removed while incremental snapshots beside it still read
                its data files (kept until none does; never restored)

Snapshots are ordered by the training position recorded in them (the
iteration, then the epoch detail) and never by modification time. For a
format without fields, the snapshot being written beside the name to
replace it (its side name, :func:`ppe_snapshot.stored_snapshot.side_name`) is listed too: a crash may have
left the newest complete snapshot there.

An engine snapshot is checked once (:func:`ppe_snapshot.stored_snapshot.inspect`); listed for autoload, the
newest one's candidate carries the opened snapshot, manifest read, to restore from without reading it again.
"""
from __future__ import annotations

import dataclasses
import itertools
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ppe_snapshot.engine import MANIFEST_NAME, PARTS_DIR, RETIRED_NAME, Snapshot, judge_writers
from ppe_snapshot.run_dir.names import FilenameFormat, position_in_name
from ppe_snapshot.run_dir.single_files import file_problem, recorded_iteration
from ppe_snapshot.storage import Tree, join, open_tree, url_to_fs
from ppe_snapshot.stored_snapshot import RANK_FILES_MARK, inspect, rank_file, replaced_name

class CandidateKind:
    """``Candidate.kind``: what a name under the output directory holds (see the module's docstring)."""
    SNAPSHOT = "snapshot"
    FILE = "file"
    RANK_FILES = "rank files"
    INCOMPLETE = "incomplete"
    DAMAGED = "damaged"
    RETIRED = "retired"

#: The kinds autoload can restore and retention keeps.
COMPLETE_KINDS = (CandidateKind.SNAPSHOT, CandidateKind.FILE, CandidateKind.RANK_FILES)


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
    #: An incomplete one: its writers are provably gone (no save will finish it), see ``writers``.
    abandoned: bool = False
    #: An incomplete one: what its writer records say, in words ("being written by pid ...", "its writer is
    #: gone ...", "unknown: ...").
    writers: str | None = None
    #: Values recorded when it was taken (metadata ``ppe_snapshot_metrics``), e.g. ``{"val/loss": 0.25}``.
    metrics: Mapping[str, float] = field(default_factory=dict, compare=False, hash=False)
    #: An engine snapshot's metadata, as the quick check read it.
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
    #: The newest engine snapshot's, when listed with ``keep_newest_open``: the snapshot its quick check opened
    #: (its manifest read), in the process that listed it; None otherwise (a candidate sent to another rank
    #: leaves it behind).
    snapshot: Snapshot | None = field(default=None, compare=False, hash=False, repr=False)
    #: An incremental snapshot's: the names of the snapshots it reads data files of, relative to ``out_dir``.
    references: tuple[str, ...] = field(default=(), compare=False, hash=False)
    #: The iteration its name holds (``iteration`` is what it records, where it records one), for a complete one.
    named_iteration: int | None = field(default=None, compare=False, hash=False)
    #: Rank files': how many ranks' files it holds (ranks 0 to ``ranks - 1``).
    ranks: int = 0

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "snapshot"}

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


def filesystem(out_dir: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec file system of ``out_dir`` and its root path there."""
    fs, root = url_to_fs(out_dir, storage_options)
    return fs, root.rstrip("/")


def list_snapshots(out_dir: str, fmt: str | FilenameFormat, storage_options: dict[str, Any] | None = None, *,
                   keep_newest_open: bool = False) -> list[Candidate]:
    """Every name under ``out_dir`` matching ``fmt``, classified, oldest training position first.

    ``keep_newest_open``: the newest engine snapshot's candidate keeps the snapshot its check opened (autoload
    restores from it without reading its manifest again); every other candidate lets its own go as soon as a
    newer one is found, so that a run directory of many large manifests is never held in memory at once."""
    tree = open_tree(out_dir, storage_options)
    candidates = []
    newest: int | None = None  # the position in candidates of the newest one holding its opened snapshot
    for rel, path, values, is_dir in _matching(tree, fmt):
        candidate = _classify(tree, out_dir, rel, path, values, is_dir, storage_options)
        if candidate.snapshot is not None:
            if keep_newest_open and (newest is None or candidates[newest].sort_key() < candidate.sort_key()):
                if newest is not None:
                    candidates[newest] = dataclasses.replace(candidates[newest], snapshot=None)
                newest = len(candidates)
            else:
                candidate = dataclasses.replace(candidate, snapshot=None)
        candidates.append(candidate)
    return sorted(candidates, key=Candidate.sort_key)


def _matching(tree: Tree, fmt: str | FilenameFormat) -> list[tuple[str, str, dict[str, str], bool]]:
    """Every name under ``tree`` matching ``fmt``: (name relative to the root, path, its field values, whether it
    is a directory)."""
    matcher = fmt if isinstance(fmt, FilenameFormat) else FilenameFormat(fmt)
    level: list[tuple[str, str, dict[str, str]]] = [("", tree.root, {})]  # (relative name, fs path, values)
    found: list[tuple[str, str, dict[str, str], bool]] = []
    for depth in range(matcher.depth):
        last = depth == matcher.depth - 1
        below = []
        for rel, path, values in level:
            for info in tree.list(path):
                base = posixpath.basename(info["name"].rstrip("/"))
                is_dir = info.get("type") == "directory"
                matched = matcher.match_component(depth, base)
                replaces = replaced_name(base) if matched is None and last and matcher.fixed else None
                if replaces is not None:
                    matched = matcher.match_component(depth, replaces)
                if matched is None or (not last and not is_dir):
                    continue
                entry = (f"{rel}/{base}" if rel else base, f"{path}/{base}", {**matched, **values})
                if last:
                    found.append((*entry, is_dir))
                else:
                    below.append(entry)
        level = below
    return found


@dataclass(frozen=True)
class NamedPositions:
    """What the names under an output directory tell before any snapshot there is opened: the newest iteration a
    name holds (None: no name matches), and whether some name holds a snapshot that seems complete (a single file,
    or a directory with its manifest). Where some name holds no iteration, the names tell nothing
    (:func:`named_positions` returns None)."""
    newest: int | None
    complete: bool


def named_positions(out_dir: str, fmt: str | FilenameFormat,
                    storage_options: dict[str, Any] | None = None) -> NamedPositions | None:
    """The iterations the names of the snapshots under ``out_dir`` hold (:class:`NamedPositions`), from one listing
    and existence checks of manifests newest first, up to the first found (one, usually), no manifest read: what a
    restart from the local tier needs to know that its step is newer than every durable snapshot. None where a
    name matching ``fmt`` holds no iteration."""
    tree = open_tree(out_dir, storage_options)
    named = []
    for _, path, values, is_dir in _matching(tree, fmt):
        iteration, _ = position_in_name(values)
        if iteration is None:
            return None
        named.append((iteration, path, is_dir))
    complete = any(not is_dir or tree.exists(f"{path}/{MANIFEST_NAME}") or tree.exists(f"{path}/{RANK_FILES_MARK}")
                   for _, path, is_dir in sorted(named, key=lambda n: n[0], reverse=True))
    return NamedPositions(max((n[0] for n in named), default=None), complete)


def _classify(tree: Tree, out_dir: str, rel: str, path: str, values: dict[str, str],
              is_dir: bool, storage_options: dict[str, Any] | None) -> Candidate:
    url = join(str(out_dir), rel)
    iteration, epoch_detail = position_in_name(values)
    if not is_dir:
        problem = file_problem(tree, path)
        if problem is not None:
            return Candidate(rel, url, CandidateKind.DAMAGED, iteration, epoch_detail, problem=problem)
        stored = recorded_iteration(tree, path)
        return Candidate(rel, url, CandidateKind.FILE, stored if stored is not None else iteration, epoch_detail,
                         named_iteration=iteration)
    if not tree.exists(f"{path}/{MANIFEST_NAME}"):
        if tree.exists(f"{path}/{RETIRED_NAME}"):
            return Candidate(rel, url, CandidateKind.RETIRED, iteration, epoch_detail,
                             problem="retention removed its manifest; its data files stay while incremental "
                                     "snapshots beside it read them")
        if tree.exists(f"{path}/{RANK_FILES_MARK}"):
            return _rank_files(tree, rel, url, path, iteration, epoch_detail)
        writers = leftover(tree, path)
        return Candidate(rel, url, CandidateKind.INCOMPLETE, iteration, epoch_detail,
                         problem=f"it has no {MANIFEST_NAME} (still being written, or its save crashed): "
                                 f"{writers.detail}",
                         busy=writers.alive or (not writers.gone and writers.in_progress), abandoned=writers.gone,
                         writers=writers.detail)
    stored = inspect(url, storage_options)
    if not stored.sound:
        return Candidate(rel, url, CandidateKind.DAMAGED, iteration, epoch_detail, problem=stored.problem)
    return Candidate(rel, url, CandidateKind.SNAPSHOT,
                     iteration if stored.iteration is None else stored.iteration,
                     epoch_detail if stored.epoch_detail is None else stored.epoch_detail,
                     metrics=stored.metrics, metadata=stored.metadata, snapshot=stored.snapshot,
                     references=tuple(posixpath.join(posixpath.dirname(rel), name) for name in stored.references),
                     named_iteration=iteration)


def _rank_files(tree: Tree, rel: str, url: str, path: str, iteration: int | None,
                epoch_detail: float | None) -> Candidate:
    """A directory marked whole in ppe's SHARDED layout: sound when it holds the files of ranks 0 to n - 1 and rank
    0's is a ``torch.save`` file (the others are read by their own ranks), its position recorded there."""
    names = {posixpath.basename(i["name"].rstrip("/")) for i in tree.list(path)}
    ranks = sum(1 for _ in itertools.takewhile(lambda r: str(r) in names, itertools.count()))
    own = {str(r) for r in range(ranks)}
    strays = sorted(n for n in names if n.isascii() and n.isdigit() and n not in own)  # no int(): any length
    problem = None
    if not ranks:
        problem = f"it holds the mark {RANK_FILES_MARK!r} of ppe's per-rank files but no file of rank 0"
    elif strays:
        problem = f"its per-rank files are not those of ranks 0 to {ranks - 1} alone: {strays[:5]}"
    else:
        problem = file_problem(tree, rank_file(path, 0))
    if problem is not None:
        return Candidate(rel, url, CandidateKind.DAMAGED, iteration, epoch_detail, problem=problem)
    stored = recorded_iteration(tree, rank_file(path, 0))
    return Candidate(rel, url, CandidateKind.RANK_FILES, stored if stored is not None else iteration, epoch_detail,
                     ranks=ranks, named_iteration=iteration)


def leftover(tree: Tree, path: str) -> Any:
    """What the ``.parts/`` files of ``path`` (a directory without manifest) say: whether a take there is in
    progress and whether its writers live (see :func:`ppe_snapshot.engine.judge_writers`)."""
    names = [posixpath.basename(i["name"]) for i in tree.list(f"{path}/{PARTS_DIR}")]
    return judge_writers(names, lambda name: tree.read(f"{path}/{PARTS_DIR}/{name}"))
