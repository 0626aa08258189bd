"""The local tier's random-kill trials at a full count (issue 34): ``--trials`` seeded trials of each kind.

The trials are ``tests/test_local_tier_random.py``'s: four ranks as two nodes of two train with a local tier; a
seeded random rank, or both ranks of a node (whose local directory is then wiped), SIGKILL themselves at a random
moment; in some trials one is killed again while the restart restores; half the trials save densely (a local step
every iteration); the run restarted whole must end bit-exact with an uninterrupted one. And the same with one
process in DEFAULT mode (``--kind one-process``; its local directory wiped in some trials). The test suite runs two
trials of four ranks and one of one process; this runs the full count.

    python benchmarks/local_tier_trials.py --trials 40 [--first-seed 0] [--workers 2] [--kind ranks|one-process|both]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Which of the tests each ``--kind`` runs (a ``-k`` expression; empty: both).
KINDS = {"ranks": "not one_process", "one-process": "one_process", "both": ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1, help="trials run at once (pytest-xdist)")
    parser.add_argument("--kind", choices=list(KINDS), default="both")
    args = parser.parse_args()
    env = {**os.environ, "LOCAL_TIER_TRIALS": str(args.trials), "LOCAL_TIER_FIRST_SEED": str(args.first_seed)}
    test = "tests/test_local_tier_random.py"
    workers = ["-n", str(args.workers)] if args.workers > 1 else []
    chosen = ["-k", KINDS[args.kind]] if KINDS[args.kind] else []
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-q", "-rf", *workers, *chosen, test], cwd=ROOT,
                             env=env))


if __name__ == "__main__":
    main()
