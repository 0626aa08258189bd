"""The commit of a multi-rank take in format version 2: each rank writes its own index, rank 0 a summary's worth.

Every rank writes ``index/rank<r>.idx`` (its entries, the shards it wrote) once its data is durable, then
publishes a small part: its data files, the replicated entries it wrote, per sharded tensor the elements
its shards hold, and a digest of the shared state it expects (the paths of its replicated and sharded
values, and its replicated containers' keys). Rank 0 checks that every sharded tensor is covered exactly
and that every rank expects the shared state that was written (so every rank restores: a container
refers only to entries its rank sees), writes ``index/shared.idx`` and then ``manifest.json``. Nothing
rank 0 reads grows with the number of shards of other ranks: a part holds one count per sharded tensor.
"""
from __future__ import annotations

import base64
import math
from typing import Any, Iterable

import numpy as np
import xxhash

from ppe_snapshot.engine._format import (
    MANIFEST_NAME, SHARED_INDEX, ContainerEntry, Entry, decode_index, detail_name, dump_json, entries_from_json,
    entries_to_json, entry_to_json, load_json, part_name, rank_index,
)
from ppe_snapshot.engine._versions.manifest_v2 import (
    referenced_snapshots, rank_index_bytes, shared_index_bytes, top_bytes,
)
from ppe_snapshot.engine._versions.protocol import RankPart, check_sizes, gather_documents
from ppe_snapshot.errors import SnapshotError
from ppe_snapshot.storage import Storage


def shared_digest(paths: Iterable[str], containers: dict[str, Any]) -> str:
    """A digest of the shared state: the sorted paths and the keys of the replicated containers (JSON)."""
    digest = xxhash.xxh3_64()
    digest.update(dump_json(sorted(paths)))
    digest.update(dump_json(sorted(containers.items())))
    return digest.hexdigest()


