"""``ls`` (the snapshots of a run directory) and ``inspect`` (the entries of one snapshot)."""
from __future__ import annotations

import argparse
import datetime
import json
import posixpath
from typing import Any

from ppe_snapshot.cli.common import (
    STATE_KEY, Kind, Source, UsageError, classify, describe_value, key_of, keyed, open_source, read_app_state,
    read_state, size_of,
)
from ppe_snapshot.cli.dcp_dirs import metadata_checked_reader
from ppe_snapshot.cli.tier_listing import list_tier, print_tier
from ppe_snapshot.engine import MANIFEST_NAME, read_manifest
from ppe_snapshot.engine.codec import (
    BytesEntry, Container, ContainerEntry, ObjectEntry, PickleEntry, ShardedTensorEntry, TensorEntry,
    referenced_bytes,
)
from ppe_snapshot.retention import COMPLETE_KINDS, list_snapshots
from ppe_snapshot.run_dir import leftover
from ppe_snapshot.storage import Tree, local_path, open_storage, open_tree
from ppe_snapshot.stored_snapshot import inspect

DEFAULT_FILENAME = "snapshot_iter_{.iteration}"
#: What ``ls`` given one snapshot lists alone (anything else is taken for a run directory).
LONE_KINDS = (Kind.SNAPSHOT, Kind.TORCH_DCP, Kind.PPE_FILE, Kind.SAFETENSORS, Kind.PPE_RANK_FILES)


# -- ls ---------------------------------------------------------------------------------------------------

def _mtime(tree: Tree, path: str) -> str | None:
    try:
        info = tree.info(path)
    except Exception:  # noqa: BLE001 - the time is informative only
        return None
    stamp = info.get("mtime", info.get("LastModified", info.get("created")))
    if isinstance(stamp, (int, float)):
        stamp = datetime.datetime.fromtimestamp(stamp, datetime.timezone.utc)
    if isinstance(stamp, datetime.datetime):
        return stamp.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return None


def _utc(stamp: str | None) -> str | None:
    """An ISO 8601 time as ``YYYY-MM-DDTHH:MM:SSZ``."""
    if stamp is None:
        return None
    try:
        moment = datetime.datetime.fromisoformat(stamp)
    except ValueError:
        return None
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _manifest_of(url: str, storage_options: dict | None) -> Any:
    storage = open_storage(url, storage_options)
    try:
        return read_manifest(storage)
    finally:
        storage.close()


def _row(tree: Tree, run: str, info: dict[str, Any], storage_options: dict | None, deep: bool,
         positions: dict[str, Any]) -> dict[str, Any] | None:
    fs_path = info["name"].rstrip("/")
    name = posixpath.basename(fs_path)
    try:
        kind, problem = classify(tree, fs_path)
    except Exception as e:  # noqa: BLE001 - unreadable: shown as damaged
        kind, problem = Kind.PPE_FILE, f"{type(e).__name__}: {e}"
    if kind is None:
        return None
    url = f"{run.rstrip('/')}/{name}"
    row: dict[str, Any] = {"name": name, "kind": kind, "status": "complete", "iteration": None, "epoch": None,
                           "bytes": size_of(tree, fs_path), "referenced_bytes": 0, "references": [], "time": None,
                           "resume": False}
    candidate = positions.get(name)
    if candidate is not None:
        row["iteration"], row["epoch"] = candidate.iteration, candidate.epoch_detail
        if candidate.problem and kind != Kind.IN_PROGRESS:
            problem = candidate.problem
    if kind == Kind.IN_PROGRESS:
        row["status"] = leftover_status(tree, fs_path)
    elif kind == Kind.RETIRED:
        row["status"] = kind
    elif kind == Kind.SNAPSHOT:
        stored = inspect(url, storage_options)
        problem = stored.problem
        if stored.snapshot is not None:
            if "dcp" in stored.metadata:
                row["kind"] = Kind.DCP_ADAPTER
            if stored.iteration is not None:
                row["iteration"] = stored.iteration
            if stored.epoch is not None:
                row["epoch"] = stored.epoch
            try:
                if deep:
                    stored.snapshot.verify(deep=True)
                manifest = _manifest_of(url, storage_options)
                row["time"] = _utc(manifest.committed_at)
                row["references"] = list(manifest.references)
                row["referenced_bytes"] = referenced_bytes(manifest)
            except Exception as e:  # noqa: BLE001 - any failure to read it makes it damaged
                problem = f"{type(e).__name__}: {e}"
        row["time"] = row["time"] or _mtime(tree, f"{fs_path}/{MANIFEST_NAME}")
    elif kind == Kind.PPE_FILE and deep and problem is None:
        try:
            read_state(Source(url, kind, storage_options))
        except Exception as e:  # noqa: BLE001
            problem = f"{type(e).__name__}: {e}"
    if problem is not None and kind not in (Kind.IN_PROGRESS, Kind.RETIRED):
        row["status"] = f"damaged: {problem}"
    row["time"] = row["time"] or _mtime(tree, fs_path)
    return row


