"""Run directories damaged at random, for test_untrusted_random.py (run as a child process under a memory limit).

    python _random_run_dirs.py KIND SEED COUNT

trains a small model (``_extension_workers.Run``) to iteration 4 with a snapshot every 2 iterations (KIND
``engine``: engine snapshots; ``incremental``: ``incremental=True``, each snapshot reading the unchanged blocks of
the one before), then COUNT
times copies the run directory, damages its newest snapshot, its older one or both (``_random_damage.py``), lists
it with ``ppe-snapshot ls`` and resumes it to iteration 6 with ``autoload=True, n_retains=1``. A case is a finding
unless all of these hold:

- ``ls`` lists the directory (a damaged snapshot is a line of it, not a failure);
- the resumed run ends where an uninterrupted one does, bit for bit (model, optimizer, scheduler, RNG state,
  iteration), from whichever snapshot it resumed; a snapshot a hostile writer made consistent (an index file
  rewritten, its checksum recomputed) may hold other values (training from them may even fail: an optimizer state
  without a key), and resuming from it counts as ``crafted``;
- every snapshot whose name is newer than the one resumed from was passed over with a warning naming it;
- autoload raised nothing, or, when both snapshots were damaged (an incremental one also by damage to the blocks
  it reads of the other), a ``SnapshotError`` (no older snapshot restores,
  and starting fresh is unsafe or the state does not fit); a crafted index may also be a ``StateMismatchError``
  (a dtype or shape rewritten consistently is another model's snapshot, never fallen back from);
- retention left ``snapshot_iter_6``, which verifies (every block it references included), and besides it only
  damaged snapshots and the data files of removed ones that it references.

It prints one JSON object: ``findings`` (each with the damage and what failed) and ``outcomes``, how many cases
ended each way.
"""
from __future__ import annotations

import collections
import json
import random
import resource
import shutil
import signal
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

KIND, SEED, COUNT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # an allocation sized by a crafted field fails here

import torch  # noqa: E402

from _asserts import assert_same  # noqa: E402
from _cli_raising import run_command  # noqa: E402
from _extension_workers import Run  # noqa: E402
from _random_damage import damage_snapshot  # noqa: E402
from ppe_snapshot import AutoloadSkipWarning, Snapshot, SnapshotError, StateDict, StateMismatchError  # noqa: E402
from ppe_snapshot.retention import CandidateKind, list_snapshots  # noqa: E402

rng = random.Random(SEED)
NAMES = ("snapshot_iter_2", "snapshot_iter_4")
OPTIONS = {"engine": {}, "incremental": {"incremental": True}}[KIND]


def _run(out: Path, iterations: int, **options: Any) -> Run:
    """A run with a table no step changes beside the model (what an incremental snapshot reads from the one
    before), saving every 2 iterations."""
    return Run(str(out), iterations, {**OPTIONS, **options},
               state_objects={"table": StateDict(rows=torch.arange(50_000, dtype=torch.float32))})


def _same(a: Any, b: Any) -> bool:
    try:
        assert_same(a, b)
    except AssertionError:
        return False
    return True


def _training_state(run: Run) -> dict[str, Any]:
    state = run.state()
    return {k: state[k] for k in ("iteration", "model", "optimizer", "scheduler", "rng")}


def _verifies(path: Path) -> bool:
    try:
        Snapshot(str(path)).verify()
    except SnapshotError:
        return False
    return True


def damage(out: Path) -> dict[str, str]:
    """Damage the newest snapshot under ``out``, the older one or both; what was damaged, by name."""
    pick = rng.random()
    damaged = [NAMES[1]] if pick < 0.7 else [NAMES[0]] if pick < 0.85 else list(NAMES)
    return {name: damage_snapshot(rng, out / name) for name in damaged}


def resume(out: Path, crafted: dict[str, str], straight: dict[str, Any]) -> str:
    """List and resume the run directory at ``out``, damaged as ``crafted`` says; the outcome (raises
    AssertionError for a finding)."""
    run_command("ls", str(out), statuses=(0,))  # (a damaged snapshot is a line of the listing, not a failure)
    run = _run(out, 6, autoload=True, n_retains=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run.manager.start_extensions()  # (autoload)
        except SnapshotError as e:
            consistent = all("idx" in what for what in crafted.values())
            # (an incremental snapshot reads blocks of the one before: damaged there, both are)
            broken = set(crafted) | ({NAMES[1]} if KIND == "incremental" and NAMES[0] in crafted else set())
            assert len(broken) == 2 or (type(e) is StateMismatchError and consistent), f"autoload raised {e!r}"
            return f"refused: {type(e).__name__}"
    skipped = {str(w.message).split("skipping snapshot ")[1].split(":")[0].rsplit("/", 1)[-1]
               for w in caught if issubclass(w.category, AutoloadSkipWarning)}
    resumed = run.snapshot.resumed_name
    newer = {name for name in NAMES if resumed is None or NAMES.index(name) > NAMES.index(resumed)}
    assert newer <= skipped, f"resumed from {resumed}, but skipped only {sorted(skipped)}"
    as_crafted = resumed in crafted and "idx" in crafted[resumed]
    try:
        run.train()
    except Exception as e:  # noqa: BLE001 - an optimizer state crafted without a key, a flag set it cannot run with
        assert as_crafted, f"training resumed from {resumed} raised {e!r}"
        return f"crafted {resumed}: training failed"
    outcome = f"resumed from {resumed}"
    if not _same(_training_state(run), straight):
        assert as_crafted, f"resumed from {resumed}: not where training was"
        outcome = f"crafted {resumed}"
    left = {c.name: c.kind for c in list_snapshots(str(out), "snapshot_iter_{.iteration}")}
    assert "snapshot_iter_6" in left and _verifies(out / "snapshot_iter_6"), f"retention left {left}"
    assert all(name in crafted or kind == CandidateKind.RETIRED for name, kind in left.items()
               if name != "snapshot_iter_6"), f"retention left {left}"
    return outcome


def _alarm(signum: int, frame: Any) -> None:
    raise TimeoutError("a case took more than 60 s")


def main() -> None:
    signal.signal(signal.SIGALRM, _alarm)
    root = Path(tempfile.mkdtemp())
    base = root / "run"
    _run(base, 4).train()
    reference = _run(root / "straight", 6)  # (made after the other: each seeds the generators)
    reference.train()
    straight = _training_state(reference)
    findings, outcomes = [], collections.Counter()
    for case in range(COUNT):
        out = root / f"case{case}"
        shutil.copytree(base, out)
        crafted = damage(out)
        signal.alarm(60)
        try:
            outcomes[resume(out, crafted, straight)] += 1
        except BaseException as e:  # noqa: BLE001 - what the test is for
            findings.append({"case": case, "damage": crafted, "error": f"{type(e).__name__}: {e}"[:300],
                             "where": traceback.format_exception(e)[-3:]})
        finally:
            signal.alarm(0)
        shutil.rmtree(out)
    shutil.rmtree(root)
    print(json.dumps({"findings": findings, "outcomes": outcomes}))


if __name__ == "__main__":
    main()