def expected_shared(items: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """What this rank expects in the shared sections: the paths of its replicated and sharded items, and the
    JSON of its replicated containers."""
    paths = sorted(p for p, item in items.items() if item.replicated)
    containers = {p: entry_to_json(item) for p, item in items.items()
                  if isinstance(item, ContainerEntry) and item.replicated}
    return paths, containers


def publish(storage: Storage, take_id: str, part: RankPart, shared: tuple[list[str], dict[str, Any]]) -> None:
    """A rank's share of the commit, once its data is durable: its index, then its part. (A rank that failed
    says so through the take's rank channel and publishes nothing.)"""
    check_sizes(storage, part.files)  # here, not by rank 0: thousands of ranks check at once
    storage.put_atomic(rank_index(part.rank), rank_index_bytes(
        take_id, part.rank, part.entries, part.sharded, part.files, own_files=list(part.files)))
    table = [[path, e.dtype, e.shape] for path, e in part.sharded.items()]
    doc = {
        "rank": part.rank, "error": part.error, "files": part.files,
        "replicated": entries_to_json(part.replicated),
        "sharded_digest": xxhash.xxh3_64_hexdigest(dump_json(table)),
        # little-endian int64 in base64: decoded in one call by rank 0, where a JSON list costs per number
        "covered": base64.b64encode(np.array([sum(math.prod(s.sizes) for s in e.shards)
                                              for e in part.sharded.values()], dtype="<i8").tobytes()).decode(),
        "shared_digest": shared_digest(*shared),
    }
    # Read by rank 0 only for the first rank and where a rank differs from it: a file of its own.
    storage.put_atomic(detail_name(take_id, part.rank), dump_json({"sharded": table, "shared": shared[0]}))
    storage.put_atomic(part_name(take_id, part.rank), dump_json(doc))


def _detail(storage: Storage, take_id: str, part: dict[str, Any]) -> dict[str, Any]:
    return load_json(storage.read_bytes(detail_name(take_id, part["rank"])))


def clean_details(storage: Storage, take_id: str, world_size: int) -> None:
    for rank in range(world_size):
        storage.remove(detail_name(take_id, rank))


def _sharded_totals(storage: Storage, take_id: str, parts: list[dict[str, Any]]
                    ) -> tuple[dict[str, tuple[str, list[int]]], dict[str, int]]:
    """Every sharded tensor (dtype, shape) and the elements its shards hold over all ranks."""
    first = parts[0]
    table = _detail(storage, take_id, first)["sharded"]
    tensors = {path: (dtype, shape) for path, dtype, shape in table}
    covered = np.zeros(len(table), dtype=np.int64)  # element counts below 2**56 each: no overflow in 2**7 ranks
    exact = len(parts) < 128 or all(math.prod(shape) < 1 << 48 for _, _, shape in table)
    covered = covered if exact else covered.astype(object)
    extra: dict[str, int] = {}
    for part in parts:
        counts = np.frombuffer(base64.b64decode(part["covered"]), dtype="<i8")
        if part["sharded_digest"] == first["sharded_digest"] and len(counts) == len(table):
            covered += counts if covered.dtype != object else counts.astype(object)
            continue
        for (path, dtype, shape), count in zip(_detail(storage, take_id, part)["sharded"], counts.tolist()):
            known = tensors.setdefault(path, (dtype, shape))
            if known != (dtype, shape):
                raise SnapshotError(
                    f"{path}: ranks disagree on the sharded tensor: rank {part['rank']} has global shape {shape} "
                    f"and dtype {dtype}, another rank global shape {known[1]} and dtype {known[0]}")
            extra[path] = extra.get(path, 0) + count
    totals = {path: int(c) for (path, _, _), c in zip(table, covered.tolist())}
    for path, count in extra.items():
        totals[path] = totals.get(path, 0) + count
    return tensors, totals


def _check_coverage(storage: Storage, take_id: str, world_size: int, tensors: dict[str, tuple[str, list[int]]],
                    totals: dict[str, int], references: list[str]) -> None:
    over = []
    for path, (_, shape) in tensors.items():
        total = math.prod(shape)
        if totals.get(path, 0) < total:
            raise SnapshotError(
                f"{path}: the shards written cover {totals.get(path, 0)} of the {total} elements of the sharded "
                "tensor; take the snapshot on every rank of its device mesh (pg=None or a group holding all of them)")
        if totals[path] > total:
            over.append(path)
    if over:  # blocks written by two ranks (copies of one DTensor on separate meshes): count each block once
        blocks: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = {path: set() for path in over}
        for rank in range(world_size):
            index = decode_index(storage.read_bytes(rank_index(rank)), rank_index(rank), take_id, "rank", rank,
                                 references)
            for path in over:
                blocks[path].update((tuple(s.offsets), tuple(s.sizes)) for s in index.shards().get(path, []))
        for path in over:
            covered, total = sum(math.prod(sizes) for _, sizes in blocks[path]), math.prod(tensors[path][1])
            if covered != total:
                raise SnapshotError(f"{path}: the shards written cover {covered} of the {total} elements of the "
                                    "sharded tensor (some overlap); the ranks disagree on its sharding")


def _check_shared(storage: Storage, take_id: str, parts: list[dict[str, Any]], replicated: dict[str, Entry],
                  sharded: Iterable[str]) -> None:
    written = set(replicated) | set(sharded)
    containers = {p: entry_to_json(e) for p, e in replicated.items() if isinstance(e, ContainerEntry)}
    digest = shared_digest(written, containers)
    for part in parts:
        if part["shared_digest"] != digest:
            expects = set(_detail(storage, take_id, part)["shared"])
            missing, unexpected = sorted(expects - written), sorted(written - expects)
            detail = (f"it expects {missing[:5]!r} that no rank wrote; " if missing else "") + (
                f"it does not know {unexpected[:5]!r}; " if unexpected else "") + (
                "" if missing or unexpected else "its replicated containers hold other keys; ")
            raise SnapshotError(
                f"rank {part['rank']} would see other replicated state than was written: {detail}the ranks disagree "
                "on this state (replicated globs matching different entries on different ranks?)")


def merge_and_commit(storage: Storage, take_id: str, world_size: int, metadata: dict[str, Any],
                     timeout: float | None = None) -> None:
    """Rank 0, once every rank said its part is published: read the parts, check them and commit."""
    parts = gather_documents(storage, take_id, world_size, timeout)
    replicated: dict[str, Entry] = {}
    files: dict[str, int] = {}
    for part in parts:
        if part["replicated"]:
            replicated.update(entries_from_json(part["replicated"]))
        files.update(part["files"])
    try:
        tensors, totals = _sharded_totals(storage, take_id, parts)
        _check_coverage(storage, take_id, world_size, tensors, totals, referenced_snapshots(files))
        _check_shared(storage, take_id, parts, replicated, tensors)
        for path, entry in replicated.items():
            for chunk in getattr(entry, "chunks", []):
                if chunk.offset + chunk.nbytes > files.get(chunk.file, -1):
                    raise SnapshotError(f"entry {path!r} refers to bytes {chunk.offset}..{chunk.offset + chunk.nbytes}"
                                        f" of {chunk.file}, which the take did not write")
    except SnapshotError as e:
        raise SnapshotError(f"snapshot {storage.url} not committed, it would not restore: {e}") from None
    # every rank checked its own files' sizes before publishing its part
    storage.put_atomic(SHARED_INDEX, shared_index_bytes(take_id, replicated, tensors, files))
    storage.put_atomic(MANIFEST_NAME, top_bytes(world_size, take_id, metadata, files))