def leftover_status(tree: Tree, fs_path: str) -> str:
    """A directory without manifest: ``in-progress`` (its writer lives), ``crashed (...)`` (its writers are
    provably gone) or ``in-progress? (unknown: ...)`` (where that cannot be known here)."""
    writers = leftover(tree, fs_path)
    if writers.alive:
        return Kind.IN_PROGRESS
    if writers.gone:
        return f"crashed ({writers.detail})"
    return f"{Kind.IN_PROGRESS}? ({writers.detail})"


def list_run(run: str, storage_options: dict | None, deep: bool, filename: str) -> list[dict[str, Any]]:
    """One row per snapshot-like entry of ``run``, by training position, the one autoload resumes from marked."""
    tree = open_tree(run, storage_options)
    if not tree.exists(tree.root):
        raise UsageError(f"{run}: no such directory")
    if is_one_snapshot(tree, tree.root):  # listed alone, as ls lists a file
        parent, _, _ = run.rstrip("/").rpartition("/")
        lone = _row(tree, parent or ".", tree.info(tree.root), storage_options, deep, {})
        return [] if lone is None else [{**lone, "checked": "deep" if deep else "quick"}]
    if not tree.is_dir(tree.root):
        raise UsageError(f"{run}: not a directory (ls lists a run directory; use 'inspect' for one snapshot)")
    positions = {c.name: c for c in list_snapshots(run, filename, storage_options)}
    rows = [row for info in tree.list(tree.root)
            if (row := _row(tree, run, info, storage_options, deep, positions)) is not None]
    rows.sort(key=lambda r: (r["iteration"] is None, r["iteration"] or 0, r["epoch"] or 0, r["name"]))
    resumable = [r for r in rows if r["name"] in positions and r["status"] == "complete"
                 and positions[r["name"]].kind in COMPLETE_KINDS]
    if resumable:
        max(resumable, key=lambda r: positions[r["name"]].sort_key())["resume"] = True
    for row in rows:  # what "complete" rests on: the quick check (manifest, sizes) or every checksum
        row["checked"] = "deep" if deep else "quick"
    return rows


