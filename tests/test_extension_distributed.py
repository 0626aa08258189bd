"""The snapshot extension on real gloo groups: DISTRIBUTED and SHARDED modes."""
from __future__ import annotations

import json
import os

import pytest
import torch

from ppe_snapshot import Snapshot

from _extension_workers import (
    assert_same, dist_crash_and_resume, dist_default_names, dist_error_on_one_rank, dist_fixed_name_and_initialize, dist_rank_file_failing,
    dist_rank_files, dist_resume_from_error_snapshot, dist_saver_rank_out_of_range, dist_staging_ahead,
)

ITERS = 10


def test_saver_rank_out_of_range(dist_run):
    assert dist_run(dist_saver_rank_out_of_range, 2) == [
        "Distributed snapshot requires a saver rank in the range [0-2); got saver_rank=2"] * 2


@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_saver_writes_every_rank_resumes(dist_run, tmp_path, world_size):
    results = dist_run(dist_crash_and_resume, world_size, str(tmp_path), "DISTRIBUTED", ITERS, 7)
    for rank, r in enumerate(results):
        # state_dict() ran on every rank at each of the 3 snapshots: it is a collective, anything else hangs.
        assert r["state_dict_calls"] == 3
        assert r["names_at_crash"] == ["snapshot_iter_4", "snapshot_iter_6"]  # n_retains=2
        assert r["saved_ranks"] == [0]  # one process wrote it
        assert r["resumed_at"] == 6 and r["resumed_from"] == os.path.join(str(tmp_path), "snapshot_iter_6")
        if rank != world_size - 1:  # every rank got the saver rank's log (its losses) back
            r["straight"].pop("log"), r["resumed"].pop("log")
        assert_same(r["resumed"], r["straight"], f"rank {rank}")
        assert_same(r["resumed"]["model"], results[0]["resumed"]["model"])  # replicated
    assert results[0]["names_at_end"] == ["snapshot_iter_8", "snapshot_iter_10"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_one_snapshot_every_rank_resumes_its_part(dist_run, tmp_path, world_size):
    results = dist_run(dist_crash_and_resume, world_size, str(tmp_path), "SHARDED", ITERS, 7)
    for rank, r in enumerate(results):
        assert r["saved_ranks"] == list(range(world_size))  # one manifest holding every rank's part
        assert r["names_at_crash"] == ["snapshot_iter_4", "snapshot_iter_6"]
        assert r["resumed_at"] == 6
        assert_same(r["resumed"], r["straight"], f"rank {rank}")
    assert not torch.equal(results[0]["resumed"]["model"]["fc1.weight"], results[1]["resumed"]["model"]["fc1.weight"])
    assert sorted(os.listdir(tmp_path / "snapshot_iter_10" / "data")) == [f"rank{r}.bin" for r in range(world_size)]
    assert results[0]["names_at_end"] == ["snapshot_iter_8", "snapshot_iter_10"]


@pytest.mark.parametrize("mode", ["DISTRIBUTED", "SHARDED"])
def test_incremental_snapshots_resume_every_rank(dist_run, tmp_path, mode):
    """incremental=True: each rank's writer references its own earlier blocks; the resumed run continues exactly."""
    results = dist_run(dist_crash_and_resume, 2, str(tmp_path), mode, ITERS, 7, None, False, True)
    for rank, r in enumerate(results):
        assert r["resumed_at"] == 6 and r["names_at_crash"] == ["snapshot_iter_4", "snapshot_iter_6"]
        if mode == "DISTRIBUTED" and rank != 1:  # the log restored is the saver rank's
            r["straight"].pop("log"), r["resumed"].pop("log")
        assert_same(r["resumed"], r["straight"], f"rank {rank}")
    assert results[0]["names_at_end"] == ["snapshot_iter_8", "snapshot_iter_10"]
    assert results[0]["references"]  # the last snapshot reads blocks of earlier ones
    assert json.loads((tmp_path / "snapshot_iter_10" / "manifest.json").read_text())["version"] == 3


@pytest.mark.parametrize("mode", ["DISTRIBUTED", "SHARDED"])
def test_each_rank_resumes_its_own_rng_stream(dist_run, tmp_path, mode):
    """No RNGState in the target and different random streams per rank: the extension saves and
    restores every rank's generators (DISTRIBUTED: gathered to the saver), so each rank's dropout
    continues exactly."""
    results = dist_run(dist_crash_and_resume, 2, str(tmp_path), mode, ITERS, 7, None, True)
    for rank, r in enumerate(results):
        assert r["resumed_at"] == 6
        if mode == "DISTRIBUTED" and rank == 0:  # the log restored is the saver rank's
            r["straight"].pop("log"), r["resumed"].pop("log")
        assert_same(r["resumed"], r["straight"], f"rank {rank}")
    assert not torch.equal(results[0]["straight"]["rng"], results[1]["straight"]["rng"])


@pytest.mark.parametrize("mode, damaged", [("SHARDED", "data/rank1.bin"), ("DISTRIBUTED", "data/rank0.bin")])
def test_ranks_fall_back_together_when_one_cannot_restore(dist_run, tmp_path, mode, damaged, capfd):
    # A flipped byte passes the size checks; only rank 1 (SHARDED) or every rank (DISTRIBUTED) sees the
    # checksum fail while restoring, and all ranks must agree on the older snapshot.
    results = dist_run(dist_crash_and_resume, 2, str(tmp_path), mode, ITERS, 7, damaged)
    for rank, r in enumerate(results):
        assert r["resumed_at"] == 4 and r["resumed_from"] == os.path.join(str(tmp_path), "snapshot_iter_4")
        if mode == "DISTRIBUTED" and rank == 0:  # the log restored is the saver rank's
            r["straight"].pop("log"), r["resumed"].pop("log")
        assert_same(r["resumed"], r["straight"], f"rank {rank}")
    out = capfd.readouterr()
    assert "skipping snapshot" in out.err and "snapshot_iter_6" in out.err and "checksum" in out.err


@pytest.mark.parametrize("mode", ["SHARDED", "DISTRIBUTED"])
def test_ranks_fall_back_together_from_a_snapshot_recording_another_iteration(dist_run, tmp_path, mode, capfd):
    """snapshot_iter_6's manifest records iteration 100: every rank restores it, finds its manager at 6, and all
    fall back to snapshot_iter_4 together (trusted, it would outrank every later save, and n_retains remove them)."""
    results = dist_run(dist_crash_and_resume, 2, str(tmp_path), mode, ITERS, 7, None, False, False, 100)
    for rank, r in enumerate(results):
        assert r["resumed_at"] == 4 and r["resumed_from"] == os.path.join(str(tmp_path), "snapshot_iter_4")
        if mode == "DISTRIBUTED" and rank == 0:  # the log restored is the saver rank's
            r["straight"].pop("log"), r["resumed"].pop("log")
        assert_same(r["resumed"], r["straight"], f"rank {rank}")
        assert r["names_at_end"] == [f"snapshot_iter_{ITERS - 2}", f"snapshot_iter_{ITERS}"]
    assert "it is listed at iteration 100 (what it records, or its name), but the state it holds is at iteration 6" \
        in capfd.readouterr().err


@pytest.mark.parametrize("mode, failing", [("DISTRIBUTED", 1), ("DISTRIBUTED", 0), ("SHARDED", 1)])
def test_snapshot_on_error_does_not_hang_the_other_ranks(dist_run, tmp_path, mode, failing):
    results = dist_run(dist_error_on_one_rank, 2, str(tmp_path), mode, failing, timeout=90)
    assert [r["raised"] for r in results] == [None if rank != failing else "crash after 5 iterations"
                                              for rank in range(2)]
    listing = results[0]["listing"]
    model = results[failing]["model"]
    if mode == "DISTRIBUTED" and failing == 1:  # the saver rank failed: it saved the whole state alone
        assert [n for n in listing if n.startswith("snapshot")] == ["snapshot_iter_4", "snapshot_iter_5"]
        saved = Snapshot(str(tmp_path / "snapshot_iter_5")).read_object("0/state/models/main")
        assert_same(saved, model)
        assert [r["resumed_at"] for r in results] == [5, 5]
    elif mode == "DISTRIBUTED":  # another rank failed: only the saver writes, so nothing is added
        assert [n for n in listing if n.startswith("snapshot")] == ["snapshot_iter_4"]
        assert [r["resumed_at"] for r in results] == [4, 4]
    else:  # SHARDED: the failing rank saved its own part alone, which autoload leaves aside
        assert [n for n in listing if n.startswith("snapshot")] == ["snapshot_iter_4", "snapshot_iter_5.error-rank1"]
        error_snapshot = Snapshot(str(tmp_path / "snapshot_iter_5.error-rank1"))
        assert sorted({k.split("/")[0] for k in error_snapshot.get_manifest()}) == ["0"]
        assert_same(error_snapshot.read_object("0/state/models/main"), model)
        assert [r["resumed_at"] for r in results] == [4, 4]


def test_resume_from_a_distributed_error_snapshot_restores_every_rank_rng(dist_run, tmp_path):
    results = dist_run(dist_resume_from_error_snapshot, 2, str(tmp_path), ITERS, 7)
    for rank, r in enumerate(results):
        assert r["names"] == ["snapshot_iter_7"]  # taken on error by the saver rank, which holds its RNG alone
        assert r["resumed_from"] == os.path.join(str(tmp_path), "snapshot_iter_7")
        if rank == 0:  # the log restored is the saver rank's
            r["straight"].pop("log"), r["resumed"].pop("log")
        assert_same(r["resumed"], r["straight"], f"rank {rank}")


@pytest.mark.parametrize("mode, writer", [("DISTRIBUTED", "ThreadWriter"), ("SHARDED", "ThreadWriter"),
                                          ("SHARDED", "SimpleWriter")])
def test_fixed_name_replaced_and_initialize_returns_the_name_on_every_rank(dist_run, tmp_path, mode, writer):
    results = dist_run(dist_fixed_name_and_initialize, 2, str(tmp_path), mode, writer)
    for rank, r in enumerate(results):
        assert r["listing"] == ["latest"]  # replaced at every trigger; nothing left beside it
        assert ".parts" not in r["kept"], r["kept"]  # a committed snapshot keeps nothing of its take
        assert r["loaded"] == "latest" and r["resumed_from"] == os.path.join(str(tmp_path), "latest")
        assert r["iteration"] == 5
        assert_same(r["resumed_model"], r["model"], f"rank {rank}")
    assert Snapshot(str(tmp_path / "latest")).metadata["iteration"] == 5


@pytest.mark.parametrize("writer", ["SimpleWriter", "ThreadWriter", "ProcessWriter"])
def test_a_rank_that_learns_of_the_commit_late_leaves_the_replacing_snapshot_alone(dist_run, tmp_path, writer):
    """SHARDED saves replacing ``latest``, rank 1 learning of each commit 0.3 s late: rank 0 has moved the take to
    its name and is removing the one it replaced, at the name the take was written at. Every save succeeds on both
    ranks, and ``latest`` holds nothing of its take's records: rank 1 must not remove its record there (its removal
    raced rank 0's, which then failed) nor leave it in ``latest``."""
    results = dist_run(dist_fixed_name_and_initialize, 2, str(tmp_path), "SHARDED", writer, 1)
    for rank, r in enumerate(results):
        assert r["listing"] == ["latest"] and ".parts" not in r["kept"], r["kept"]
        assert r["loaded"] == "latest" and r["iteration"] == 5
        assert_same(r["resumed_model"], r["model"], f"rank {rank}")


@pytest.mark.parametrize("mode", ["DISTRIBUTED", "SHARDED"])
def test_the_writing_ranks_staging_is_made_ready_before_their_first_save(dist_run, tmp_path, mode):
    """Every rank that writes has its writer make the staging memory ready at initialize() for the model, and
    after the first optimizer step for the model and Adam's state, sized from the tensors it holds (state_dict()
    is a collective in these modes: not called outside a save); the save then stages into a buffer that fits. A
    DISTRIBUTED rank that writes nothing prepares nothing."""
    weights = (512 * 256 + 256) * 4
    results = dist_run(dist_staging_ahead, 2, str(tmp_path), mode)
    for rank, r in enumerate(results):
        if mode == "DISTRIBUTED" and rank != 1:  # the saver is the last rank
            assert r["prepared"] == [] and r["staged"] is None, r
            continue
        assert r["prepared"] == [weights, 3 * weights + 8], r  # Adam: exp_avg, exp_avg_sq and a 4-byte step each
        assert r["buffer"] >= r["staged"] > 3 * weights, r


def test_the_modes_extensions_carry_ppes_names_in_the_managers_state(dist_run):
    """The manager keys each extension's state by its name: ppe's snapshots and ours restore each other's managers."""
    assert dist_run(dist_default_names, 1) == [[("_DistributedSnapshot", "_DistributedSnapshot"),
                                                ("_ShardedSnapshot", "_ShardedSnapshot"), ("Mine", "Mine")]]


# -- SHARDED with a savefun: ppe's per-rank files ------------------------------------------------------------------
def _rank_files(*iterations: int) -> list[str]:
    return [f"snapshot_iter_{i}/{f}" for i in iterations for f in ("0", "1", "complete")]


@pytest.mark.parametrize("first, second, writer", [("ours", "ours", None), ("ours", "ours", "ThreadWriter"),
                                                   ("ppe", "ours", None), ("ours", "ppe", None)])
def test_sharded_savefun_keeps_ppes_per_rank_files(dist_run, tmp_path, first, second, writer):
    """ppe's layout: <name>/<rank> per rank and <name>/complete; either extension resumes from the other's."""
    results = dist_run(dist_rank_files, 2, str(tmp_path), first, second, writer)
    for rank, r in enumerate(results):
        assert r["at_crash"] == _rank_files(2, 4)  # n_retains=2
        assert r["resumed"]["resumed_at"] == 4
        assert r["at_end"] == _rank_files(6, 8)
        assert_same(r["resumed"]["model"], r["straight"]["model"], f"rank {rank}")
        assert_same(r["resumed"]["optimizer"], r["straight"]["optimizer"], f"rank {rank}")
    assert not torch.equal(results[0]["resumed"]["model"]["weight"], results[1]["resumed"]["model"]["weight"])


@pytest.mark.parametrize("first, second", [("ppe", "ours"), ("ours", "ppe")])
def test_distributed_savefun_files_resume_across_ppe_and_ours(dist_run, tmp_path, first, second):
    """ppe's DISTRIBUTED single files restore our manager and ours restore ppe's (the extension's state is keyed by
    ppe's name)."""
    results = dist_run(dist_rank_files, 2, str(tmp_path), first, second, None, None, "DISTRIBUTED")
    assert [r["at_crash"] for r in results] == [["snapshot_iter_2", "snapshot_iter_4"]] * 2
    assert [r["resumed"]["resumed_at"] for r in results] == [4, 4]
    assert_same(results[0]["resumed"]["model"], results[0]["straight"]["model"])  # the saver's state


@pytest.mark.parametrize("damage", ["unmarked", "ranks"])
def test_sharded_savefun_falls_back_past_unmarked_or_other_world_files(dist_run, tmp_path, damage):
    results = dist_run(dist_rank_files, 2, str(tmp_path), "ours", "ours", None, damage)
    why = {"unmarked": "it has no manifest.json", "ranks": "it holds ppe's per-rank files of 3 ranks and this run "
                                                            "has 2; each rank's file restores only into the same rank"}
    for r in results:
        assert r["resumed"]["resumed_at"] == 2  # the older snapshot
        assert len(r["skipped"]) == 1 and "snapshot_iter_4" in r["skipped"][0] and why[damage] in r["skipped"][0]
        assert r["at_end"] == _rank_files(6, 8)  # the skipped one was pruned with the others


def test_sharded_savefun_failing_on_one_rank_raises_on_every_rank_and_marks_nothing(dist_run, tmp_path):
    results = dist_run(dist_rank_file_failing, 2, str(tmp_path))
    assert results[1]["raised"] == "KeyError: \"rank 1's disk is gone\""
    assert results[0]["raised"] == ("SnapshotAbortedError: snapshot snapshot_iter_2: rank 1: KeyError: "
                                    "\"rank 1's disk is gone\"")
    assert all("snapshot_iter_2/complete" not in r["left"] for r in results)
    assert "snapshot_iter_2/0" in results[0]["left"]
