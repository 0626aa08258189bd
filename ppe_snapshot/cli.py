"""``ppe-snapshot``: look at, check and convert snapshots from the shell.

    ppe-snapshot inspect PATH            entries, sizes and metadata of one snapshot
    ppe-snapshot verify PATH [PATH ...]  check manifests, file sizes and every checksum
    ppe-snapshot convert SRC DST         a torch.save file <-> a ppe-snapshot snapshot

Nothing is unpickled unless ``convert --allow-pickle`` is given: a snapshot's pickled entries and a
torch.save file's pickled objects can run code chosen by whoever wrote them. ``inspect`` and ``verify``
never unpickle.
"""
from __future__ import annotations

import argparse
import json
import pickle
import sys
from typing import Any, Sequence

import torch

from ppe_snapshot.engine import (
    BytesEntry, Container, ContainerEntry, ObjectEntry, PickleEntry, ShardedTensorEntry, Snapshot, StateDict,
    TensorEntry,
)
from ppe_snapshot.errors import SnapshotError
from ppe_snapshot.storage import open_storage

#: The app state key under which writers store a target's state dict.
STATE_KEY = "state"


def _json(value: Any) -> str:
    try:
        return json.dumps(value)
    except RecursionError:  # parsed, but too deep for json to write back
        return "<nested too deeply to show>"


def _describe(entry: Any) -> str:
    if isinstance(entry, TensorEntry):
        return f"{entry.kind} {entry.dtype}{entry.shape} {entry.nbytes} B"
    if isinstance(entry, ShardedTensorEntry):
        return f"sharded {entry.dtype}{entry.shape} in {len(entry.shards)} shards"
    if isinstance(entry, ContainerEntry):
        size = len(entry.keys) if entry.kind in Container.KEYED else entry.length
        return f"{entry.kind} of {size}"
    if isinstance(entry, PickleEntry):
        return f"pickled {sum(c.nbytes for c in entry.chunks)} B"
    if isinstance(entry, BytesEntry):
        return f"bytes {sum(c.nbytes for c in entry.chunks)} B"
    assert isinstance(entry, ObjectEntry)
    return "value " + _json(entry.value)[:60]


def cmd_inspect(args: argparse.Namespace) -> int:
    snap = Snapshot(args.path, storage_options=args.storage_options)
    manifest = snap.get_manifest()
    print(f"snapshot {args.path}")
    print(f"metadata {_json(snap.metadata)}")
    for key, entry in manifest.items():
        print(f"  {key}: {_describe(entry)}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    failed = 0
    for path in args.paths:
        try:
            Snapshot(path, storage_options=args.storage_options).verify(deep=not args.quick)
            print(f"OK      {path}")
        except (SnapshotError, OSError) as e:
            failed += 1
            print(f"DAMAGED {path}: {e}")
        except Exception as e:  # whatever went wrong, the snapshot did not pass: report it, check the next
            failed += 1
            print(f"DAMAGED {path}: {type(e).__name__}: {e}")
    return 1 if failed else 0


def cmd_convert(args: argparse.Namespace) -> int:
    source = open_storage(args.src, args.storage_options)
    if source.exists("manifest.json"):
        snap = Snapshot(args.src, storage_options=args.storage_options, allow_pickle=args.allow_pickle)
        state = snap.read_object(f"0/{STATE_KEY}")
        torch.save(state, args.dst)
        print(f"wrote torch.save file {args.dst}")
        return 0
    with open(args.src, "rb") as f:
        try:
            state = torch.load(f, map_location="cpu", weights_only=not args.allow_pickle)
        except pickle.UnpicklingError as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            reason = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else "")
            print(f"ppe-snapshot: {args.src} holds objects beyond tensors and plain values ({reason}); reading "
                  "them runs code from the file: pass --allow-pickle if you trust it", file=sys.stderr)
            return 2
    if not isinstance(state, dict):
        raise SystemExit(f"{args.src} holds a {type(state).__name__}, not a state dict; nothing to convert")
    Snapshot.take(args.dst, {STATE_KEY: StateDict(state)}, storage_options=args.storage_options,
                  allow_pickle=args.allow_pickle)
    print(f"wrote snapshot {args.dst}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ppe-snapshot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage-options", type=json.loads, default=None, metavar="JSON",
                        help="fsspec options for URLs, as JSON (e.g. '{\"anon\": true}')")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="list the entries and metadata of a snapshot")
    p.add_argument("path")
    p.set_defaults(run=cmd_inspect)
    p = sub.add_parser("verify", help="check snapshots; exit status 1 if any is damaged")
    p.add_argument("paths", nargs="+")
    p.add_argument("--quick", action="store_true", help="check manifest and file sizes only, not checksums")
    p.set_defaults(run=cmd_verify)
    p = sub.add_parser("convert", help="torch.save file -> snapshot, or snapshot -> torch.save file")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--allow-pickle", "--unsafe-pickle", dest="allow_pickle", action="store_true",
                   help="unpickle what needs it: a snapshot's pickled entries, a torch.save file's objects "
                        "beyond tensors and plain values (runs code from SRC: only for files you trust)")
    p.set_defaults(run=cmd_convert)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except SnapshotError as e:
        print(f"ppe-snapshot: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
