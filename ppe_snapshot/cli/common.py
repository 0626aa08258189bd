"""What the subcommands share: user errors, storage options, what a path holds, reading it, progress bars.

Every reader here is safe on untrusted input: engine snapshots are read without unpickling unless asked,
ppe files with ``torch.load(weights_only=True)``, safetensors files hold nothing but tensors.
"""
from __future__ import annotations

import json
import pickle
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Iterator
from urllib.parse import unquote

import numpy as np
import torch

from ppe_snapshot.cli.dcp_dirs import load_dcp, metadata_checked_reader
from ppe_snapshot.dcp import DCP_KEY
from ppe_snapshot.engine import LOCAL, MANIFEST_NAME, PARTS_DIR, RETIRED_NAME, RNGState, Snapshot
from ppe_snapshot.engine.codec import escape
from ppe_snapshot.errors import SnapshotNotFoundError, UnsupportedFormatError, UnsupportedValueError
from ppe_snapshot.run_dir import load_file
from ppe_snapshot.storage import Tree, open_tree, open_url
from ppe_snapshot.stored_snapshot import RANK_FILES_MARK

#: The app state key under which the extension and the writers store a target's state dict.
STATE_KEY = "state"
#: torch.save files begin with a zip archive (the default) or a pickle (the legacy format).
TORCH_MAGIC = (b"PK\x03\x04", b"\x80")
#: The file torch's own DCP FileSystemWriter writes last.
DCP_METADATA = ".metadata"
#: Snapshots at least this large get a progress bar (on a terminal).
PROGRESS_BYTES = 64 << 20


class UsageError(Exception):
    """A user error: printed as one line on stderr, exit status 2."""


class Kind:
    """What a path holds."""
    SNAPSHOT = "snapshot"            # an engine snapshot (Snapshot.take, the extension, the writers)
    DCP_ADAPTER = "dcp-adapter"      # an engine snapshot written by dcp.save through SnapshotStorageWriter
    TORCH_DCP = "torch-dcp"          # a torch.distributed.checkpoint directory in torch's own format
    PPE_FILE = "ppe-file"            # a torch.save file (ppe's single-file snapshots)
    SAFETENSORS = "safetensors"
    PPE_RANK_FILES = "ppe-rank-files"  # ppe's SHARDED layout with a savefun: a torch.save file per rank, "complete"
    IN_PROGRESS = "in-progress"      # a snapshot directory without its manifest (being written, or crashed)
    RETIRED = "retired"              # a removed snapshot's data files, kept while incremental snapshots read them


@dataclass(frozen=True)
class Source:
    path: str
    kind: str
    storage_options: dict[str, Any] | None

    @property
    def is_engine(self) -> bool:
        return self.kind in (Kind.SNAPSHOT, Kind.DCP_ADAPTER)

    def snapshot(self, allow_pickle: bool = False) -> Snapshot:
        return Snapshot(self.path, pg=LOCAL, storage_options=self.storage_options, allow_pickle=allow_pickle)


def parse_storage_options(pairs: Iterable[str] | None, as_json: dict[str, Any] | None) -> dict[str, Any] | None:
    """``key=value`` pairs (dotted keys nest: ``client_kwargs.endpoint_url=...``; values are JSON when they
    parse as JSON, else strings), merged over the ``--storage-options`` JSON object."""
    options: dict[str, Any] = dict(as_json or {})
    for pair in pairs or ():
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option {pair!r}: expected key=value")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        node = options
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UsageError(f"--storage-option {pair!r}: {part!r} is already set to a value")
        node[last] = value
    return options or None


def _head(tree: Tree, path: str, n: int = 16) -> bytes:
    with tree.open(path, "rb") as f:
        return f.read(n)


