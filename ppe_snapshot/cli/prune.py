"""``prune``: the extension's retention from the shell, through the same code (:mod:`ppe_snapshot.retention`).

Each ``--keep-*`` flag builds one policy (:data:`RULES`); several flags keep what any of them keeps.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable

from ppe_snapshot.cli.common import UsageError
from ppe_snapshot.cli.describe import DEFAULT_FILENAME
from ppe_snapshot.retention import KeepBest, KeepEvery, KeepLatest, Policy, filesystem, prune


def _keep_latest(n: int) -> Policy:
    return KeepLatest(n)


def _keep_every(k: int) -> Policy:
    return KeepEvery(k)


def _keep_best(spec: str) -> Policy:
    """``KEY:N[:min|max]``, e.g. ``val/loss:3`` or ``val/accuracy:1:max``; the key may hold colons."""
    key, n, mode = spec, "1", "min"
    if spec.rsplit(":", 1)[-1] in ("min", "max"):
        spec, mode = spec.rsplit(":", 1)
    if ":" in spec:
        key, n = spec.rsplit(":", 1)
    if not key or not n.isdigit():
        raise UsageError(f"--keep-best {spec!r}: expected KEY:N[:min|max], e.g. val/loss:3")
    return KeepBest(key, int(n), mode)


#: Each retention flag (its dest) and how its values become a policy.
RULES: dict[str, Callable[[Any], Policy]] = {
    "keep_latest": _keep_latest, "keep_every": _keep_every, "keep_best": _keep_best,
}


def _policy(args: argparse.Namespace) -> Policy:
    policies = []
    for dest, build in RULES.items():
        for value in getattr(args, dest) or ():
            try:
                policies.append(build(value))
            except (TypeError, ValueError) as e:
                raise UsageError(f"--{dest.replace('_', '-')} {value}: {e}") from None
    if not policies:
        raise UsageError(f"{args.run}: say what to keep (--keep-latest N, --keep-every K, --keep-best KEY:N)")
    policy = policies[0]
    for other in policies[1:]:
        policy = policy | other
    return policy


def cmd_prune(args: argparse.Namespace) -> int:
    fs, root = filesystem(args.run, args.storage_options)
    if not fs.isdir(root):
        raise UsageError(f"{args.run}: no such directory")
    policy = _policy(args)
    chosen = prune(args.run, args.filename, policy, args.storage_options, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for url in chosen:
        print(f"{verb} {url}")
    print(f"{len(chosen)} {'to remove (dry run: nothing removed)' if args.dry_run else 'removed'} "
          f"(keeping: {policy!r})")
    return 0


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("prune", parents=[common], help="remove old snapshots, as the extension's retention does",
                       description="Remove old snapshots of a run directory with the extension's retention. What "
                                   "any --keep-* flag keeps is kept (flags may repeat); never removed: the newest "
                                   "complete snapshot and anything newer. Leftovers of crashed saves older than "
                                   "it are removed.")
    p.add_argument("run", metavar="RUN")
    p.add_argument("--keep-latest", type=int, action="append", metavar="N",
                   help="keep the N newest complete snapshots")
    p.add_argument("--keep-every", type=int, action="append", metavar="K",
                   help="keep the snapshot at every K-th iteration (milestones)")
    p.add_argument("--keep-best", action="append", metavar="KEY:N[:min|max]",
                   help="keep the N snapshots with the best value of KEY recorded at save (default min)")
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p.add_argument("--filename", default=DEFAULT_FILENAME,
                   help="the snapshot filename format (default: %(default)s)")
    p.set_defaults(run_command=cmd_prune)
