"""Metadata at scale: N = 8 ... 4,096 simulated ranks of an FSDP2-sharded model, in one process (issue 14).

The model: ``--params`` parameters (default 333: with Adam's exp_avg and exp_avg_sq, ~1,000 sharded
tensors, each row-sharded over the N ranks as FSDP2's ``Shard(0)`` does) plus a replicated ``step`` tensor
per parameter and the containers above them. Every simulated rank's part goes through the engine's own
code: its shards' entries (``sharded.sharded_entries`` from a ``ShardPlan``), the owners of the replicated
tensors (``planner.assign_replicated``), what it expects of the shared state (``_versions.table.expected_shared``)
and its publication (``_versions.table.publish``: its index file and its part); rank 0's merge is
``_versions.table.merge_and_commit``, timed. A restoring rank (rank N/2) then reads the manifest and looks up every
entry it restores (``Manifest.lookup(..., own_shards=True)``), timed, counting the bytes it read. With
``--v1-up-to N`` the same parts also go through format version 1 (one JSON manifest) up to N ranks.

    python benchmarks/bench_metadata_scale.py [--ranks 8,64,512,4096] [--params 333] [--dir /path] [--v1-up-to 512]
    python benchmarks/bench_metadata_scale.py --compare 8,4096 [--rounds 9]  # parse times interleaved, same load
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import emit  # noqa: E402

from ppe_snapshot.engine._versions import protocol as commit_v1  # noqa: E402
from ppe_snapshot.engine._versions import table as versions  # noqa: E402
from ppe_snapshot.engine._state.flattening import Payload  # noqa: E402
from ppe_snapshot.engine._util.gcpause import gc_paused  # noqa: E402
from ppe_snapshot.engine._format.names import MANIFEST_NAME, Container, Raw, data_file, new_take_id  # noqa: E402
from ppe_snapshot.engine._format.manifest import Chunk, ContainerEntry, TensorEntry  # noqa: E402
from ppe_snapshot.engine import read_manifest  # noqa: E402
from ppe_snapshot.engine._state.planner import assign_replicated  # noqa: E402
from ppe_snapshot.engine._state.sharded import ShardedPayload, ShardPlan, shard_key, sharded_entries  # noqa: E402
from ppe_snapshot.storage import open_storage  # noqa: E402

ROWS, COLS = 8192, 512  # every parameter: a [ROWS, COLS] float32 matrix (sharded by rows)


def model(params: int) -> tuple[dict[str, Any], list[str]]:
    """The flattened app state every rank holds (containers, sharded tensors, replicated steps) and the
    sharded tensors' paths."""
    items: dict[str, Any] = {}
    names = [f"layers.{i}.weight" for i in range(params)]
    items["model"] = ContainerEntry(Container.DICT, keys=names, replicated=True)
    sharded = [f"model/{n}" for n in names]
    items["optim"] = ContainerEntry(Container.DICT, keys=["state"], replicated=True)
    items["optim/state"] = ContainerEntry(Container.DICT, keys=list(range(params)), replicated=True)
    for i in range(params):
        items[f"optim/state/{i}"] = ContainerEntry(Container.DICT, keys=["step", "exp_avg", "exp_avg_sq"],
                                                   replicated=True)
        items[f"optim/state/{i}/step"] = Payload(Raw.TENSOR, torch.tensor(1.0), replicated=True)
        sharded += [f"optim/state/{i}/exp_avg", f"optim/state/{i}/exp_avg_sq"]
    for path in sharded:
        items[path] = ShardedPayload("float32", [ROWS, COLS], [])
    return items, sharded


