"""DISTRIBUTED mode: every rank learns the outcome of every save the saver rank wrote, the last one included.

Two fresh processes in a gloo group (``tests/_rank_kill.py``), a ppe manager whose DISTRIBUTED snapshot extension
(saver rank 0) saves at every iteration and stops, finalizing the extension, at the end of the last one. The
saver's storage (``tests/_failing_fs.py``) fails every write with ENOSPC, or kills the saver with SIGKILL during
the write of the last save: the other rank raises a ``SnapshotAbortedError`` naming rank 0, a
``BackgroundAbortError`` where a background writer wrote (README, "When a rank fails").
"""
from __future__ import annotations

import pytest

import _rank_kill

#: Each test starts two fresh processes (seconds each on a small machine): a thread and a process writer each
#: way of failing (a queue writer in place of one), and a SimpleWriter, whose failure is known at the meeting.
WRITERS = ["ThreadWriter", "ProcessWriter"]
#: The bound within which the other rank raises after the saver was killed: far below the commit timeout
#: (1800 s) that a death not noticed would wait for. It took 10.7 s once, with two test suites on 2 cores.
DEAD_SAVER_BOUND_S = 60.0


def run(tmp_path, writer: str, saves: int, **spec) -> dict:
    return _rank_kill.run_trial({"dir": str(tmp_path), "kind": "distributed", "writer": writer, "saves": saves,
                                 "mib": 4, **spec}, world_size=2)


def abort_type(writer: str) -> str:
    return "SnapshotAbortedError" if writer == "SimpleWriter" else "BackgroundAbortError"


def check_other_rank(record: dict, writer: str, saves: int, *words: str) -> dict:
    """Rank 1 raised the abort naming rank 0 at save ``saves`` (counting from 1); its error."""
    error = record.get("error")
    assert error is not None, f"rank 1 raised nothing: {record}"
    assert error["type"] == abort_type(writer) and "SnapshotAbortedError" in error["classes"], error
    assert "rank 0" in error["message"] and all(w in error["message"] for w in words), error
    assert len(record["saves"]) == saves and "end" not in record["saves"][-1], record
    return error


@pytest.mark.parametrize("writer", ["SimpleWriter", "ThreadWriter", "ProcessQueueWriter"])
def test_the_saver_storage_full_at_the_last_save(tmp_path, writer):
    result = run(tmp_path, writer, 1, failing_rank=0)
    saver = result["ranks"][0]["error"]
    assert saver["type"] == ("OSError" if writer == "SimpleWriter" else "BackgroundSaveError"), saver
    assert "No space left on device" in saver["message"]
    check_other_rank(result["ranks"][1], writer, 1, "No space left on device", "save1")


def test_the_saver_storage_full_is_raised_at_the_next_save(tmp_path):
    """Both ranks raise at the second save: the saver from its writer, the other rank from their meeting."""
    result = run(tmp_path, "ThreadWriter", 3, failing_rank=0)
    saver = result["ranks"][0]
    assert saver["error"]["type"] == "BackgroundSaveError" and len(saver["saves"]) == 2, saver
    check_other_rank(result["ranks"][1], "ThreadWriter", 2, "No space left on device")


@pytest.mark.parametrize("writer", ["ThreadQueueWriter", "ProcessWriter"])
def test_the_saver_killed_during_the_last_save(tmp_path, writer):
    """Killed 1 s into the background write, after the ranks met for the save: the other rank raises at
    finalize()."""
    result = run(tmp_path, writer, 2, victim=0, when="during_write", save=2, delay=1.0)
    killed = result["killed"]
    assert killed is not None and killed["rank"] == 0 and result["ranks"][0] is None, result
    error = check_other_rank(result["ranks"][1], writer, 2, "rank 0 died or lost its connection")
    assert error["time"] - killed["time"] <= DEAD_SAVER_BOUND_S, error["time"] - killed["time"]


@pytest.mark.parametrize("writer", WRITERS)
def test_a_successful_run_ends_cleanly_and_the_other_rank_does_not_wait_for_the_write(tmp_path, writer):
    """The saver's storage takes 2 s more per data file: the other rank's first save returns before that save is
    committed (once it is handed off), and its finalize() (in the last save) once the last save is committed."""
    result = run(tmp_path, writer, 2, slow_write_rank=0, slow_s=2.0)
    for rank, record in result["ranks"].items():
        assert "error" not in record and len(record["saves"]) == 2, record
    assert result["returncodes"] == [0, 0]
    first, last = result["ranks"][1]["saves"]
    assert first["end"] < (tmp_path / "save1" / "manifest.json").stat().st_mtime, first
    assert last["end"] >= (tmp_path / "save2" / "manifest.json").stat().st_mtime, last
