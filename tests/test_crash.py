"""Real crashes: ``kill -9`` of processes in the middle of a take.

A snapshot whose save was killed before the commit has no manifest and is
never mistaken for a snapshot; every committed one stays whole. A snapshot
saved again under its name (``filename="latest"``) is killed at any moment of
its replacement: the previous or the new one is left, complete, for autoload. An incremental training run
(``KeepLatest(2)``) is killed at random moments of its saves and prunes: every complete snapshot restores.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

import _crash_child as child
import _warm
from _dist import WORKER_ENV, free_port
from ppe_snapshot import Snapshot, SnapshotNotFoundError, StateDict, retention

CHILD = child.__file__
MIB = 200
DEADLINE_S = 60.0


def _spawn(args: list[str], **env: str) -> subprocess.Popen:
    return _warm.popen([sys.executable, CHILD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, env={**os.environ, **WORKER_ENV, **env})


def _wait_until(ready: Callable[[], bool], what: str, procs: list[subprocess.Popen]) -> None:
    """Poll ``ready`` until true; fail when a child exits first or the deadline passes."""
    deadline = time.monotonic() + DEADLINE_S
    while not ready():
        for p in procs:
            if p.poll() is not None:
                out, err = p.communicate()
                pytest.fail(f"child exited with {p.returncode} before {what}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {DEADLINE_S:.0f} s waiting for {what}")
        time.sleep(0.002)


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(timeout=30)
        for stream in (p.stdout, p.stderr):
            stream.close()


@pytest.fixture(scope="module")
def expected() -> dict:
    """The loop child's state (re-marked per snapshot by ``_assert_restores``)."""
    return child.big_state(MIB)


def _assert_restores(path: str, index: int, expected: dict) -> None:
    snapshot = Snapshot(path)
    snapshot.verify()
    child.mark(expected, index)
    target = StateDict({k: torch.full_like(v, 7) if isinstance(v, torch.Tensor) else -1
                        for k, v in expected.items()})
    snapshot.restore({"state": target})
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert target[key].dtype == value.dtype and torch.equal(target[key], value), (path, key)
        else:
            assert target[key] == value, (path, key)


def test_kill_during_take_leaves_committed_snapshots_whole(tmp_path, expected):
    rng = random.Random()
    victim = rng.choice([1, 2])  # the take to kill; every earlier one commits
    root = tmp_path / "run"
    proc = _spawn(["loop", str(root), str(MIB)])
    try:
        while True:  # kill a random moment after the victim's data file appeared, before its commit
            data = root / f"s{victim}" / "data" / "rank0.bin"
            _wait_until(data.exists, f"{data} to appear", [proc])
            time.sleep(rng.uniform(0, 0.1))
            if not (root / f"s{victim}" / "manifest.json").exists():
                os.kill(proc.pid, signal.SIGKILL)
                break
            victim += 1  # this one already committed: aim at the next take
        proc.wait(timeout=30)
        out, _ = proc.communicate()
    finally:
        _kill_all([proc])
    assert proc.returncode == -signal.SIGKILL
    committed = [str(root / f"s{i}") for i in range(victim)]
    assert out.split() == committed
    assert sorted(os.listdir(root)) == sorted(f"s{i}" for i in range(victim + 1))

    for index, path in enumerate(committed):
        _assert_restores(path, index, expected)

    killed = root / f"s{victim}"
    assert (killed / "data" / "rank0.bin").exists() and not (killed / "manifest.json").exists()
    with pytest.raises(SnapshotNotFoundError, match="manifest.json is missing"):
        Snapshot(str(killed)).restore({"state": StateDict(step=-1)})
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(str(killed)).verify()
    # the leftovers of the crashed save do not block a new take at the same path
    child.mark(expected, victim)
    Snapshot.take(str(killed), {"state": StateDict(expected)})
    _assert_restores(str(killed), victim, expected)


