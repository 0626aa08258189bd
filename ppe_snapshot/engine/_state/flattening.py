"""App state <-> flat, path-keyed entries.

``flatten`` walks a state dict and yields one item per logical path
(``"optim/state/0/exp_avg"``): containers and plain values become manifest
entries directly; tensors, numpy arrays and pickled values become
:class:`Payload` items whose bytes are written to data files. ``inflate``
rebuilds the nested structure from entries, reusing the target's existing
tensors so loads happen in place.
"""
from __future__ import annotations

import collections
import fnmatch
import operator
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from ppe_snapshot.engine._format import (
    PLAIN_TENSOR_TYPES, RAW_DTYPE_NAMES, Container, ContainerEntry, Entry, ObjectEntry, Raw, TensorEntry,
    can_store_raw, decode_value, encode_value, is_raw_array, memory_problem, raw_storage_problem, torch_dtype,
)
from ppe_snapshot.engine._state.sharded import ShardedPayload, is_sharded, sharded_payload
from ppe_snapshot.errors import CorruptSnapshotError, StateMismatchError, UnsupportedValueError


@dataclass(slots=True)
class Payload:
    """A leaf whose bytes go to a data file: ``kind`` is one of :class:`~ppe_snapshot.engine._format.Raw`."""
    kind: str
    data: Any
    replicated: bool = False

    @property
    def nbytes(self) -> int:
        if self.kind == Raw.TENSOR:
            return self.data.nbytes
        return self.data.nbytes if self.kind == Raw.NDARRAY else len(self.data)


FlatItem = ContainerEntry | ObjectEntry | Payload | ShardedPayload


def escape(key: Any) -> str:
    """The path segment of a dict key or list index (``/`` and ``%`` are percent-encoded)."""
    return str(key).replace("%", "%25").replace("/", "%2F")


def child_path(prefix: str, key: Any) -> str:
    """The logical path of a container's child (``prefix`` empty: a top-level key)."""
    return f"{prefix}/{escape(key)}" if prefix else escape(key)


def child_paths(prefix: str, keys: list[Any]) -> list[str]:
    """:func:`child_path` of every key: in one C-level pass when every key is a string that needs no escaping
    (the dicts of a model's state, thousands of keys), else key by key."""
    if prefix and set(map(type, keys)) <= {str}:
        joined = "".join(keys)
        if "%" not in joined and "/" not in joined:
            return list(map(f"{prefix}/".__add__, keys))
    return [child_path(prefix, key) for key in keys]


_PLAIN_TYPES = frozenset(PLAIN_TENSOR_TYPES)
_DTYPE, _LAYOUT, _GRAD = map(operator.attrgetter, ("dtype", "layout", "requires_grad"))
_NESTED, _META = map(operator.attrgetter, ("is_nested", "is_meta"))


