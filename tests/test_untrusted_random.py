"""Snapshots damaged at random (seeded: every run crafts the same 200 of each kind): whatever a mutation of a
manifest, an index file or a data file makes, every reader either reads it or raises a ``SnapshotError``, never
another exception, a hang, or an allocation the bytes on disk do not back; and run directories damaged so resume
from the newest snapshot that restores.

The cases run in a child process (``_random_crafting.py``) under an address-space limit, so that an allocation
sized by a crafted field fails there as a finding instead of exhausting this machine. The crafted cases of
test_untrusted_manifest.py and test_untrusted_index.py name what each refusal says; these find what no one
thought to write down (on the code before them: a dict key decoded to a list, an RNG state the generators refuse,
a world size no list could hold, a DCP value of no bytes handed to DCP's unpickler).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


# (dcp: dcp.load may also fail in DCP's own code for what the damage made, the reader's error in its message)
@pytest.mark.parametrize("kind", ["v2", "v1", "sharded", "incremental", "dcp"])
def test_randomly_damaged_snapshots_raise_snapshot_errors_only(kind):
    _crafted_without_findings(kind, "api", seed=35, count=200)


# (seed 6 of incremental crafts a world size of 2^31 at case 60, which inspect once ran out of memory on; seed 1
# of dcp planner data whose object paths rebuild no state DCP's planner can load, at case 0)
@pytest.mark.parametrize("kind, seed", [("v2", 35), ("incremental", 6), ("dcp", 1)])
def test_the_commands_refuse_randomly_damaged_snapshots_with_snapshot_errors_only(kind, seed):
    """The ``ppe-snapshot`` commands (inspect, verify, diff, ls, convert to each format): a damaged snapshot is
    refused by a SnapshotError, and a convert that fails leaves no destination behind."""
    _crafted_without_findings(kind, "cli", seed=seed, count=100)


# (seed 2 of engine: a manifest recording a lower iteration than its name, at case 75, and a higher one, at case
# 179, which retention then kept in place of the save after it; of incremental, at case 51 likewise)
@pytest.mark.parametrize("kind, count", [("engine", 200), ("incremental", 100)])
def test_randomly_damaged_run_directories_resume_where_training_was(kind, count):
    """A run directory whose newest snapshot, older one or both are damaged at random: listed, autoloaded and
    trained on with n_retains=1, it resumes exactly where training was from the newest snapshot that restores
    (warning of each newer one), or refuses with a SnapshotError where none does, and retention keeps the save
    after it (``_random_run_dirs.py`` says what each case must hold)."""
    done = subprocess.run([sys.executable, os.path.join(HERE, "_random_run_dirs.py"), kind, "2", str(count)],
                          capture_output=True, text=True, timeout=300, cwd=HERE)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["findings"] == [], json.dumps(report["findings"][:5], indent=1)
    outcomes = report["outcomes"]
    # (the damage reached autoload every way: some cases resumed from each snapshot, some from none)
    assert min(outcomes.get(f"resumed from {name}", 0) for name in ("snapshot_iter_2", "snapshot_iter_4")) > \
        count // 5 and outcomes.get("resumed from None", 0) > 0, outcomes


def _crafted_without_findings(kind: str, readers: str, seed: int, count: int) -> None:
    done = subprocess.run([sys.executable, os.path.join(HERE, "_random_crafting.py"), kind, str(seed), str(count),
                           readers], capture_output=True, text=True, timeout=300, cwd=HERE)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["findings"] == [], json.dumps(report["findings"][:5], indent=1)
    outcomes = report["outcomes"]
    # (the damage reached the readers both ways: most cases refused, some still read)
    assert outcomes.get("CorruptSnapshotError", 0) > 200 and outcomes.get("read", 0) > 50, outcomes
