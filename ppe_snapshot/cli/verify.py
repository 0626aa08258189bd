"""``verify``: check snapshots, naming every damaged entry; exit 0 all good, 1 damage found, 2 not a snapshot."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from ppe_snapshot.cli.common import Kind, Source, UsageError, is_retired, open_source, progress, read_state
from ppe_snapshot.engine import read_manifest
from ppe_snapshot.engine.codec import ShardedTensorEntry, check_structure, read_into
from ppe_snapshot.errors import CorruptSnapshotError, SnapshotNotFoundError, UnsupportedFormatError
from ppe_snapshot.storage import open_storage
from ppe_snapshot.stored_snapshot import inspect


def damaged_entries(source: Source) -> list[str]:
    """Every entry of an engine snapshot whose bytes fail their checksum (or cannot be read), with why; first, where
    the manifest does not rebuild (:func:`~ppe_snapshot.engine.codec.check_structure`), why."""
    storage = open_storage(source.path, source.storage_options)
    try:
        manifest = read_manifest(storage)
        problems = []
        try:
            check_structure(manifest)  # (a container naming a child without an entry, a value that does not decode)
        except CorruptSnapshotError as e:
            problems.append(str(e))
        seen: set[Any] = set()
        work = []
        for table in manifest.tables():
            for path, entry in table.items():
                if isinstance(entry, ShardedTensorEntry):
                    chunks = [c for shard in entry.shards for c in shard.chunks]
                else:
                    chunks = list(getattr(entry, "chunks", []))
                fresh = [c for c in chunks if c not in seen]
                seen.update(fresh)
                if fresh:
                    work.append((path, fresh))
        buffer = bytearray(max((c.nbytes for _, chunks in work for c in chunks), default=0))
        with progress(sum(c.nbytes for _, chunks in work for c in chunks), f"verify {source.path}") as bar:
            for path, chunks in work:
                for chunk in chunks:
                    try:
                        read_into(storage, [chunk], memoryview(buffer)[:chunk.nbytes], path)
                    except (CorruptSnapshotError, OSError, ValueError) as e:
                        problems.append(f"{path}: {e}")
                        break
                    finally:
                        bar.update(chunk.nbytes)
        return problems
    finally:
        storage.close()


def check(path: str, storage_options: dict | None, quick: bool) -> list[str]:
    """The problems found in the snapshot at ``path`` (empty: it is good). Raises as :func:`open_source` when it
    is none."""
    source = open_source(path, storage_options, allow_in_progress=True)
    if source.kind == Kind.IN_PROGRESS:
        return ["it has no manifest.json: still being written, or its save crashed"]
    if source.is_engine:
        stored = inspect(source.path, source.storage_options)  # manifest and sizes
        if stored.problem is not None:
            return [str(stored.error) if isinstance(stored.error, (CorruptSnapshotError, OSError)) else stored.problem]
        return [] if quick else damaged_entries(source)
    if source.kind == Kind.PPE_FILE and quick:
        return []
    try:
        read_state(source)  # ppe files with weights_only=True; DCP and safetensors by their own loaders
    except Exception as e:  # noqa: BLE001 - it did not load: damaged (or holds more than plain values)
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        return [f"{type(e).__name__}: {first}"]
    return []


def cmd_verify(args: argparse.Namespace) -> int:
    damaged = unusable = 0
    for path in args.paths:
        try:
            problems = check(path, args.storage_options, args.quick)
        except (UsageError, SnapshotNotFoundError, UnsupportedFormatError) as e:
            if is_retired(path, args.storage_options):  # e.g. verify RUN/*: no snapshot, nothing wrong
                print(f"RETIRED {path}: no snapshot; its data files are checked with the snapshots that read them")
                continue
            unusable += 1
            print(f"ppe-snapshot: {e}", file=sys.stderr)
            continue
        if not problems:
            print(f"OK      {path}")
            continue
        damaged += 1
        if len(problems) == 1:
            print(f"DAMAGED {path}: {problems[0]}")
        else:
            print(f"DAMAGED {path}: {len(problems)} damaged entries")
            for problem in problems:
                print(f"  {problem}")
    if args.quick and len(args.paths) > unusable:
        print("checked: manifests and data file sizes only (--quick); without --quick every checksum is read "
              "(ppe files: loaded)")
    if unusable:
        return 2
    return 1 if damaged else 0


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("verify", parents=[common], help="check snapshots; exit 1 if any is damaged",
                       description="Check snapshots: an engine snapshot's manifest, file sizes and every checksum "
                                   "(each damaged entry is named); a ppe torch.save file by loading it with "
                                   "weights_only=True; DCP and safetensors files by loading them. An incremental "
                                   "snapshot's referenced blocks are checked too; a retired directory (data files "
                                   "kept for the snapshots that read them) is named and passed over. Exit status: 0 "
                                   "all good, 1 damage found, 2 a path is missing or not a snapshot.")
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.add_argument("--quick", action="store_true",
                   help="check manifests and file sizes only, not checksums (ppe files: the header only)")
    p.set_defaults(run_command=cmd_verify)
