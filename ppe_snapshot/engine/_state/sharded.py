"""Tensors split over ranks (DTensor of any placement, FSDP2 ``fully_shard``, ShardedTensor): the take side.

Take: ``flatten`` turns such a tensor into a :class:`ShardedPayload` (this
rank's local shards with their global offsets, computed by
``torch.distributed.checkpoint``'s own helpers). The planner writes each
shard once: ranks holding identical copies (``Replicate`` mesh dims) agree,
without communication, on which of them writes it, spreading the choice over
tensors. Each rank's part lists the shards it wrote; ``merge_sharded`` joins
them into one :class:`ShardedTensorEntry` per tensor, in the manifest's
``sharded`` section, which every rank of any world size sees.

Restore: see :mod:`~ppe_snapshot.engine._restore.loading` (``load_sharded``).
"""
from __future__ import annotations

import math
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from ppe_snapshot.engine._format import PLAIN_TENSOR_TYPES, Chunk, Shard, ShardedTensorEntry, dtype_name
from ppe_snapshot.errors import SnapshotError, UnsupportedValueError

#: Separates a sharded tensor's path from a shard's number in a rank's file layout; ``%``
#: followed by ``#`` never occurs in a logical path (``%`` is always escaped as ``%25``).
_SHARD_MARK = "%#"


def _loaded_class(module: str, name: str) -> type | None:
    """A class of an optional torch.distributed module, only if something already imported it
    (a value of that class cannot exist otherwise, and the imports are slow)."""
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def dtensor_class() -> type | None:
    return _loaded_class("torch.distributed.tensor", "DTensor")


def sharded_tensor_class() -> type | None:
    return _loaded_class("torch.distributed._shard.sharded_tensor", "ShardedTensor")


def is_sharded(value: Any) -> bool:
    """Whether ``value`` is a DTensor or a ShardedTensor."""
    if type(value) in PLAIN_TENSOR_TYPES:  # the common case, asked once per tensor of the state
        return False
    classes = tuple(c for c in (dtensor_class(), sharded_tensor_class()) if c is not None)
    return bool(classes) and isinstance(value, classes)


# -- take ---------------------------------------------------------------------

@dataclass
class LocalShard:
    """A block of the global tensor held by this rank."""
    offsets: list[int]
    tensor: torch.Tensor


@dataclass
class ShardedPayload:
    """A sharded tensor as this rank holds it (a flatten item).

    Ranks holding the same block form a replica group of ``group_size``;
    ``replica`` is this rank's place in it and ``block`` numbers the block
    among the groups. ``replicated`` is always true: the entry is seen by
    every rank at restore, so containers above it are too.
    """
    dtype: str
    shape: list[int]
    shards: list[LocalShard]
    replica: int = 0
    group_size: int = 1
    block: int = 0
    replicated: bool = True

    def written(self, path: str, dedupe: bool) -> list[LocalShard]:
        """The shards this rank writes: all of them, or with ``dedupe`` only where it is
        its replica group's writer (chosen per path and block, so writes spread over ranks)."""
        if dedupe and (zlib.crc32(path.encode()) + self.block) % self.group_size != self.replica:
            return []
        return [s for s in self.shards if s.tensor.numel()]


def _linear(coordinate: list[int], sizes: list[int]) -> int:
    index = 0
    for c, n in zip(coordinate, sizes):
        index = index * n + c
    return index


def _dtensor_payload(path: str, value: Any) -> ShardedPayload:
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_list
    from torch.distributed.tensor import Replicate, Shard as ShardPlacement
    from torch.distributed.tensor.placement_types import _StridedShard

    for placement in value.placements:
        if isinstance(placement, _StridedShard) or not isinstance(placement, (ShardPlacement, Replicate)):
            raise UnsupportedValueError(
                f"{path}: DTensor placement {placement!r} is not supported (only Shard(dim) and Replicate); "
                "redistribute it first, e.g. value.redistribute(placements=[Replicate()] * mesh.ndim)")
    payload = ShardedPayload(_dtype(path, value), list(value.shape), [])
    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the DTensor's mesh: it holds nothing
        return payload
    (chunk,) = _create_chunk_list(value)
    local = value.to_local().detach()
    payload.shards.append(LocalShard(list(chunk.offsets), local))
    shape = list(mesh.shape)
    replicate = [d for d, p in enumerate(value.placements) if isinstance(p, Replicate)]
    shard = [d for d in range(mesh.ndim) if d not in replicate]
    payload.group_size = math.prod(shape[d] for d in replicate)
    payload.replica = _linear([coordinate[d] for d in replicate], [shape[d] for d in replicate])
    payload.block = _linear([coordinate[d] for d in shard], [shape[d] for d in shard])
    return payload


