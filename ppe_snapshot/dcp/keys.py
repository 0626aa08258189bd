"""DCP's keys over a snapshot: item keys, and the FQNs of an engine snapshot's values.

An engine snapshot's logical paths become FQNs the way DCP flattens nested
state dicts (``"optim/state/0/exp_avg"`` -> ``"optim.state.0.exp_avg"``):
dicts are always descended, lists only when they hold a tensor, a dict or
such a list, tuples never.
"""
from __future__ import annotations

import urllib.parse
from typing import NamedTuple, Sequence

from ppe_snapshot.engine.codec import (
    Container, ContainerEntry, Entry, Manifest, Raw, ShardedTensorEntry, TensorEntry, child_path, decode_value,
)
from ppe_snapshot.errors import CorruptSnapshotError

#: An item's key: its FQN, and the offsets of its chunk (None for a bytes item).
IndexKey = tuple[str, "tuple[int, ...] | None"]


def index_key(fqn: str, offsets: Sequence[int] | None) -> IndexKey:
    return fqn, None if offsets is None else tuple(offsets)


def unescape(segment: str) -> str:
    """The inverse of the engine's path-segment escape (``%`` and ``/`` percent-encoded)."""
    return urllib.parse.unquote(segment)


def is_tensor(entry: Entry | None) -> bool:
    """Whether DCP sees ``entry`` as a tensor (a tensor or sharded tensor entry; not a numpy array)."""
    return isinstance(entry, ShardedTensorEntry) or (isinstance(entry, TensorEntry) and entry.kind == Raw.TENSOR)


class Leaf(NamedTuple):
    """One DCP item of an engine snapshot: its FQN, the entry's logical path, the object path DCP rebuilds."""
    fqn: str
    path: str
    obj_path: tuple[str | int, ...]
    entry: Entry


def engine_leaves(manifest: Manifest, rank: int, where: str) -> list[Leaf]:
    """DCP's items of an engine snapshot as ``rank`` sees it, in manifest order; raises when two map to one FQN."""
    def lookup(path: str) -> Entry | None:
        return manifest.lookup(rank, path)

    def terminal(path: str, entry: ContainerEntry) -> bool:
        """DCP's rule: a list is one value unless it holds a tensor, a dict or a list that is not."""
        for i in range(entry.length):
            path_i = child_path(path, i)
            child = lookup(path_i)
            if is_tensor(child) or (isinstance(child, ContainerEntry) and (
                    child.kind in Container.KEYED or (child.kind == Container.LIST and not terminal(path_i, child)))):
                return False
        return True

    origin: dict[str, str] = {}
    leaves: list[Leaf] = []

    def visit(path: str, obj_path: tuple[str | int, ...]) -> None:
        entry = lookup(path)
        if entry is None:
            raise CorruptSnapshotError(f"{where} lists no entry for {path!r}, which its parent refers to")
        if isinstance(entry, ContainerEntry):
            if entry.kind in Container.KEYED:
                for key in (decode_value(k) for k in entry.keys):
                    visit(child_path(path, key), obj_path + (str(key),))
                return
            if entry.kind == Container.LIST and not terminal(path, entry):
                for i in range(entry.length):
                    visit(child_path(path, i), obj_path + (i,))
                return
        fqn = ".".join(map(str, obj_path))
        if fqn in origin:
            raise ValueError(f"{where}: the entries {origin[fqn]!r} and {path!r} both map to the DCP key {fqn!r}; "
                             "read this snapshot with Snapshot.restore instead")
        origin[fqn] = path
        leaves.append(Leaf(fqn, path, obj_path, entry))

    for path in manifest.paths_for(rank):
        if "/" not in path:
            visit(path, (unescape(path),))
    return leaves