def test_kill_of_one_rank_during_take_prevents_the_commit(tmp_path):
    path = tmp_path / "snap"
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    procs = [_spawn(["dist", str(path), str(MIB)], RANK=str(rank), **env) for rank in (0, 1)]
    rank0, rank1 = procs
    try:
        parts = path / ".parts"
        _wait_until((path / "data" / "rank1.bin").exists, "rank 1 to start writing", procs)
        rank1_published = parts.exists() and any(name.endswith(".rank1.json") for name in os.listdir(parts))
        os.kill(rank1.pid, signal.SIGKILL)
        assert not rank1_published
        rank1.wait(timeout=30)
        deadline = time.monotonic() + DEADLINE_S
        while rank0.poll() is None and time.monotonic() < deadline:
            assert not (path / "manifest.json").exists()
            time.sleep(0.05)
        out, err = rank0.communicate(timeout=1) if rank0.poll() is not None else ("", "")
    finally:
        _kill_all(procs)
    assert rank1.returncode == -signal.SIGKILL
    assert rank0.returncode == child.ERROR_EXIT, (out, err)
    assert "SnapshotAbortedError: snapshot " in err and "rank 1 died or lost its connection during the take" in err
    assert "committed" not in out
    assert not (path / "manifest.json").exists()
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(str(path)).restore({"state": StateDict(step=-1)})


REPLACE_MIB = 48


@pytest.fixture(scope="module")
def expected_small() -> dict:
    return child.big_state(REPLACE_MIB)


def _newest_complete_index(root, expected: dict) -> int:
    """The index of the snapshot autoload would pick under ``root`` (checked whole, bit-exact)."""
    complete = [c for c in retention.list_snapshots(str(root), "latest") if c.complete]
    assert complete, f"no complete snapshot left under {root}: {os.listdir(root)}"
    newest = complete[-1]
    _assert_restores(newest.url, newest.iteration, expected)
    return newest.iteration


def _kill_one_replacement(root, variant: str, pause: str, first: int, rng: random.Random) -> list[int]:
    """Run the replacing child from snapshot ``first``; kill it mid-replacement; the indices it printed."""
    proc = _spawn(["replace", str(root), str(REPLACE_MIB), variant, pause, str(first)])
    printed: list[str] = []
    try:
        if pause == "random":  # somewhere in the second save: data being written, committed, swapped, removed
            side = root / "latest.ppe-snapshot-next"
            _wait_until(lambda: (root / "latest").exists() and side.exists(), "a replacement to start", [proc])
            time.sleep(rng.uniform(0, 0.3))
        else:
            while (line := proc.stdout.readline().strip()) != "PAUSE":
                assert line, f"the child ended before pausing: {proc.stderr.read()}"
                printed.append(line)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        printed += proc.stdout.read().split()
    finally:
        _kill_all([proc])
    assert proc.returncode == -signal.SIGKILL
    return [int(i) for i in printed if i != "PAUSE"]


@pytest.mark.parametrize("variant, pause", [
    ("exchange", "random"), ("rename", "random"), ("fsspec", "random"),
    ("exchange", "before_promote"), ("exchange", "after_exchange"),
    ("rename", "after_remove"), ("fsspec", "after_remove"),
])
def test_kill_during_replacement_leaves_the_previous_or_the_new_snapshot(tmp_path, expected_small, variant, pause):
    rng = random.Random()
    root = tmp_path / "run"
    first = 0
    for _ in range(2):  # the second child starts from what the first one's kill left
        printed = _kill_one_replacement(root, variant, pause, first, rng)
        last_saved = printed[-1] if printed else first - 1
        found = _newest_complete_index(root, expected_small)
        assert found in (last_saved, last_saved + 1), (found, printed)  # the previous or the one in flight
        first = found + 1


def _listed_restore(root: Path) -> list[int]:
    """Every complete snapshot in ``root`` verified and restored against the state of its iteration."""
    iterations = []
    for candidate in retention.list_snapshots(str(root), "snapshot_iter_{.iteration}"):
        if candidate.kind != "snapshot":
            continue
        Snapshot(candidate.url).verify()
        saved = Snapshot(candidate.url).read_object("0/state/models/main")
        expected = child.incremental_state(candidate.iteration)
        assert torch.equal(saved["frozen"], expected["frozen"]), candidate.name
        assert torch.equal(saved["table"], expected["table"]), candidate.name
        iterations.append(candidate.iteration)
    return iterations


