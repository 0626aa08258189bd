"""The multi-rank kill harness at its full count (issue 21): ``--trials`` seeded trials per kind of save.

Each trial is ``tests/test_rank_failure.py::test_a_rank_killed_at_a_random_moment_of_a_save``: 3 fresh gloo
ranks save 5 times (64 MiB per rank) with one kind (sync ``take``, ``async_take``, SimpleWriter, ThreadWriter,
ProcessWriter); a seeded random rank kills itself with SIGKILL at a random moment of save 2 or 3; every survivor
must raise ``SnapshotAbortedError`` naming it within 10 s, and the run directory must hold only complete snapshots
and aborted leftovers. The test suite runs one trial per kind; this runs the full count.

    python benchmarks/rank_kill_trials.py --trials 20
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20, help="trials per kind of save")
    args = parser.parse_args()
    env = {**os.environ, "RANK_KILL_TRIALS": str(args.trials)}
    test = "tests/test_rank_failure.py::test_a_rank_killed_at_a_random_moment_of_a_save"
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-q", "-rA", test], cwd=ROOT, env=env))


if __name__ == "__main__":
    main()
