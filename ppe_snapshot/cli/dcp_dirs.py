"""torch DCP checkpoints as the CLI writes and reads them, keeping what DCP's flattening loses.

DCP stores the leaves of a nested state dict under dotted keys. An empty dict leaves no key (ppe's manager state
holds some: ``extensions/_Snapshot/trigger``), and every dict key comes back as a string (an optimizer's ``state``
is keyed by ints, and ``Optimizer.load_state_dict`` silently ignores string keys). :func:`save_dcp` records both,
with the snapshot's metadata (training position), in the checkpoint's ``planner_data`` under :data:`EXTRAS_KEY`;
:func:`load_dcp` puts them back. DCP's own loaders look ``planner_data`` up by the keys they load, so a plain
``dcp.load`` of the checkpoint is unaffected.

A checkpoint is untrusted input: unless the caller allows pickle, its non-tensor values are read with
``torch.load(weights_only=True)`` (DCP's own loader unpickles them whole), and a torch DCP directory's
``.metadata`` (a pickle) by an unpickler that makes nothing but what DCP's metadata is made of.
"""
from __future__ import annotations

import dataclasses
import io
import pathlib
import pickle
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from ppe_snapshot.errors import CorruptSnapshotError, UnsupportedValueError

#: The ``planner_data`` key of what :func:`save_dcp` records beside DCP's own mappings.
EXTRAS_KEY = "__ppe_snapshot__"

Path = tuple[str | int, ...]
#: The most list slots a checkpoint's object paths may make DCP's rebuild pad out (8 bytes each), beyond one per
#: item: a dict keyed by integers (steps, ids) is rebuilt as a list as long as its highest key.
MAX_LIST_SLOTS = 1 << 24


def _children(value: Any) -> list[tuple[str | int, Any]]:
    if isinstance(value, Mapping):
        return [(str(k), v) for k, v in value.items()]
    return list(enumerate(value)) if isinstance(value, list) else []


def _skeleton(value: Any) -> Any:
    """A container holding only containers, as plain dicts (their own keys) and lists."""
    if isinstance(value, Mapping):
        return {k: _skeleton(v) for k, v in value.items()}
    return [_skeleton(v) for v in value]


def structure(state: Mapping[str, Any], leaves: list[Path]) -> dict[str, Any]:
    """What DCP does not store of ``state`` whose stored leaves are at ``leaves``: the containers holding no leaf
    (``empty``: [path, skeleton, place among its parent's keys], the outermost ones) and the dicts with keys other
    than strings (``keys``: [path, [[key as stored, key]...]], in the dict's order)."""
    stored = set(leaves)
    holding = {leaf[:i] for leaf in leaves for i in range(1, len(leaf) + 1)}
    empty: list[list[Any]] = []
    keys: list[list[Any]] = []

    def walk(value: Any, path: Path, place: int) -> None:
        if path in stored:
            return
        if path and path not in holding:
            if isinstance(value, (Mapping, list)):
                empty.append([list(path), _skeleton(value), place])
            return
        if isinstance(value, Mapping) and any(type(k) is not str for k in value):
            keys.append([list(path), [[str(k), k] for k in value]])
        for i, (key, child) in enumerate(_children(value)):
            walk(child, path + (key,), i)

    walk(state, (), 0)
    return {"empty": empty, "keys": keys}


def _value_at(state: Any, path: list[Any]) -> Any:
    for key in path:
        state = state[key] if isinstance(state, list) else next(v for k, v in state.items() if str(k) == key)
    return state


def _extend(node: list[Any], index: int) -> None:
    if index > len(node):  # what save_dcp records extends a list by one at most: a crafted record, not memory
        raise IndexError(f"index {index} beyond a list of {len(node)}")
    node.extend([None] * (index + 1 - len(node)))


def _set(state: dict[str, Any], path: list[Any], value: Any, place: int | None = None) -> None:
    """Put ``value`` at ``path``, making the dicts (string keys) and lists (int keys) on the way; a new key of a
    dict goes to ``place`` among its keys (by default last)."""
    node: Any = state
    for key, following in zip(path[:-1], path[1:]):
        if isinstance(node, list):
            _extend(node, key)
        child = node[key] if isinstance(node, list) else node.get(key)
        if child is None:
            child = node[key] = {} if isinstance(following, str) else []
        node = child
    if isinstance(node, list):
        _extend(node, path[-1])
    node[path[-1]] = value
    if isinstance(node, dict) and place is not None:
        items = [(k, v) for k, v in node.items() if k != path[-1]]
        items.insert(place, (path[-1], value))
        node.clear()
        node.update(items)