def test_kill_during_incremental_saves_and_prunes_leaves_every_snapshot_restorable(tmp_path):
    rng = random.Random()
    root = tmp_path / "run"
    env = {**os.environ, **WORKER_ENV, "PPE_SNAPSHOT_BLOCK_KB": "4"}
    newest = 0
    for kill in range(3):
        proc = _warm.popen([sys.executable, child.__file__, "incremental", str(root), "60"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            deadline = time.monotonic() + 60
            while not (root.exists() and any(p.name.startswith("snapshot_iter_") and (p / "manifest.json").exists()
                                              and int(p.name.rsplit("_", 1)[1]) > newest for p in root.iterdir())):
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "the child saved nothing new"
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.5))  # somewhere in a save, a prune or between them
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        iterations = _listed_restore(root)
        assert iterations and max(iterations) > newest
        newest = max(iterations)
    done = _warm.run([sys.executable, child.__file__, "incremental", str(root), str(newest + 3)],
                     capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert _listed_restore(root) == [newest + 2, newest + 3]
    kept = {c.name: c for c in retention.list_snapshots(str(root), "snapshot_iter_{.iteration}")}
    referenced = {name for c in kept.values() for name in c.references}
    # what the kept snapshots do not read is gone (at most one prune later)
    assert {name for name, c in kept.items() if c.kind != "snapshot"} <= referenced


def _leftover(run: Path, name: str, fmt: str) -> retention.Candidate:
    return {c.name: c for c in retention.list_snapshots(str(run), fmt)}[name]


def _ls_status(run: Path, name: str) -> str:
    """The STATUS column of ``name`` as ``ppe-snapshot ls`` prints it."""
    done = _warm.run([sys.executable, "-m", "ppe_snapshot.cli", "ls", str(run)], capture_output=True, text=True,
                     timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if name in line.split()[:2])
    return row.split("  ")[-1].strip()


def test_a_killed_save_is_told_from_a_save_in_progress_and_pruned(tmp_path):
    """A save frozen mid-write (SIGSTOP) is in progress: listed so, never pruned. Killed (SIGKILL), it is a leftover
    whose writer is gone: listed as crashed, and pruned although newer than the newest complete snapshot."""
    root, victim = tmp_path / "run", 1
    proc = _spawn(["loop", str(root), str(MIB)])
    try:
        while True:
            _wait_until((root / f"s{victim}" / "data" / "rank0.bin").exists, f"s{victim} to be written", [proc])
            os.kill(proc.pid, signal.SIGSTOP)
            if not (root / f"s{victim}" / "manifest.json").exists():
                break
            os.kill(proc.pid, signal.SIGCONT)  # committed already: aim at the next take
            victim += 1
        name = f"s{victim}"
        frozen = _leftover(root, name, "s{.iteration}")
        assert frozen.kind == "incomplete" and frozen.busy and not frozen.abandoned
        assert frozen.writers == f"being written by pid {proc.pid} on {socket.gethostname()}"
        assert _ls_status(root, name) == "in-progress"
        assert retention.prune(str(root), "s{.iteration}", 1, dry_run=True) == [str(root / f"s{i}")
                                                                                for i in range(victim - 1)]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        _kill_all([proc])
    killed = _leftover(root, name, "s{.iteration}")
    assert killed.kind == "incomplete" and killed.abandoned and not killed.busy
    assert killed.writers == f"its writer is gone: pid {proc.pid} on {socket.gethostname()}"
    assert _ls_status(root, name) == f"crashed (its writer is gone: pid {proc.pid} on {socket.gethostname()})"
    removed = retention.prune(str(root), "s{.iteration}", 1)
    assert removed == [str(root / f"s{i}") for i in range(victim - 1)] + [str(root / name)]
    assert sorted(os.listdir(root)) == [f"s{victim - 1}"]
    Snapshot(str(root / f"s{victim - 1}")).verify()


def test_a_multi_rank_leftover_is_not_gone_while_any_rank_lives(tmp_path):
    """Rank 1 killed mid-save while rank 0 lives (frozen with SIGSTOP, so that it cannot abort the take): the take
    is still in progress and kept. Once rank 0 is killed too, every writer is gone and prune removes it."""
    run = tmp_path / "run"
    Snapshot.take(str(run / "snapshot_iter_1"), {"state": StateDict(step=1)}, metadata={"iteration": 1})
    fmt = "snapshot_iter_{.iteration}"
    for iteration in range(2, 5):  # a take that committed before the ranks were stopped: try the next
        path = run / f"snapshot_iter_{iteration}"
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
        procs = [_spawn(["dist", str(path), str(MIB)], RANK=str(rank), **env) for rank in (0, 1)]
        rank0, rank1 = procs
        try:
            _wait_until((path / "data" / "rank1.bin").exists, "rank 1 to start writing", procs)
            _wait_until(lambda: len(list((path / ".parts").glob("*.writer-rank*.json"))) == 2,
                        "both ranks to record their writers", procs)  # each rank records itself as it starts
            for process in (rank1, rank0):
                os.kill(process.pid, signal.SIGSTOP)
            if (path / "manifest.json").exists():
                continue
            os.kill(rank1.pid, signal.SIGKILL)
            rank1.wait(timeout=30)
            half = _leftover(run, path.name, fmt)
            assert half.busy and not half.abandoned and half.writers.startswith("being written by pid "), half
            assert retention.prune(str(run), fmt, 1) == [] and path.exists()
            os.kill(rank0.pid, signal.SIGKILL)
            rank0.wait(timeout=30)
            break
        finally:
            _kill_all(procs)
    else:
        pytest.fail("every take committed before its ranks could be stopped")
    gone = _leftover(run, path.name, fmt)
    assert gone.abandoned and not gone.busy
    assert gone.writers.startswith("its writers are gone: ") and f"pid {rank0.pid}" in gone.writers \
        and f"pid {rank1.pid}" in gone.writers
    assert str(path) in retention.prune(str(run), fmt, 1) and not path.exists()


def _dead(pid: int) -> bool:
    """Whether process ``pid`` (not a child of this one) is gone or a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in "ZXx"
    except FileNotFoundError:
        return True


def test_a_process_writers_save_is_in_progress_while_its_worker_lives(tmp_path):
    """A ProcessWriter's worker writes for the training process: both are recorded. The trainer killed while its
    worker (frozen) still writes: in progress. The worker killed too: gone, and pruned."""
    root, victim = tmp_path / "run", 1
    trainer = _spawn(["process", str(root), str(MIB)])
    worker = None
    try:
        line = trainer.stdout.readline().split()
        assert line[:1] == ["worker"], (line, trainer.stderr.read() if trainer.poll() is not None else "")
        worker = int(line[1])
        while True:
            _wait_until((root / f"s{victim}" / "data" / "rank0.bin").exists, f"s{victim} to be written", [trainer])
            os.kill(worker, signal.SIGSTOP)
            if not (root / f"s{victim}" / "manifest.json").exists():
                break
            os.kill(worker, signal.SIGCONT)
            victim += 1
        name = f"s{victim}"
        record = json.loads(next((root / name / ".parts").glob("*.writer-rank0.json")).read_text())
        assert sorted(p["pid"] for p in record["processes"]) == sorted([trainer.pid, worker])
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=30)
        assert _leftover(root, name, "s{.iteration}").busy
        assert str(root / name) not in retention.prune(str(root), "s{.iteration}", 1, dry_run=True)
    finally:
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
        _kill_all([trainer])
    _wait_until(lambda: _dead(worker), f"worker {worker} to die", [])  # a zombie, maybe: it runs no more
    gone = _leftover(root, name, "s{.iteration}")
    assert gone.abandoned and f"pid {worker}" in gone.writers and f"pid {trainer.pid}" in gone.writers
    assert str(root / name) in retention.prune(str(root), "s{.iteration}", 1) and not (root / name).exists()
