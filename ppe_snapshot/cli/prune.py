"""``prune``: the extension's retention from the shell, through the same code (:mod:`ppe_snapshot.retention`).

Each ``--keep-*`` flag builds one policy (:data:`RULES`); several flags keep what any of them keeps.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any, Callable

from ppe_snapshot.cli.common import UsageError
from ppe_snapshot.cli.describe import DEFAULT_FILENAME
from ppe_snapshot.retention import (
    COMPLETE_KINDS, Candidate, KeepBest, KeepEvery, KeepLatest, Policy, list_snapshots, prune,
)
from ppe_snapshot.storage import open_tree

#: How ``--keep-best`` is written (its help, its errors): N defaults to 1 and the mode to min, as ``KeepBest``'s.
KEEP_BEST_SPEC = "KEY[:N][:min|max]"


def _keep_latest(n: int) -> Policy:
    return KeepLatest(n)


def _keep_every(k: int) -> Policy:
    return KeepEvery(k)


def _keep_best(spec: str) -> Policy:
    """``KEY[:N][:min|max]``, e.g. ``val/loss``, ``val/loss:3`` or ``val/accuracy:1:max``; a key that holds
    colons needs ``:N``."""
    rest, n, mode = spec, "1", "min"
    if rest.rsplit(":", 1)[-1] in ("min", "max"):
        rest, mode = rest.rsplit(":", 1)
    key = rest
    if ":" in rest:
        key, n = rest.rsplit(":", 1)
    if not key or not n.isdigit():
        raise UsageError(f"--keep-best {spec!r}: expected {KEEP_BEST_SPEC}, e.g. val/loss:3 (N defaults to 1, "
                         "the mode to min)")
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
        raise UsageError(f"{args.run}: say what to keep (--keep-latest N, --keep-every K, --keep-best {KEEP_BEST_SPEC})")
    policy = policies[0]
    for other in policies[1:]:
        policy = policy | other
    return policy


def _check_recorded(run: str, policy: Policy, listed: list[Candidate]) -> None:
    """Refuse a policy that compares values no complete snapshot of ``run`` recorded (a misspelt key would leave
    only the newest snapshot)."""
    complete = [c for c in listed if c.kind in COMPLETE_KINDS]
    recorded = sorted({key for c in complete for key in c.metrics})
    for key in policy.recorded_keys:
        if complete and not any(key in c.metrics for c in complete):
            have = f"they record {', '.join(map(repr, recorded))}" if recorded else "they record no values"
            raise UsageError(f"--keep-best {key!r}: none of the {len(complete)} snapshots in {run} recorded a value "
                             f"of {key!r} ({have}); nothing removed")


def cmd_prune(args: argparse.Namespace) -> int:
    tree = open_tree(args.run, args.storage_options)
    if not tree.is_dir(tree.root):
        raise UsageError(f"{args.run}: no such directory")
    policy = _policy(args)
    listed = list_snapshots(args.run, args.filename, args.storage_options)
    _check_recorded(args.run, policy, listed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = prune(args.run, args.filename, policy, args.storage_options, dry_run=args.dry_run, listed=listed)
    for warning in caught:  # e.g. some snapshots did not record a --keep-best key: one line, no source line
        print(f"ppe-snapshot: warning: {warning.message}", file=sys.stderr)
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
                                   "complete snapshot and anything newer, except leftovers whose writers are "
                                   "provably gone (checked on the host that wrote them). Leftovers of crashed "
                                   "saves older than it are removed.")
    p.add_argument("run", metavar="RUN")
    p.add_argument("--keep-latest", type=int, action="append", metavar="N",
                   help="keep the N newest complete snapshots")
    p.add_argument("--keep-every", type=int, action="append", metavar="K",
                   help="keep the snapshot at every K-th iteration (milestones)")
    p.add_argument("--keep-best", action="append", metavar=KEEP_BEST_SPEC,
                   help="keep the N snapshots (default 1) with the best value of KEY recorded at save: the lowest, "
                        "or with :max the highest; a KEY no snapshot recorded is an error")
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p.add_argument("--filename", default=DEFAULT_FILENAME,
                   help="the snapshot filename format (default: %(default)s)")
    p.set_defaults(run_command=cmd_prune)
