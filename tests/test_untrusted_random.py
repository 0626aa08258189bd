"""Snapshots damaged at random (seeded: every run crafts the same 200 of each kind): whatever a mutation of a
manifest, an index file or a data file makes, every reader either reads it or raises a ``SnapshotError``, never
another exception, a hang, or an allocation the bytes on disk do not back.

The cases run in a child process (``_random_crafting.py``) under an address-space limit, so that an allocation
sized by a crafted field fails there as a finding instead of exhausting this machine. The crafted cases of
test_untrusted_manifest.py and test_untrusted_index.py name what each refusal says; these find what no one
thought to write down (on the code before them: a dict key decoded to a list, an RNG state the generators refuse,
a world size no list could hold).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


@pytest.mark.parametrize("kind", ["v2", "v1", "sharded", "incremental"])
def test_randomly_damaged_snapshots_raise_snapshot_errors_only(kind):
    done = subprocess.run([sys.executable, os.path.join(HERE, "_random_crafting.py"), kind, "35", "200"],
                          capture_output=True, text=True, timeout=300, cwd=HERE)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["findings"] == [], json.dumps(report["findings"][:5], indent=1)
    outcomes = report["outcomes"]
    # (the damage reached the readers both ways: most cases refused, some still read)
    assert outcomes.get("CorruptSnapshotError", 0) > 200 and outcomes.get("read", 0) > 50, outcomes