def looks_like_safetensors(head: bytes) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then a JSON object."""
    return len(head) > 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < (100 << 20)


def classify(tree: Tree, fs_path: str) -> tuple[str | None, str | None]:
    """(kind, problem) of one path of ``tree``; kind None when it is not snapshot-like (problem says why)."""
    if tree.is_dir(fs_path):
        if tree.exists(f"{fs_path}/{MANIFEST_NAME}"):
            return Kind.SNAPSHOT, None
        if tree.exists(f"{fs_path}/{DCP_METADATA}"):
            return Kind.TORCH_DCP, None
        if tree.exists(f"{fs_path}/{RETIRED_NAME}"):
            return Kind.RETIRED, ("retention removed it; its data files stay while incremental snapshots beside it "
                                  "read them")
        if tree.exists(f"{fs_path}/{RANK_FILES_MARK}"):
            return Kind.PPE_RANK_FILES, None
        if tree.exists(f"{fs_path}/{PARTS_DIR}") or tree.exists(f"{fs_path}/data"):
            return Kind.IN_PROGRESS, f"it has no {MANIFEST_NAME} (still being written, or its save crashed)"
        if not tree.list(fs_path):
            return None, "is an empty directory, not a snapshot"
        return None, (f"is a directory without {MANIFEST_NAME} or {DCP_METADATA}: not a snapshot "
                      "(for a run directory, use 'ppe-snapshot ls')")
    head = _head(tree, fs_path)
    if not head:
        return None, "is an empty file, not a snapshot"
    if head.startswith(TORCH_MAGIC):
        return Kind.PPE_FILE, None
    if looks_like_safetensors(head):
        return Kind.SAFETENSORS, None
    return None, "is neither a snapshot directory, a torch.save file nor a safetensors file"


def is_retired(path: str, storage_options: dict[str, Any] | None) -> bool:
    """Whether ``path`` is a retired snapshot directory (its data files kept for the snapshots that read them)."""
    tree = open_tree(path, storage_options)
    try:
        return tree.is_dir(tree.root) and classify(tree, tree.root)[0] == Kind.RETIRED
    except OSError:
        return False


def open_source(path: str, storage_options: dict[str, Any] | None, *, allow_in_progress: bool = False) -> Source:
    """What ``path`` holds. Raises, naming the path and the problem, :class:`SnapshotNotFoundError` when nothing
    readable is there (nothing at all, a directory without a snapshot, an in-progress or retired one) and
    :class:`UnsupportedFormatError` for a file of no kind that is read here."""
    tree = open_tree(path, storage_options)
    if not tree.exists(tree.root):
        raise SnapshotNotFoundError(f"{path}: no such file or directory")
    kind, problem = classify(tree, tree.root)
    if kind is None and not tree.is_dir(tree.root):
        raise UnsupportedFormatError(f"{path}: {problem}")
    if kind is None or kind == Kind.RETIRED or (kind == Kind.IN_PROGRESS and not allow_in_progress):
        raise SnapshotNotFoundError(f"{path}: {problem}")
    if kind == Kind.PPE_RANK_FILES:
        raise UnsupportedFormatError(f"{path}: holds ppe's per-rank files of a SHARDED run (a torch.save file per "
                                     f"rank): give one rank's file, e.g. {path.rstrip('/')}/0")
    if kind == Kind.SNAPSHOT:
        try:
            metadata = Snapshot(path, pg=LOCAL, storage_options=storage_options).metadata
        except Exception:  # noqa: BLE001 - a damaged manifest: the reader that uses it says what is wrong
            metadata = None
        if isinstance(metadata, dict) and DCP_KEY in metadata:
            kind = Kind.DCP_ADAPTER
    return Source(path, kind, storage_options)


def size_of(tree: Tree, fs_path: str) -> int:
    try:
        return tree.size(fs_path)
    except Exception:  # noqa: BLE001 - a size is informative only
        return 0


def progress(total: int, what: str, unit: str = "B") -> Any:
    """A tqdm bar on stderr when stderr is a terminal and ``total`` is large enough, else a silent stand-in."""
    from tqdm import tqdm
    quiet = not sys.stderr.isatty() or (unit == "B" and total < PROGRESS_BYTES)
    return tqdm(total=total, desc=what, unit=unit, unit_scale=unit == "B", disable=quiet, file=sys.stderr,
                leave=False)


# -- reading a whole source -------------------------------------------------------------------------------

def top_level_keys(snap: Snapshot) -> list[str]:
    """The app state keys of rank 0 (``"state"``, ``"rng/0"`` ...; escaped as in the manifest)."""
    keys = []
    for key in snap.get_manifest():
        rank, _, rest = key.partition("/")
        if rank == "0" and "/" not in rest:
            keys.append(rest)
    return keys


def is_rng_state(value: Any) -> bool:
    """Whether ``value`` is an RNG state (``RNGState.is_state``) or a dict of them by rank, as the extension saves
    them: recognised by what was saved, not by its key."""
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        return all(RNGState.is_state(v) for v in value.values())
    return RNGState.is_state(value)


def read_app_state(source: Source, allow_pickle: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """The app state a source holds (``{app state key: value}``, as ``Snapshot.take`` was given it), and apart
    the values of it that are RNG states. A source of another kind holds the ``state`` that ``convert --to
    snapshot`` makes of it: DCP directories (torch's own or the adapter's) DCP's state dict, ppe's files and
    safetensors files what they hold."""
    if source.is_engine and source.kind != Kind.DCP_ADAPTER:
        snap = source.snapshot(allow_pickle)
        values = {unquote(k): snap.read_object(f"0/{k}") for k in top_level_keys(snap)}
        rng = {k: v for k, v in values.items() if is_rng_state(v)}
        return {k: v for k, v in values.items() if k not in rng}, rng
    return {STATE_KEY: _read_other(source, allow_pickle)}, {}


def unwrap(values: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """An app state's ``state`` alone where that is all it holds (the extension's snapshots, every other kind),
    else the whole app state; and the path it was found at (``("state",)`` or ``()``)."""
    if list(values) == [STATE_KEY] and isinstance(values[STATE_KEY], dict):
        return values[STATE_KEY], (STATE_KEY,)
    return values, ()


def read_state(source: Source, allow_pickle: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """The values of :func:`read_app_state` as :func:`unwrap` gives them, and the RNG states."""
    values, rng = read_app_state(source, allow_pickle)
    return unwrap(values)[0], rng


def _read_other(source: Source, allow_pickle: bool) -> Any:
    if source.kind in (Kind.DCP_ADAPTER, Kind.TORCH_DCP):
        return read_dcp(source, allow_pickle)[0]
    if source.kind == Kind.PPE_FILE:
        if allow_pickle:  # the user trusts the file: objects beyond tensors and plain values are unpickled
            with open_url(source.path, "rb", source.storage_options) as f:
                state = torch.load(f, map_location="cpu", weights_only=False)
        else:
            try:
                state = load_file(source.path, source.storage_options)
            except pickle.UnpicklingError as e:  # torch's message suggests weights_only=False: say what it means
                raise UnsupportedValueError(
                    f"{source.path}: holds objects beyond tensors and plain values, and unpickling them runs code "
                    "chosen by whoever wrote the file; allow pickle (--allow-pickle, allow_pickle=True) to read it "
                    "if you trust it") from e
        return state
    if source.kind == Kind.SAFETENSORS:
        return read_safetensors(source)
    raise UsageError(f"{source.path}: a {source.kind} snapshot cannot be read")


def _dcp_reader(source: Source, allow_pickle: bool) -> Any:
    if source.kind == Kind.DCP_ADAPTER:
        from ppe_snapshot.dcp import SnapshotStorageReader
        return SnapshotStorageReader(source.path, storage_options=source.storage_options, allow_pickle=allow_pickle)
    local = open_tree(source.path, source.storage_options).local_dir
    if local is None:
        raise UnsupportedFormatError(f"{source.path}: torch DCP directories are read from local paths only")
    return metadata_checked_reader(local, allow_pickle)


def read_dcp(source: Source, allow_pickle: bool = False) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A DCP checkpoint's whole state dict (DCP's own loader; non-tensor values without pickle unless allowed),
    with what ``convert`` recorded there (empty dicts, dict keys that are not strings), and the snapshot metadata
    it recorded (None when it was not written by ``convert``)."""
    return load_dcp(_dcp_reader(source, allow_pickle), allow_pickle)