def _dtype(path: str, value: Any) -> str:
    try:
        return dtype_name(value.dtype)
    except UnsupportedValueError as e:
        raise UnsupportedValueError(f"{path}: {e}") from None


def sharded_payload(path: str, value: Any) -> ShardedPayload:
    """The flatten item of a DTensor or ShardedTensor (see :func:`is_sharded`)."""
    dtensor = dtensor_class()
    if dtensor is not None and isinstance(value, dtensor):
        return _dtensor_payload(path, value)
    shards = [LocalShard(list(s.metadata.shard_offsets), s.tensor.detach()) for s in value.local_shards()]
    return ShardedPayload(_dtype(path, value), list(value.size()), shards)


def sharded_state_patterns(items: dict[str, Any]) -> list[str]:
    """Replicated-globs for app state entries that hold sharded tensors.

    Like ``torch.distributed.checkpoint``, such state (an FSDP2 module, its
    optimizer) is taken to be SPMD: its other values (``step``, hyper-
    parameters) are the same on every rank, so they are written once and
    every rank, of any world size, restores them. Keep per-rank values under
    another app state key.
    """
    if ShardedPayload not in set(map(type, items.values())):  # most states, without a Python loop
        return []
    keys = {path.split("/", 1)[0] for path, item in items.items() if isinstance(item, ShardedPayload)}
    return [p for key in sorted(keys) for p in (key, f"{key}/*")]


def shard_key(path: str, index: int) -> str:
    """The name of a shard in a rank's file layout."""
    return f"{path}{_SHARD_MARK}{index}"


def is_shard_key(name: str) -> bool:
    return _SHARD_MARK in name


@dataclass
class ShardPlan:
    """The shards of one tensor that a rank writes, by their file layout names."""
    dtype: str
    shape: list[int]
    shards: list[tuple[list[int], list[int], str]] = field(default_factory=list)  # offsets, sizes, name


def plan_sharded(path: str, item: ShardedPayload, dedupe: bool) -> tuple[ShardPlan, list[tuple[str, torch.Tensor]]]:
    """What this rank writes of ``item``: its plan and the tensors to lay out, by name."""
    plan, tensors = ShardPlan(item.dtype, item.shape), []
    for i, shard in enumerate(item.written(path, dedupe)):
        name = shard_key(path, i)
        plan.shards.append((shard.offsets, list(shard.tensor.shape), name))
        tensors.append((name, shard.tensor))
    return plan, tensors


def sharded_entries(plans: dict[str, ShardPlan], chunks: dict[str, list[Chunk]]) -> dict[str, ShardedTensorEntry]:
    """A rank's part: its shards of every sharded tensor (none for a rank that wrote none)."""
    return {path: ShardedTensorEntry(plan.dtype, plan.shape,
                                     [Shard(offsets, sizes, chunks[name]) for offsets, sizes, name in plan.shards])
            for path, plan in plans.items()}


def merge_sharded(parts: list[dict[str, ShardedTensorEntry]]) -> dict[str, ShardedTensorEntry]:
    """Every rank's shards of each tensor in one entry; raises unless they tile the tensor exactly."""
    merged: dict[str, ShardedTensorEntry] = {}
    for rank, part in enumerate(parts):
        for path, entry in part.items():
            first = merged.setdefault(path, ShardedTensorEntry(entry.dtype, entry.shape, []))
            if (first.dtype, first.shape) != (entry.dtype, entry.shape):
                raise SnapshotError(
                    f"{path}: ranks disagree on the sharded tensor: rank {rank} has global shape {entry.shape} "
                    f"and dtype {entry.dtype}, another rank global shape {first.shape} and dtype {first.dtype}")
            first.shards.extend(entry.shards)
    for path, entry in merged.items():
        # A block written by two ranks (copies of one DTensor on separate meshes) is kept once.
        unique = {(tuple(s.offsets), tuple(s.sizes)): s for s in reversed(entry.shards)}
        entry.shards[:] = [unique[key] for key in sorted(unique)]
        covered, total = sum(math.prod(s.sizes) for s in entry.shards), math.prod(entry.shape)
        if covered != total:
            raise SnapshotError(
                f"{path}: the shards written cover {covered} of the {total} elements of the sharded tensor; "
                "take the snapshot on every rank of its device mesh (pg=None or a group holding all of them)")
    return merged