class PlainTensors:
    """The plain tensors of a flattened state in columns: each would otherwise be a ``Payload(Raw.TENSOR,
    tensor)`` item, and a take of 10^5 tensors made, walked and read back one object per tensor in every step
    from here to the index file. A plain tensor is a ``torch.Tensor`` or ``Parameter`` (no subclass), detached,
    strided, not nested nor meta, of a dtype stored as raw bytes, on any device; it is never replicated."""

    #: A dict of at least this many values is checked by :meth:`add_all`; a smaller one (an optimizer's state of a
    #: parameter) value by value, which costs less for a few values than the passes and sets of ``add_all``.
    MANY = 8

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.dtypes: list[torch.dtype] = []

    def add(self, path: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        self.paths.append(path)
        self.tensors.append(tensor)
        self.dtypes.append(dtype)

    def add_all(self, paths: list[str], values: list[Any]) -> bool:
        """Take every value of a dict when all are plain tensors, checked in a few C-level passes (a loop over
        the values costs twice as long); False (nothing taken) when any is not."""
        if not values or not _PLAIN_TYPES.issuperset(map(type, values)):
            return False
        dtypes = list(map(_DTYPE, values))
        if not set(dtypes).issubset(RAW_DTYPE_NAMES) or set(map(_LAYOUT, values)) != {torch.strided} \
                or any(map(_NESTED, values)) or any(map(_META, values)):
            return False
        if any(map(_GRAD, values)):
            values = [v.detach() if v.requires_grad else v for v in values]
        self.paths += paths
        self.tensors += values
        self.dtypes += dtypes
        return True

    def move_into(self, items: dict[str, FlatItem]) -> None:
        """Every tensor into ``items`` as a flatten item (after the items: parents stay before children), none
        left here."""
        items.update(zip(self.paths, (Payload(Raw.TENSOR, tensor) for tensor in self.tensors)))
        self.paths, self.tensors, self.dtypes = [], [], []


def _is_plain(value: Any) -> bool:
    """A value that is stored inline and holds no tensor or container to flatten."""
    return not isinstance(value, (torch.Tensor, np.ndarray, dict)) and type(value) not in (list, tuple)


def _encoded_keys(path: str, value: dict[Any, Any]) -> list[Any]:
    """The tagged JSON of a dict's keys that are not all strings; a key no tag stores is refused, naming the dict."""
    keys = []
    for key in value:
        try:
            keys.append(encode_value(key))
        except UnsupportedValueError:
            raise UnsupportedValueError(
                f"{path or 'the state'}: a key of type {type(key).__module__}.{type(key).__qualname__} cannot be "
                "stored: dict keys are stored as plain values (strings, numbers, tuples of them, ...) and never "
                "pickled, even with allow_pickle=True; convert the key to one"
            ) from None
    return keys


def _flatten(path: str, value: Any, out: dict[str, FlatItem], allow_pickle: bool, plain: PlainTensors | None
             ) -> None:
    if isinstance(value, torch.Tensor):
        if is_sharded(value):
            out[path] = sharded_payload(path, value)
            return
        if can_store_raw(value):
            out[path] = Payload(Raw.TENSOR, value.detach())
            return
        problem = raw_storage_problem(value)
        if value.is_meta or not allow_pickle:
            hint = "" if value.is_meta else (
                "; pass allow_pickle=True to save it with pickle, or convert it to a dense strided tensor")
            raise UnsupportedValueError(f"{path}: the tensor {problem} and cannot be stored as raw bytes{hint}")
    elif isinstance(value, dict):
        kind = Container.ORDERED_DICT if isinstance(value, collections.OrderedDict) else Container.DICT
        # Distinct string keys make distinct paths (escaping is one-to-one); only other keys can collide ("1", 1).
        seen: dict[str, Any] | None = None if set(map(type, value)) <= {str} else {}
        out[path] = ContainerEntry(kind, keys=list(value) if seen is None else _encoded_keys(path, value))
        paths, values = child_paths(path, list(value)), list(value.values())
        if plain is not None and seen is None and len(values) >= PlainTensors.MANY and plain.add_all(paths, values):
            return
        names, strided, tensor = RAW_DTYPE_NAMES, torch.strided, Raw.TENSOR
        for child, k, v in zip(paths, value, values):
            if seen is not None:
                if child in seen:
                    raise UnsupportedValueError(
                        f"keys {seen[child]!r} and {k!r} of {path or 'the state'} map to the same path {child!r}")
                seen[child] = k
            if type(v) in PLAIN_TENSOR_TYPES and (dtype := v.dtype) in names and v.layout is strided \
                    and not v.is_nested and not v.is_meta:  # can_store_raw() inline: the short way
                v = v.detach() if v.requires_grad else v
                if plain is None:
                    out[child] = Payload(tensor, v)
                else:
                    plain.add(child, v, dtype)
                continue
            _flatten(child, v, out, allow_pickle, plain)
        return
    elif is_raw_array(value):
        out[path] = Payload(Raw.NDARRAY, value)
        return
    elif type(value) in (list, tuple) and not all(_is_plain(v) for v in value):
        out[path] = ContainerEntry(type(value).__name__, length=len(value))
        for i, v in enumerate(value):
            _flatten(child_path(path, i), v, out, allow_pickle, plain)
        return
    try:
        out[path] = ObjectEntry(encode_value(value))
        return
    except UnsupportedValueError as e:
        if not allow_pickle:
            raise UnsupportedValueError(f"{path}: {e}") from None
    try:
        out[path] = Payload(Raw.PICKLED, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as e:  # a local class, a lock, an open file, ...
        raise UnsupportedValueError(
            f"{path}: a value of type {type(value).__module__}.{type(value).__qualname__} cannot be pickled "
            f"either ({e}); convert it to tensors and plain Python values") from e


def flatten(key: str, state: Any, allow_pickle: bool = False, plain: PlainTensors | None = None
            ) -> dict[str, FlatItem]:
    """Every logical path under ``key`` with its item, parents before children; with ``plain``, the plain
    tensors found in dicts go there instead (see :class:`PlainTensors`)."""
    out: dict[str, FlatItem] = {}
    _flatten(escape(key), state, out, allow_pickle, plain)
    return out


def mark_replicated(items: dict[str, FlatItem], patterns: Iterable[str], plain: PlainTensors | None = None) -> None:
    """Mark items matching a glob (or containers whose children all are) as replicated. When any is, the
    ``plain`` tensors are moved into ``items`` first: a glob may match them, and a container's flag depends
    on all its children."""
    patterns = list(patterns)
    if not patterns and not any(item.replicated for item in items.values()):
        return  # nothing is replicated, so no container is
    if plain is not None:
        plain.move_into(items)
    children: dict[str, list[str]] = collections.defaultdict(list)
    for path in items:
        if "/" in path:
            children[path.rsplit("/", 1)[0]].append(path)
    for path in reversed(list(items)):  # children before parents
        item = items[path]
        flag = any(fnmatch.fnmatchcase(path, p) for p in patterns)
        if not flag and isinstance(item, ContainerEntry) and children[path]:
            flag = all(items[c].replicated for c in children[path])
        if flag:
            item.replicated = True


LoadLeaf = Callable[[str, Entry, Any], Any]


def _template_children(template: Any) -> Callable[[Any], Any]:
    """The template's value for a child key, or None where it has none."""
    if isinstance(template, Mapping):
        return template.get
    if isinstance(template, (list, tuple)):
        return lambda i: template[i] if isinstance(i, int) and i < len(template) else None
    return lambda _: None


#: Containers nested deeper than this in a manifest are refused as damage (before Python's stack runs out).
MAX_CONTAINER_DEPTH = 200


#: ``(path of a dict, its stored keys, the target dict) -> {key: value}`` for the children loaded at once: some of
#: the stored keys that are strings, in their stored order.
LoadChildren = Callable[[str, list[Any], Any], dict[Any, Any]]


def inflate(path: str, lookup: Callable[[str], Entry | None], load_leaf: LoadLeaf, template: Any = None,
            depth: int = 0, load_children: LoadChildren | None = None) -> Any:
    """Rebuild the value stored under ``path``; ``load_leaf`` loads tensors, arrays and pickles, and
    ``load_children`` may load some children of a dict at once (the rest go one by one)."""
    entry = lookup(path)
    if entry is None:
        raise CorruptSnapshotError(f"the manifest lists no entry for {path!r}, which its parent refers to")
    if isinstance(entry, ContainerEntry):
        if depth >= MAX_CONTAINER_DEPTH:
            raise CorruptSnapshotError(f"{path[:200]!r}...: the state is nested too deeply (containers nested "
                                       f"deeper than {MAX_CONTAINER_DEPTH} levels in the manifest)")
        child, depth = _template_children(template), depth + 1
        if entry.kind in Container.KEYED:
            ordered = entry.kind == Container.ORDERED_DICT
            loaded = load_children(path, entry.keys, template) if load_children is not None else None
            if loaded and len(loaded) == len(entry.keys):  # every child loaded at once, in order (no duplicate key)
                return collections.OrderedDict(loaded) if ordered else loaded
            out = collections.OrderedDict() if ordered else {}
            for key in entry.keys:  # a loop, not a generator: thousands of children in a model's state
                if loaded and type(key) is str and key in loaded:
                    out[key] = loaded[key]
                    continue
                key = decode_value(key)
                out[key] = inflate(child_path(path, key), lookup, load_leaf, child(key), depth, load_children)
            if len(out) != len(entry.keys):  # (a dict saved never names a key twice: one child would be lost)
                raise CorruptSnapshotError(f"the dict at {path!r} names a key twice in the manifest")
            return out
        items = [inflate(child_path(path, i), lookup, load_leaf, child(i), depth, load_children)
                 for i in range(entry.length)]
        return tuple(items) if entry.kind == Container.TUPLE else items
    if isinstance(entry, ObjectEntry):
        try:
            return decode_value(entry.value)
        except CorruptSnapshotError as e:
            raise CorruptSnapshotError(f"entry {path!r}: {e}") from None
    return load_leaf(path, entry, template)


def check_tensor_target(path: str, entry: TensorEntry, target: torch.Tensor) -> None:
    """Raise when ``target`` cannot receive the saved tensor at ``path`` in place."""
    check_target_fits(path, target, entry.shape, entry.dtype)
    if not target.is_contiguous() and any(step == 0 and n > 1 for step, n in zip(target.stride(), target.shape)):
        raise StateMismatchError(
            f"{path}: the restore target's elements share memory (a view made by expand(), or with a zero stride): "
            "a restore loads into the target's memory in place; pass a tensor of its own (e.g. its clone())")


def check_target_fits(path: str, target: torch.Tensor, shape: list[int], dtype: str, what: str = "a tensor",
                      shape_name: str = "shape") -> None:
    """Raise ``StateMismatchError`` unless ``target`` has the saved ``what``'s ``shape`` (named ``shape_name``) and
    ``dtype``, and plain strided memory to load it into (not meta, nested, sparse...)."""
    try:
        if target.shape == tuple(shape) and target.dtype is torch_dtype(dtype) and target.layout is torch.strided \
                and not target.is_meta:
            return
    except RuntimeError:  # (a nested tensor of the strided layout has no shape)
        pass
    head = f"{path}: the snapshot holds {what} of {shape_name} {list(shape)} and dtype {dtype}, but the restore target"
    problem = memory_problem(target)
    if problem is not None:
        hint = "materialize it first (e.g. with Module.to_empty(device=...))" if target.is_meta else \
            f"pass a dense tensor of that {shape_name} and dtype"
        raise StateMismatchError(f"{head} {problem}: a restore loads into the target's memory in place; {hint}")
    found = RAW_DTYPE_NAMES.get(target.dtype, str(target.dtype))  # (its memory was checked just above)
    raise StateMismatchError(f"{head} has {shape_name} {list(target.shape)} and dtype {found}")