def read_safetensors(source: Source) -> dict[str, Any]:
    from safetensors.torch import load as load_safetensors

    with open_url(source.path, "rb", source.storage_options) as f:
        return load_safetensors(f.read())


def _plain(value: Any) -> bool:
    """A value the engine stores inline, as one entry (its rule: nothing in it to descend into)."""
    return not isinstance(value, (torch.Tensor, np.ndarray, dict)) and type(value) not in (list, tuple)


def _leaves(value: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
    """The values of ``value`` that the engine stores as entries of their own, with their paths: dicts are
    descended, lists and tuples unless all they hold is plain values."""
    if isinstance(value, dict) and value:
        for key, item in value.items():
            yield from _leaves(item, (*path, str(key)))
    elif type(value) in (list, tuple) and value and not all(_plain(item) for item in value):
        for i, item in enumerate(value):
            yield from _leaves(item, (*path, str(i)))
    else:
        yield path, value


def key_of(*path: str) -> str:
    """The key of the value at ``path`` (app state key first) as every subcommand prints it: its manifest path,
    as ``Snapshot.read_object`` takes it (rank 0; each key escaped as in the manifest), e.g.
    ``0/state/models/main/0.weight``."""
    return "/".join(["0", *map(escape, path)])


def keyed(value: dict[str, Any], within: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every value in ``value`` that the engine stores as an entry, by :func:`key_of` its path; ``value`` is an
    app state (``{app state key: value}``), or the value at ``within`` in one."""
    return {key_of(*within, *path): item for path, item in _leaves(value, ())}


def join_keys(value: Any, within: tuple[str, ...] = (), sep: str = ".") -> dict[str, Any]:
    """Nested dicts, lists and tuples as one level, keys joined with ``sep`` (``models.main.weight``): the keys of
    the flat targets (safetensors), from the value at ``within`` in an app state. Keys that join to the same
    string (``{"a.b": x}`` and ``{"a": {"b": y}}``) raise :class:`UsageError` naming both (:func:`key_of`)."""
    flat: dict[str, Any] = {}
    paths: dict[str, tuple[str, ...]] = {}
    for path, item in _leaves(value, ()):
        key = sep.join(path)
        if key in flat:
            raise UsageError(f"{key_of(*within, *paths[key])!r} and {key_of(*within, *path)!r} both become {key!r} "
                             f"when their keys are joined with {sep!r}; this target cannot hold both (convert to a "
                             "snapshot or a torch file, or rename one)")
        flat[key], paths[key] = item, path
    return flat


def joined_names(values: dict[str, Any]) -> dict[str, str]:
    """The key (:func:`key_of`) of each entry of the app state ``values`` by the name ``convert`` gives it in a
    flat file (its path in the state :func:`unwrap` gives, joined with ``.``)."""
    state, within = unwrap(values)
    return {".".join(path): key_of(*within, *path) for path, _ in _leaves(state, ())}


def describe_value(value: Any) -> dict[str, Any]:
    """kind, dtype, shape and bytes of one loaded value."""
    if isinstance(value, torch.Tensor):
        return {"kind": "tensor", "dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                "bytes": value.numel() * value.element_size()}
    text = repr(value)
    return {"kind": "value", "type": type(value).__name__, "value": text if len(text) <= 60 else text[:57] + "..."}