def rank_part(rank: int, world: int, take_id: str, items: dict[str, Any], sharded: list[str],
              owners: dict[str, int]) -> commit_v1.RankPart:
    """Rank ``rank``'s part, as its take builds it once its data file is written (chunks are synthetic)."""
    rows = -(-ROWS // world)
    start, stop = min(rank * rows, ROWS), min((rank + 1) * rows, ROWS)
    file, offset, chunks, plans = data_file(rank), 0, {}, {}
    for path in sharded:
        plan = ShardPlan("float32", [ROWS, COLS])
        if stop > start:
            name = shard_key(path, 0)
            plan.shards.append(([start, 0], [stop - start, COLS], name))
            nbytes = (stop - start) * COLS * 4
            chunks[name] = [Chunk(file, offset, nbytes, f"{(offset * 2654435761) % (1 << 64):016x}")]
            offset += -(-nbytes // 64) * 64
        plans[path] = plan
    part = commit_v1.RankPart(rank)
    part.sharded = sharded_entries(plans, chunks)
    for path, owner in owners.items():
        if owner == rank:
            part.replicated[path] = TensorEntry("float32", [], [Chunk(file, offset, 4, "0" * 16)], replicated=True)
            offset += 64
    if rank == 0:
        part.replicated.update({p: e for p, e in items.items() if isinstance(e, ContainerEntry)})
    part.files = {file: offset} if offset else {}
    return part


def publish_all(root: str, world: int, params: int, version: int) -> tuple[Any, str]:
    storage = open_storage(root)
    take_id = new_take_id()
    items, sharded = model(params)
    owners = assign_replicated([(p, i) for p, i in items.items() if isinstance(i, Payload)], world)
    shared = versions.expected_shared(items, world, version)
    for rank in range(world):
        part = rank_part(rank, world, take_id, items, sharded, owners)
        for name, size in part.files.items():  # the data files, at their sizes (sparse)
            os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
            with open(os.path.join(root, name), "wb") as f:
                f.truncate(size)
        versions.publish(storage, take_id, part, shared, version)
    return storage, take_id


def merge(storage: Any, take_id: str, world: int, version: int) -> float:
    start = time.perf_counter()
    versions.merge_and_commit(storage, take_id, world, {}, None, version)
    return time.perf_counter() - start


@gc_paused()  # as Snapshot.restore
def restore_metadata(root: str, world: int, sharded: list[str], paths: list[str]) -> tuple[int, float]:
    """A restoring rank's bytes read and time to read the manifest and look up everything it restores."""
    rank = world // 2
    storage = open_storage(root)
    start = time.perf_counter()
    manifest = read_manifest(storage)
    for path in paths:
        entry = manifest.lookup(rank, path, own_shards=True)
        assert entry is not None, path
    elapsed = time.perf_counter() - start
    if manifest.version == 2:  # only the shard of its own index
        own = manifest.lookup(rank, sharded[0], own_shards=True)
        assert len(own.shards) == (1 if rank * -(-ROWS // world) < ROWS else 0)
    read = os.path.getsize(os.path.join(root, MANIFEST_NAME))
    read += manifest.indexes.bytes_read if manifest.indexes is not None else 0
    return read, elapsed


def tree_bytes(root: str) -> int:
    """Metadata bytes: the manifest and the index files (the parts are gone after the commit)."""
    total = os.path.getsize(os.path.join(root, MANIFEST_NAME))
    index = os.path.join(root, "index")
    if os.path.isdir(index):
        total += sum(os.path.getsize(os.path.join(index, f)) for f in os.listdir(index))
    return total


def compare(worlds: list[int], params: int, directory: str | None, rounds: int) -> None:
    """The restoring rank's parse + lookup time for each world size, measured alternately (same machine load)."""
    items, sharded = model(params)
    roots = {}
    try:
        for world in worlds:
            roots[world] = tempfile.mkdtemp(prefix=f"ppe-meta-{world}-", dir=directory)
            storage, take_id = publish_all(roots[world], world, params, 2)
            merge(storage, take_id, world, 2)
        times: dict[int, list[float]] = {world: [] for world in worlds}
        for _ in range(rounds):
            for world in worlds:
                times[world].append(restore_metadata(roots[world], world, sharded, list(items))[1])
        for world in worlds:
            print(f"N={world}: parse + lookup median {statistics.median(times[world]) * 1e3:.1f} ms over {rounds} "
                  f"alternated runs: " + ", ".join(f"{t * 1e3:.1f}" for t in times[world]))
    finally:
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="8,64,512,4096")
    parser.add_argument("--params", type=int, default=333)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--v1-up-to", type=int, default=512)
    parser.add_argument("--report", default=None)
    parser.add_argument("--compare", default=None, help="world sizes whose parse times are measured alternately")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if args.compare:
        compare([int(n) for n in args.compare.split(",")], args.params, args.dir, args.rounds)
        return
    items, sharded = model(args.params)
    paths = list(items)
    rows = []
    for world in [int(n) for n in args.ranks.split(",")]:
        for version in (2, 1):
            if version == 1 and world > args.v1_up_to:
                continue
            root = tempfile.mkdtemp(prefix=f"ppe-meta-{world}-", dir=args.dir)
            try:
                start = time.perf_counter()
                storage, take_id = publish_all(root, world, args.params, version)
                published = time.perf_counter() - start
                merged = merge(storage, take_id, world, version)
                runs = [restore_metadata(root, world, sharded, paths) for _ in range(5)]
                read, parse = runs[0][0], statistics.median(t for _, t in runs)
                rows.append((world, version, tree_bytes(root), read, parse, merged))
                print(f"N={world} v{version}: metadata {tree_bytes(root) / 1e6:.2f} MB, restoring rank reads "
                      f"{read / 1e3:.1f} kB in {parse * 1e3:.1f} ms, merge {merged:.3f} s (ranks published in "
                      f"{published:.1f} s)", flush=True)
            finally:
                shutil.rmtree(root, ignore_errors=True)
    lines = ["### Metadata at scale (bench_metadata_scale.py)", "",
             f"`python benchmarks/bench_metadata_scale.py --ranks {args.ranks} --params {args.params}`; "
             f"{platform.node()}, {os.cpu_count()} cores; {len(sharded)} sharded tensors + {args.params} "
             "replicated steps; one take per N, the restoring rank's time a median of 5.", "",
             "| ranks | format | metadata bytes (all) | bytes a restoring rank reads | its parse + lookup time | "
             "rank 0 merge + commit |", "|---|---|---|---|---|---|"]
    for world, version, total, read, parse, merged in rows:
        lines.append(f"| {world} | v{version} | {total / 1e6:.2f} MB | {read / 1e3:.1f} kB | {parse * 1e3:.1f} ms | "
                     f"{merged:.3f} s |")
    emit("\n".join(lines), args.report)


if __name__ == "__main__":
    main()
