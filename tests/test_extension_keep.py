"""snapshot(keep=POLICY): KeepBest reading a value an extension of higher priority reports, recorded in the
snapshot's metadata; unions with n_retains; retention at start (after autoload); every writer kind."""
from __future__ import annotations

import os
import warnings

import pytest

import ppe_snapshot
from ppe_snapshot import Snapshot
from ppe_snapshot.retention import METRICS_KEY, KeepBest, KeepEvery, KeepLatest

from _dist import dist_run
from _extension_workers import Run, flip_byte, make_writer, snapshot_names
from _keep_workers import ValReporter, dist_keep_best


def _iterations(out_dir: str) -> list[int]:
    return [int(n[len("snapshot_iter_"):]) for n in snapshot_names(out_dir)]


@pytest.mark.parametrize("writer", ["SimpleWriter", "ThreadWriter", "ProcessWriter"])
def test_keep_best_with_n_retains_records_the_observed_value(tmp_path, writer):
    out = str(tmp_path)
    run = Run(out, 10, {"writer": make_writer(writer, out_dir=out), "n_retains": 1, "keep": KeepBest("val/loss")})
    run.manager.extend(ValReporter())
    assert run.snapshot.policy == KeepLatest(1) | KeepBest("val/loss")
    run.train()
    assert _iterations(out) == [6, 10]
    assert Snapshot(os.path.join(out, "snapshot_iter_6")).metadata[METRICS_KEY] == {"val/loss": 0.5}
    assert Snapshot(os.path.join(out, "snapshot_iter_10")).metadata[METRICS_KEY] == {"val/loss": 4.5}


def test_keep_best_without_the_value_warns_once_and_keeps_the_latest(tmp_path):
    out = str(tmp_path)
    run = Run(out, 10, {"writer": make_writer("SimpleWriter", out_dir=out), "keep": KeepBest("val/loss", n=2)})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run.train()
    messages = [str(w.message) for w in seen]
    # the extension's at the first save without it, and the policy's when it first prunes: once each
    assert len([m for m in messages
                if "has no number for ['val/loss']" in m and "not candidates for KeepBest" in m]) == 1
    assert len([m for m in messages if "have no recorded value of 'val/loss'" in m]) == 1
    assert _iterations(out) == [10]  # no candidate: only the newest is kept
    assert METRICS_KEY not in Snapshot(os.path.join(out, "snapshot_iter_10")).metadata


def test_keep_every_by_epoch_in_a_training_run(tmp_path):
    out = str(tmp_path)  # 4 iterations an epoch, a snapshot every 2: milestones at epochs 0 (iter 2), 2, 4
    run = Run(out, 18, {"writer": make_writer("SimpleWriter", out_dir=out), "keep": KeepEvery(2, unit="epoch")})
    run.train()
    assert _iterations(out) == [2, 8, 16, 18]


@pytest.mark.parametrize("writer", ["SimpleWriter", "ThreadWriter", "ProcessWriter"])
def test_retention_runs_at_start_after_autoload(tmp_path, writer):
    out = str(tmp_path)
    Run(out, 10, {"writer": make_writer("SimpleWriter", out_dir=out)}).train()  # no retention: 2, 4, .., 10
    assert _iterations(out) == [2, 4, 6, 8, 10]
    flip_byte(os.path.join(out, "snapshot_iter_10", "data", "rank0.bin"))  # only the checksums (autoload) tell
    resumed = Run(out, 20, {"writer": make_writer(writer, out_dir=out), "autoload": True, "n_retains": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # autoload's warning about the damaged snapshot 10
        resumed.manager.start_extensions()
    assert resumed.manager.iteration == 8 and resumed.snapshot.resumed_name == "snapshot_iter_8"
    # the resumed one is kept (the newest good one), the damaged newer one is left until saved again
    assert _iterations(out) == [8, 10]
    resumed.train()
    assert _iterations(out) == [20]


def test_keep_must_be_a_policy_and_needs_a_format_filename():
    with pytest.raises(TypeError, match="keep must be a retention policy"):
        ppe_snapshot.snapshot(keep=3)
    with pytest.raises(ValueError, match="keep needs filename to be a format string"):
        ppe_snapshot.snapshot(filename=lambda m: "x", keep=KeepLatest(1))
    assert ppe_snapshot.snapshot_object(object(), "m_{.iteration}", keep=KeepLatest(2)).policy == KeepLatest(2)


@pytest.mark.parametrize("mode", ["DISTRIBUTED", "SHARDED"])
def test_keep_best_across_ranks(tmp_path, mode):
    results = dist_run(dist_keep_best, 2, str(tmp_path), mode)
    assert results == [{"names": ["snapshot_iter_6", "snapshot_iter_10"], "metrics": {"val/loss": 0.5}}] * 2