def is_one_snapshot(tree: Tree, fs_path: str) -> bool:
    """Whether ``fs_path`` is itself a snapshot (a committed one, a DCP directory, a file), not a run directory."""
    try:
        return classify(tree, fs_path)[0] in LONE_KINDS
    except OSError:
        return False


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def cmd_ls(args: argparse.Namespace) -> int:
    tier = list_tier(args.run) if local_path(args.run, args.storage_options) is not None else None
    if tier is not None and args.json:
        print(json.dumps(tier, indent=2))
    elif tier is not None:
        print_tier(args.run, tier, _human)
    if tier is not None:
        return 0
    rows = list_run(args.run, args.storage_options, args.deep, args.filename)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    tree = open_tree(args.run, args.storage_options)
    if is_one_snapshot(tree, tree.root):
        print(f"{args.run} is one snapshot, not a run directory: listed alone ('ppe-snapshot inspect "
              f"{args.run}' shows its entries; 'ppe-snapshot ls DIR' lists the snapshots in DIR)")
    if not rows:
        print(f"no snapshots in {args.run}")
        return 0
    table = [("", "NAME", "KIND", "ITERATION", "EPOCH", "SIZE", "REFERENCED", "TIME", "STATUS")]
    for r in rows:
        table.append(("*" if r["resume"] else "", r["name"], r["kind"],
                      "-" if r["iteration"] is None else str(r["iteration"]),
                      "-" if r["epoch"] is None else f"{r['epoch']:g}", _human(r["bytes"]),
                      _human(r["referenced_bytes"]) if r["references"] else "-", r["time"] or "-", r["status"]))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    if any(r["resume"] for r in rows):
        checked = ("every checksum checked" if args.deep else "unless a checksum fails: checked here are manifests "
                   "and data file sizes only; --deep reads every checksum")
        print(f"* autoload resumes from this one (filename {args.filename!r}; {checked})")
    return 0


# -- inspect ----------------------------------------------------------------------------------------------

def _engine_entry(key: str, entry: Any) -> dict[str, Any]:
    if isinstance(entry, TensorEntry):
        return {"key": key, "kind": entry.kind, "dtype": entry.dtype, "shape": list(entry.shape), "bytes": entry.nbytes}
    if isinstance(entry, ShardedTensorEntry):
        return {"key": key, "kind": "sharded", "dtype": entry.dtype, "shape": list(entry.shape),
                "bytes": sum(c.nbytes for s in entry.shards for c in s.chunks), "shards": len(entry.shards)}
    if isinstance(entry, ContainerEntry):
        size = len(entry.keys) if entry.kind in Container.KEYED else entry.length
        return {"key": key, "kind": entry.kind, "length": size}
    if isinstance(entry, (PickleEntry, BytesEntry)):
        kind = "pickled" if isinstance(entry, PickleEntry) else "bytes"
        return {"key": key, "kind": kind, "bytes": sum(c.nbytes for c in entry.chunks)}
    if isinstance(entry, ObjectEntry):
        text = show_json(entry.value)
        return {"key": key, "kind": "value", "value": text if len(text) <= 60 else text[:57] + "..."}
    return {"key": key, "kind": type(entry).__name__}


def _text(e: dict[str, Any]) -> str:
    kind = e["kind"]
    if "dtype" in e and "shape" in e:
        text = f"{kind} {e['dtype']}{e['shape']} {e['bytes']} B"
        return text + (f" in {e['shards']} shards" if "shards" in e else "")
    if "length" in e:
        return f"{kind} of {e['length']}"
    if kind in ("pickled", "bytes"):
        return f"{kind} {e['bytes']} B" if "bytes" in e else kind
    if kind == "value":
        return f"value {e['value']}"
    return kind


def inspect_source(source: Source) -> dict[str, Any]:
    """What ``inspect`` shows: metadata and every entry of the source."""
    metadata: Any = None
    written: dict[str, Any] = {}
    if source.is_engine:
        snap = source.snapshot()
        metadata = snap.metadata
        manifest = _manifest_of(source.path, source.storage_options)
        written = {"committed_at": manifest.committed_at, "written_by": manifest.written_by,
                   "references": list(manifest.references), "referenced_bytes": referenced_bytes(manifest)}
        entries = [_engine_entry(key, entry) for key, entry in snap.get_manifest().items()]
    elif source.kind == Kind.TORCH_DCP:
        entries = _torch_dcp_entries(source)
    elif source.kind == Kind.SAFETENSORS:
        entries = _safetensors_entries(source)
    else:
        flat = keyed(read_app_state(source)[0])
        entries = [{"key": key, **describe_value(value)} for key, value in flat.items()]
    tensors = [e for e in entries if "dtype" in e and "bytes" in e]
    return {"path": source.path, "kind": source.kind, "metadata": metadata, **written, "entries": entries,
            "tensors": len(tensors), "tensor_bytes": sum(e["bytes"] for e in tensors)}