def restore_structure(state: dict[str, Any], extras: Mapping[str, Any]) -> None:
    """Put back what :func:`structure` recorded: the empty containers in their places, then the dicts' own keys
    (innermost first, so that every path is still spelled as stored when it is followed). A record that does not
    fit the state is a :class:`CorruptSnapshotError`."""
    try:
        for path, skeleton, place in extras.get("empty", ()):  # outer ones first, in order: each place is right
            _set(state, list(path), skeleton, place)
        for path, pairs in sorted(extras.get("keys", ()), key=lambda record: -len(record[0])):
            holder = _value_at(state, list(path))
            rebuilt = {key: holder[stored] for stored, key in pairs if stored in holder}
            holder.clear()
            holder.update(rebuilt)
    except (AttributeError, IndexError, KeyError, StopIteration, TypeError, ValueError) as e:
        raise CorruptSnapshotError(f"the checkpoint's record of what DCP does not keep (planner_data "
                                   f"{EXTRAS_KEY!r}) does not fit its state: {type(e).__name__}: {e}") from e


class _RecordingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that also records :func:`structure` and ``metadata`` in ``planner_data``."""

    def __init__(self, metadata: Mapping[str, Any] | None) -> None:
        super().__init__()
        self._metadata = dict(metadata or {})

    def set_up_planner(self, state_dict: Any, *args: Any, **kwargs: Any) -> None:
        original = state_dict
        super().set_up_planner(state_dict, *args, **kwargs)
        if EXTRAS_KEY in self.mappings:
            raise UnsupportedValueError(f"the state holds a value at {EXTRAS_KEY!r}, the key this converter keeps "
                                        "its records under; rename it")
        self._extras = {**structure(original, list(self.mappings.values())), "metadata": self._metadata}

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        return dataclasses.replace(plan, planner_data={**(plan.planner_data or {}), EXTRAS_KEY: self._extras})


class _RecordedLoadPlanner(_EmptyStateDictLoadPlanner):
    """DCP's planner that loads a whole checkpoint, reading non-tensor values without pickle unless allowed, and
    keeping what :class:`_RecordingSavePlanner` recorded."""

    def __init__(self, allow_pickle: bool) -> None:
        super().__init__()
        self._allow_pickle = allow_pickle
        self.extras: Mapping[str, Any] = {}

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        data = getattr(metadata, "planner_data", None)
        self.extras = data.get(EXTRAS_KEY, {}) if isinstance(data, Mapping) else {}
        _check_object_paths(metadata)
        try:
            super().set_up_planner(state_dict, metadata, is_coordinator)  # (rebuilds the state by those paths)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
            raise CorruptSnapshotError(f"the checkpoint's object paths (planner_data) do not make one state: "
                                       f"{type(e).__name__}: {e}; the checkpoint is damaged") from None

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=not self._allow_pickle)
        except pickle.UnpicklingError as e:
            raise UnsupportedValueError(
                f"the value {fqn!r} needs pickle to read, and unpickling runs code chosen by whoever wrote the "
                "checkpoint; allow pickle (--allow-pickle, allow_pickle=True) to read it if you trust it") from e
        _set(self.original_state_dict, list(self.mappings[fqn]), loaded)


def _check_object_paths(metadata: Any) -> None:
    """Raise :class:`CorruptSnapshotError` unless every item's object path in ``planner_data`` is one DCP's
    flattening gives (its parts, strings and integers, joined by ``.`` are the item's key), and the lists the
    rebuild makes of them (padded up to each integer part, a dict's integer key too) stay within
    :data:`MAX_LIST_SLOTS` slots in all, or the number of items."""
    items, data = metadata.state_dict_metadata, metadata.planner_data
    if data is None:
        return
    if not isinstance(data, Mapping):
        raise CorruptSnapshotError(f"the checkpoint's planner_data is a {type(data).__name__}, not a mapping; "
                                   "the checkpoint is damaged")
    longest: dict[tuple, int] = {}  # (each list the rebuild makes, by the path to it: its highest position)
    for fqn in items:
        path = data.get(fqn)
        if path is None:
            continue
        if not isinstance(path, (tuple, list)) or not path or not all(
                type(part) is str or (type(part) is int and part >= 0) for part in path) \
                or ".".join(map(str, path)) != fqn:
            raise CorruptSnapshotError(f"the checkpoint's planner_data maps {fqn!r:.100} to {path!r:.100}, not to "
                                       "the object path DCP's flattening gives that key; the checkpoint is damaged")
        for i, part in enumerate(path):
            if type(part) is int:
                prefix = tuple(path[:i])
                longest[prefix] = max(longest.get(prefix, 0), part + 1)
    slots = sum(longest.values())
    if slots > max(MAX_LIST_SLOTS, len(items)):
        raise CorruptSnapshotError(f"the checkpoint's planner_data places its {len(items)} items in lists of "
                                   f"{slots} slots in all, more than {MAX_LIST_SLOTS} (positions far beyond its "
                                   "items); the checkpoint is damaged")


def save_dcp(state: dict[str, Any], writer: Any, metadata: Mapping[str, Any] | None = None) -> None:
    """``dcp.save`` of ``state`` in one process through ``writer``, recording what DCP does not keep."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "torch.distributed is disabled...": one process, as meant
        dcp.save(state, storage_writer=writer, planner=_RecordingSavePlanner(metadata), no_dist=True)


def load_dcp(reader: Any, allow_pickle: bool = False) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A DCP checkpoint's whole state dict read through ``reader``, as it was saved where :func:`save_dcp` wrote
    it, and the metadata recorded then (None when none was)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    planner = _RecordedLoadPlanner(allow_pickle)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # as above
        try:
            _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
        except CheckpointException as e:
            error = failure(e)
            if type(error) is AssertionError:  # DCP's, for metadata the reader could not read: raise the reader's
                reader.read_metadata()
            raise error from None
    restore_structure(state, planner.extras)
    metadata = planner.extras.get("metadata")
    return state, (dict(metadata) if isinstance(metadata, Mapping) else None)


def failure(error: CheckpointException) -> BaseException:
    """The error a rank raised inside DCP's save or load (DCP hands it on wrapped, with its stack as text)."""
    cause: Any = next(iter(error.failures.values()), error)
    return cause[0] if isinstance(cause, tuple) else cause


#: The globals a torch DCP ``.metadata`` pickle may name, beyond DCP's metadata classes, torch's dtypes,
#: layouts and memory formats, and pathlib's paths (``_PATHS``).
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("builtins", "set"),
    ("builtins", "frozenset"),
}
#: pathlib's path classes (a checkpoint id saved as a path), by the module a pickle names them in: ``pathlib``
#: up to Python 3.12, ``pathlib._local`` from 3.13 on. Either name loads on any Python.
_PATH_MODULES = ("pathlib", "pathlib._local")
_PATHS = {kind.__name__: kind for kind in (
    pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath, pathlib.Path)}


def _metadata_global(module: str, name: str) -> bool:
    if (module, name) in _METADATA_GLOBALS:
        return True
    if module == dcp_metadata.__name__:
        found = getattr(dcp_metadata, name, None)
        return isinstance(found, type) and found.__module__ == module
    return module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                        torch.memory_format))


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _PATH_MODULES and name in _PATHS:
            return _PATHS[name]
        if not _metadata_global(module, name):
            raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP's metadata is not made of")
        return super().find_class(module, name)


class _CheckedReader(FileSystemReader):
    """torch's ``FileSystemReader``, its ``.metadata`` read once, by :class:`_MetadataUnpickler`."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        where = self._get_metadata_path()
        try:
            with self.fs.create_stream(where, "rb") as stream:
                self._metadata = _MetadataUnpickler(stream).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
            raise CorruptSnapshotError(f"{where}: not unpickled ({e}); a DCP metadata file holds nothing else. "
                                       "Allow pickle (--allow-pickle, allow_pickle=True) if you trust it") from e
        if not isinstance(self._metadata, dcp_metadata.Metadata):
            raise CorruptSnapshotError(f"{where} holds a {type(self._metadata).__name__}, not DCP's metadata")
        self._metadata.storage_meta = self._metadata.storage_meta or dcp_metadata.StorageMeta()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


def metadata_checked_reader(path: str, allow_pickle: bool) -> FileSystemReader:
    """A reader of the torch DCP directory at local ``path``; its ``.metadata`` is unpickled whole only when the
    caller allows pickle, else checked here (:class:`CorruptSnapshotError` naming what it holds)."""
    return FileSystemReader(path) if allow_pickle else _CheckedReader(path)
