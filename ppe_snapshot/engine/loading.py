"""Reading payloads back: straight into the target's memory, checksum-verified."""
from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch
import xxhash

from ppe_snapshot.engine.flatten import check_tensor_target
from ppe_snapshot.engine.manifest import Chunk, Entry, Manifest, PickleEntry, ShardedTensorEntry, TensorEntry
from ppe_snapshot.engine.packing import CHUNK_BYTES, checksum, is_direct, tensor_bytes
from ppe_snapshot.engine.serialization import torch_dtype
from ppe_snapshot.errors import CorruptSnapshotError
from ppe_snapshot.storage import Storage

# Smallest host buffer used when a read must go through one (device or dtype change).
ALIGN_STEP = 1 << 16


def _read(storage: Storage, chunk: Chunk, offset: int, out: memoryview) -> None:
    try:
        storage.read_into(chunk.file, chunk.offset + offset, out)
    except (EOFError, FileNotFoundError) as e:
        raise CorruptSnapshotError(f"data file {chunk.file} of {storage.url} is missing or truncated: {e}") from e


def _mismatch(storage: Storage, chunk: Chunk, what: str) -> CorruptSnapshotError:
    return CorruptSnapshotError(
        f"checksum mismatch in {storage.url}/{chunk.file} at bytes {chunk.offset}..{chunk.offset + chunk.nbytes} "
        f"({what}): the snapshot is damaged")


def read_into(storage: Storage, chunks: list[Chunk], out: memoryview, what: str) -> None:
    """Fill ``out`` with the chunks' bytes, verifying each chunk."""
    position = 0
    for chunk in chunks:
        view = out[position:position + chunk.nbytes]
        _read(storage, chunk, 0, view)
        if checksum(view) != chunk.checksum:
            raise _mismatch(storage, chunk, what)
        position += chunk.nbytes


def read_into_device(storage: Storage, chunks: list[Chunk], flat: torch.Tensor, what: str,
                     budget: int | None) -> None:
    """Fill the contiguous byte tensor ``flat`` (any device) through a host buffer of at most ``budget`` bytes."""
    step = max(ALIGN_STEP, min(budget or CHUNK_BYTES, CHUNK_BYTES))
    bounce = torch.empty(min(step, flat.numel()), dtype=torch.uint8,
                         pin_memory=flat.device.type == "cuda")
    position = 0
    for chunk in chunks:
        digest = xxhash.xxh3_64()
        for start in range(0, chunk.nbytes, step):
            n = min(step, chunk.nbytes - start)
            view = tensor_bytes(bounce[:n])
            _read(storage, chunk, start, view)
            digest.update(view)
            flat[position + start:position + start + n].copy_(bounce[:n])
        if digest.hexdigest() != chunk.checksum:
            raise _mismatch(storage, chunk, what)
        position += chunk.nbytes



def load_tensor(storage: Storage, path: str, entry: TensorEntry, target: Any,
                budget: int | None = None) -> Any:
    """The saved tensor or array at ``path``, loaded into ``target`` in place when it fits."""
    if entry.kind == "ndarray":
        return _load_array(storage, path, entry, target)
    if isinstance(target, torch.Tensor):
        check_tensor_target(path, entry, target)
    else:
        target = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
    if is_direct(target):
        read_into(storage, entry.chunks, tensor_bytes(target), path)
    elif target.is_contiguous():
        flat = target.detach().reshape(-1).view(torch.uint8)
        read_into_device(storage, entry.chunks, flat, path, budget)
    else:
        staged = torch.empty(entry.shape, dtype=target.dtype)
        read_into(storage, entry.chunks, tensor_bytes(staged), path)
        with torch.no_grad():
            target.copy_(staged)
    return target


def _load_array(storage: Storage, path: str, entry: TensorEntry, target: Any) -> np.ndarray:
    dtype = np.dtype(entry.dtype)
    fits = (isinstance(target, np.ndarray) and target.dtype == dtype and list(target.shape) == entry.shape
            and target.flags.c_contiguous and target.flags.writeable)
    out = target if fits else np.empty(entry.shape, dtype=dtype)
    read_into(storage, entry.chunks, memoryview(out.reshape(-1).view(np.uint8)), path)
    return out


def load_pickle(storage: Storage, path: str, entry: PickleEntry) -> Any:
    data = bytearray(sum(c.nbytes for c in entry.chunks))
    read_into(storage, entry.chunks, memoryview(data), path)
    return pickle.loads(data)


def verify_chunks(storage: Storage, manifest: Manifest, budget: int = CHUNK_BYTES) -> None:
    """Read every chunk of every entry through one buffer and check its checksum."""
    buffer = bytearray(budget)
    for rank in range(manifest.world_size):
        for path, entry in manifest.paths_for(rank).items():
            for chunk in _chunks_of(entry):
                digest = xxhash.xxh3_64()
                for start in range(0, chunk.nbytes, budget):
                    view = memoryview(buffer)[: min(budget, chunk.nbytes - start)]
                    _read(storage, chunk, start, view)
                    digest.update(view)
                if digest.hexdigest() != chunk.checksum:
                    raise _mismatch(storage, chunk, path)


def _chunks_of(entry: Entry) -> list[Chunk]:
    if isinstance(entry, ShardedTensorEntry):
        return [c for shard in entry.shards for c in shard.chunks]
    return list(getattr(entry, "chunks", []))