def _torch_dcp_entries(source: Source) -> list[dict[str, Any]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    where = open_tree(source.path).local_dir or source.path
    metadata = metadata_checked_reader(where, allow_pickle=False).read_metadata()
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    entries = []
    for fqn, item in sorted(metadata.state_dict_metadata.items()):
        key = key_of(STATE_KEY, *map(str, paths.get(fqn, (fqn,))))
        if isinstance(item, TensorStorageMetadata):
            dtype = item.properties.dtype
            shape = list(item.size)
            numel = 1
            for n in shape:
                numel *= n
            entries.append({"key": key, "kind": "tensor", "dtype": str(dtype).removeprefix("torch."), "shape": shape,
                            "bytes": numel * dtype.itemsize})
        else:
            entries.append({"key": key, "kind": "bytes"})
    return sorted(entries, key=lambda e: e["key"])


def _safetensors_entries(source: Source) -> list[dict[str, Any]]:
    from ppe_snapshot.cli.common import read_safetensors
    return [{"key": key_of(STATE_KEY, name), **describe_value(value)}
            for name, value in sorted(read_safetensors(source).items())]


#: A value nested deeper is not printed (as deep as the engine's readers decode). An explicit bound: whether
#: ``json.dumps`` runs out of recursion first depends on the Python version (3.12 prints 1,000 levels, 3.11 not).
SHOW_DEPTH = 200


def show_json(value: Any) -> str:
    """``value`` as one line of JSON, or ``<nested too deeply to show>``."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth >= SHOW_DEPTH:
                return "<nested too deeply to show>"
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return json.dumps(value)


def cmd_inspect(args: argparse.Namespace) -> int:
    source = open_source(args.path, args.storage_options)
    report = inspect_source(source)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    print(f"{source.kind} {args.path}")
    if report["metadata"] is not None:
        print(f"metadata {show_json(report['metadata'])}")
    if report.get("committed_at"):
        versions = ", ".join(f"{k} {v}" for k, v in report["written_by"].items())
        print(f"committed {report['committed_at']}" + (f" by {versions}" if versions else ""))
    if report.get("references"):
        print(f"incremental: reads {_human(report['referenced_bytes'])} of data files of "
              f"{', '.join(report['references'])} (beside it; it does not restore without them)")
    for e in report["entries"]:
        print(f"  {e['key']}: {_text(e)}")
    print(f"total {len(report['entries'])} entries, {report['tensors']} tensors, {report['tensor_bytes']} B of tensors")
    return 0


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("ls", parents=[common], help="list the snapshots of a run directory",
                       description="List every snapshot-like entry of a run directory (or URL): engine snapshots, "
                                   "DCP directories, ppe single files, in-progress leftovers; by training position. "
                                   "The one autoload would resume from is marked with *. A local tier directory "
                                   "(snapshot(local=...)) is listed by step: the ranks' parts and partner copies.")
    p.add_argument("run", help="the run (output) directory or URL")
    p.add_argument("--json", action="store_true", help="print a JSON list of objects")
    p.add_argument("--deep", action="store_true", help="also check every checksum (reads all data)")
    p.add_argument("--filename", default=DEFAULT_FILENAME,
                   help="the snapshot filename format autoload uses (default: %(default)s)")
    p.set_defaults(run_command=cmd_ls)
    p = sub.add_parser("inspect", parents=[common], help="entries, shapes, dtypes and metadata of one snapshot",
                       description="Show the entries (shape, dtype, bytes) and metadata of one snapshot: an engine "
                                   "snapshot, a DCP directory, a ppe torch.save file or a safetensors file.")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run_command=cmd_inspect)


__all__ = ["DEFAULT_FILENAME", "add_parsers", "inspect_source", "list_run"]
