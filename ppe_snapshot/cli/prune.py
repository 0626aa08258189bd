"""``prune``: the extension's retention from the shell, through the same code (:mod:`ppe_snapshot.retention`).

Each ``--keep-*`` flag adds one rule through :data:`RULES`; today ``--keep-latest N`` (``n_retains``).
"""
from __future__ import annotations

import argparse
from typing import Any, Callable

from ppe_snapshot.cli.common import UsageError
from ppe_snapshot.cli.describe import DEFAULT_FILENAME
from ppe_snapshot.retention import filesystem, list_snapshots, prune, select_prunable


def _keep_latest(args: argparse.Namespace) -> int | None:
    return args.keep_latest


#: How each retention flag's value becomes what retention takes (the flag's dest -> builder).
RULES: dict[str, Callable[[argparse.Namespace], Any]] = {"keep_latest": _keep_latest}


def cmd_prune(args: argparse.Namespace) -> int:
    fs, root = filesystem(args.run, args.storage_options)
    if not fs.isdir(root):
        raise UsageError(f"{args.run}: no such directory")
    if args.keep_latest is None:
        raise UsageError(f"{args.run}: say what to keep (--keep-latest N)")
    if args.keep_latest < 1:
        raise UsageError(f"--keep-latest {args.keep_latest}: keep at least 1 snapshot")
    keep = RULES["keep_latest"](args)
    if args.dry_run:
        doomed = select_prunable(list_snapshots(args.run, args.filename, args.storage_options), keep)
        for candidate in doomed:
            print(f"would remove {candidate.url} ({candidate.kind})")
        print(f"{len(doomed)} to remove (dry run: nothing removed)")
        return 0
    removed = prune(args.run, args.filename, keep, args.storage_options)
    for url in removed:
        print(f"removed {url}")
    print(f"{len(removed)} removed")
    return 0


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("prune", parents=[common], help="remove old snapshots, as the extension's retention does",
                       description="Remove old snapshots of a run directory with the extension's retention: keep "
                                   "the N newest complete snapshots (never the newest one), and remove leftovers "
                                   "of crashed saves older than it.")
    p.add_argument("run", metavar="RUN")
    p.add_argument("--keep-latest", type=int, metavar="N", help="keep the N newest complete snapshots")
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p.add_argument("--filename", default=DEFAULT_FILENAME,
                   help="the snapshot filename format (default: %(default)s)")
    p.set_defaults(run_command=cmd_prune)
