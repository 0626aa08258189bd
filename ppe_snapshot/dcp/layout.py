"""How a snapshot written through DCP lays out DCP's metadata, and which locations DCP may name.

Layout of a snapshot written through DCP (same files, checksums and commit as the engine's):

* rank ``r`` writes its items into ``data/rank<r>.bin``: payloads at 64-byte aligned
  offsets, an xxh3_64 checksum per chunk of at most 64 MiB;
* the coordinator's ``finish`` writes ``manifest.json`` last (the commit point). DCP's state
  is global, so every entry sits in ``replicated``, keyed by its DCP FQN (escaped as one
  path segment, e.g. ``"model.layer.weight"``):

  - a tensor saved as one whole chunk is a ``TensorEntry``;
  - a tensor saved as several chunks (DTensor / ShardedTensor shards) is a
    ``ShardedTensorEntry`` (global shape; shards with offsets, sizes and chunks, in DCP's order);
  - a non-tensor value (a DCP ``BYTE_IO`` item: the bytes DCP's planner serialized, by default
    a ``torch.save`` stream) is a ``BytesEntry``: opaque bytes the engine hands back as
    ``bytes`` and never unpickles. Only ``dcp.load`` deserializes them, as DCP always does;

* ``manifest.metadata["dcp"]`` holds, as JSON, what DCP needs beyond the entries:
  ``adapter_version``, DCP's metadata ``version``, the planner's ``planner_data`` (tagged JSON,
  see ``engine/_format/serialization.py``) and the ``TensorProperties`` that differ from the defaults.
"""
from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorProperties

from ppe_snapshot.engine.codec import torch_dtype
from ppe_snapshot.errors import CorruptSnapshotError
from ppe_snapshot.storage import is_known_location

#: Key of the DCP metadata in ``Manifest.metadata``.
DCP_KEY = "dcp"
#: Version of the layout described above; readers refuse newer ones.
ADAPTER_VERSION = 1


def location(checkpoint_id: str | os.PathLike) -> str:
    """The snapshot location DCP's ``checkpoint_id`` names; refuses an empty one."""
    path = os.fsdecode(os.fspath(checkpoint_id))
    if not path:
        raise ValueError("the snapshot path is empty; pass a directory path or an fsspec URL")
    return path


def valid_location(checkpoint_id: Any) -> bool:
    """A local path, or an fsspec URL (chains like ``simplecache::s3://...`` too) of a known protocol."""
    try:
        path = location(checkpoint_id)
    except (TypeError, ValueError):
        return False
    return is_known_location(path)


def _torch_name(value: Any) -> str:
    return str(value).removeprefix("torch.")


def _torch_attr(name: Any, kind: type, what: str) -> Any:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, kind):
        raise CorruptSnapshotError(f"the DCP metadata of {what} names an unknown torch {kind.__name__} {name!r}")
    return value


def properties_json(props: TensorProperties, stored_dtype: str) -> dict[str, Any]:
    """The properties that differ from what a reader assumes (the stored dtype, plain strided tensors)."""
    out: dict[str, Any] = {}
    if props.dtype != torch_dtype(stored_dtype):
        out["dtype"] = _torch_name(props.dtype)
    if props.requires_grad:
        out["requires_grad"] = True
    if props.pin_memory:
        out["pin_memory"] = True
    if props.layout != torch.strided:
        out["layout"] = _torch_name(props.layout)
    if props.memory_format != torch.contiguous_format:
        out["memory_format"] = _torch_name(props.memory_format)
    return out


def properties_from_json(data: dict[str, Any], dtype: torch.dtype, fqn: str) -> TensorProperties:
    """The inverse of :func:`properties_json` (``dtype``: the stored dtype)."""
    return TensorProperties(
        dtype=_torch_attr(data["dtype"], torch.dtype, fqn) if "dtype" in data else dtype,
        layout=_torch_attr(data.get("layout", "strided"), torch.layout, fqn),
        requires_grad=bool(data.get("requires_grad", False)),
        memory_format=_torch_attr(data.get("memory_format", "contiguous_format"), torch.memory_format, fqn),
        pin_memory=bool(data.get("pin_memory", False)),
    )
