"""When one rank of a multi-rank save dies (a real SIGKILL) or its storage fails, every other rank knows in seconds.

Each trial starts 3 fresh processes in a gloo group (``tests/_rank_kill.py``); the victim kills itself with
SIGKILL at a random moment of a random save. ``RANK_KILL_TRIALS`` sets the number of seeded trials per kind (a
few here; ``benchmarks/rank_kill_trials.py`` runs the full count).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import zlib

import pytest

import _channel_child
import _rank_kill
import _warm
from _dist import free_port
from ppe_snapshot import Snapshot
from ppe_snapshot.run_dir import CandidateKind, list_snapshots

#: The bound within which every survivor raises after a rank died (README, "When a rank fails").
DEAD_RANK_BOUND_S = 10.0
#: The bound within which every rank raises after one rank's storage failed entirely.
STORAGE_FAILURE_BOUND_S = 5.0
TRIALS = int(os.environ.get("RANK_KILL_TRIALS", "1"))


@pytest.fixture(autouse=True)
def _free_the_disk(tmp_path):
    """A trial writes up to 1 GiB: removed once checked (a run of 100 trials would otherwise fill the disk)."""
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)


def kill_spec(tmp_path, kind: str, seed: int) -> dict:
    rng = random.Random(seed)
    return {"dir": str(tmp_path), "kind": kind, "saves": 5, "mib": 64, "victim": rng.randrange(3), "when": "delay",
            "save": rng.randrange(2, 4), "delay": rng.uniform(0.0, 1.0), "scaled": True}


def check_run_dir(out: str) -> list[str]:
    """Every save directory is complete and whole, or an aborted leftover (not a take in progress): the names of
    the complete ones."""
    complete = []
    for candidate in list_snapshots(out, "save{.iteration}"):
        if candidate.kind == CandidateKind.SNAPSHOT:
            Snapshot(candidate.url).verify(deep=True)
            complete.append(candidate.name)
        else:
            assert candidate.kind == CandidateKind.INCOMPLETE and not candidate.busy, candidate
    return complete


def check_survivors(result: dict, victim: int, bound: float) -> None:
    killed = result["killed"]
    assert killed is not None and killed["rank"] == victim, result
    for rank, record in result["ranks"].items():
        if rank == victim:
            continue
        assert record is not None, f"rank {rank} never finished: {result}"
        error = record.get("error")
        assert error is not None, f"rank {rank} raised nothing after rank {victim} died: {record}"
        assert "SnapshotAbortedError" in error["classes"], error
        assert error["time"] - killed["time"] <= bound, (rank, error["time"] - killed["time"], error)
        assert f"rank {victim} died or lost its connection" in error["message"], error


@pytest.mark.parametrize("kind", _rank_kill.KINDS)
@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_rank_killed_at_a_random_moment_of_a_save(tmp_path, kind, trial):
    spec = kill_spec(tmp_path, kind, seed=zlib.crc32(f"{kind}-{trial}".encode()))
    result = _rank_kill.run_trial(spec)
    check_survivors(result, spec["victim"], DEAD_RANK_BOUND_S)
    complete = check_run_dir(str(tmp_path))
    assert {"save0", "save1"} <= set(complete) and f"save{spec['save'] + 1}" not in complete


@pytest.mark.parametrize("victim", [0, 2])
def test_four_ranks_one_killed_before_a_save_all_others_know(tmp_path, victim):
    """The agreement that starts a save goes through rank 0, point to point: no survivor waits in a collective
    for a peer of the dead rank (with 4 ranks, a gloo collective leaves one of them waiting)."""
    spec = {"dir": str(tmp_path), "kind": "thread", "saves": 3, "mib": 4, "victim": victim, "when": "before_save",
            "save": 2}
    result = _rank_kill.run_trial(spec, world_size=4)
    check_survivors(result, victim, DEAD_RANK_BOUND_S)
    for rank, record in result["ranks"].items():
        if rank != victim:
            assert "could not agree on the take" in record["error"]["message"], record
    assert check_run_dir(str(tmp_path)) == ["save0", "save1"]


@pytest.mark.parametrize("victim", [0, 2])
def test_distributed_mode_a_rank_killed_during_a_save(tmp_path, victim):
    """DISTRIBUTED: rank 0 writes alone (ThreadWriter), the ranks meet through it at every save; killing the saver
    or another rank mid-save makes every other rank raise naming it."""
    spec = {"dir": str(tmp_path), "kind": "distributed", "saves": 5, "mib": 64, "victim": victim, "when": "delay",
            "save": 2, "delay": 0.5, "scaled": True}
    result = _rank_kill.run_trial(spec)
    check_survivors(result, victim, DEAD_RANK_BOUND_S)
    assert {"save1", "save2"} <= set(check_run_dir(str(tmp_path)))


def test_rank_0_killed_after_writing_the_manifest_leaves_a_complete_snapshot(tmp_path):
    spec = {"dir": str(tmp_path), "kind": "take", "saves": 2, "mib": 16, "victim": 0, "when": "after_manifest",
            "save": 1}
    result = _rank_kill.run_trial(spec)
    assert result["killed"]["how"] == "after_manifest"
    for rank in (1, 2):  # the take committed: the survivors return from it
        record = result["ranks"][rank]
        assert "error" not in record and len(record["saves"]) == 2 and "end" in record["saves"][1], record
    assert check_run_dir(str(tmp_path)) == ["save0", "save1"]


@pytest.mark.parametrize("kind", ["take", "thread"])
def test_a_rank_whose_every_write_fails(tmp_path, kind):
    spec = {"dir": str(tmp_path), "kind": kind, "saves": 1, "mib": 16, "failing_rank": 1}
    result = _rank_kill.run_trial(spec)
    failed = result["ranks"][1]["error"]
    assert failed["type"] == ("OSError" if kind == "take" else "BackgroundSaveError"), failed
    assert "No space left on device" in failed["message"]
    start = min(r["saves"][0]["start"] for r in result["ranks"].values())
    for rank in (0, 2):
        error = result["ranks"][rank]["error"]
        assert "SnapshotAbortedError" in error["classes"] or error["type"] == "BackgroundSaveError", error
        assert "rank 1" in error["message"] and "No space left on device" in error["message"], error
        assert error["time"] - start <= STORAGE_FAILURE_BOUND_S, error["time"] - start
    assert check_run_dir(str(tmp_path)) == []


def test_a_slow_rank_is_waited_for(tmp_path):
    spec = {"dir": str(tmp_path), "kind": "thread", "saves": 2, "mib": 16, "slow_rank": 2, "slow_s": 3.0}
    result = _rank_kill.run_trial(spec)
    for rank, record in result["ranks"].items():
        assert "error" not in record, record
    assert check_run_dir(str(tmp_path)) == ["save0", "save1"]
    slow = result["ranks"][2]["saves"]
    assert slow[1]["end"] - slow[0]["start"] >= 6.0  # the slow storage was slow, and still waited for


def test_a_verdict_received_stands_when_rank_0_exits_before_the_report(tmp_path):
    """Rank 0 aborts a take (a third rank died), tells rank 1 and exits; rank 1, its part done, reports only then
    and fails to reach rank 0: the verdict it was given stands, naming the dead rank, not rank 0."""
    port = free_port()
    procs = [_warm.popen([sys.executable, _channel_child.__file__, str(rank), str(port), str(tmp_path)])
             for rank in range(2)]
    try:
        assert [p.wait(60) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    with open(tmp_path / "verdict.json") as f:
        assert json.load(f) == {"committed": False, "reason": _channel_child.REASON}
