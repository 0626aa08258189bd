"""The command line on run directories and its edges: ``prune --keep-best`` with a key no snapshot recorded, ``ls`` on
a snapshot and on an object store it cannot reach, output to a pipe that closes early, ``convert`` without ``--to``."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppe_snapshot import RNGState, Snapshot, StateDict
from ppe_snapshot.cli import main
from ppe_snapshot.retention import METRICS_KEY

ROOT = Path(__file__).resolve().parent.parent


def _losses(run: Path, losses: dict[int, float], key: str = "val/loss") -> None:
    for iteration, loss in losses.items():
        Snapshot.take(str(run / f"snapshot_iter_{iteration}"), {"s": StateDict(x=torch.ones(1))},
                      metadata={"iteration": iteration, METRICS_KEY: {key: loss}})


def _names(run: Path) -> list[str]:
    return sorted(os.listdir(run))


def test_prune_refuses_a_key_no_snapshot_recorded(tmp_path, capsys):
    _losses(tmp_path, {10: 0.9, 20: 0.3, 30: 0.5})
    for dry_run in ([], ["--dry-run"]):
        assert main(["prune", str(tmp_path), "--keep-best", "bogus", *dry_run]) == 2
        err = capsys.readouterr().err
        assert err == (f"ppe-snapshot: --keep-best 'bogus': none of the 3 snapshots in {tmp_path} recorded a value "
                       "of 'bogus' (they record 'val/loss'); nothing removed\n")
    assert _names(tmp_path) == ["snapshot_iter_10", "snapshot_iter_20", "snapshot_iter_30"]


def test_prune_keep_best_spellings_match_the_help(tmp_path, capsys):
    _losses(tmp_path, {10: 0.9, 20: 0.3, 30: 0.5})
    with pytest.raises(SystemExit, match="0"):
        main(["prune", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--keep-best KEY[:N][:min|max]" in help_text and "keep the N snapshots (default 1)" in help_text
    # KEY alone: N = 1, min
    assert main(["prune", str(tmp_path), "--keep-best", "val/loss", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would remove" in out and "snapshot_iter_10\n" in out and "snapshot_iter_20\n" not in out
    # KEY:max: N = 1, the highest
    assert main(["prune", str(tmp_path), "--keep-best", "val/loss:max", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "snapshot_iter_20\n" in out and "snapshot_iter_10\n" not in out
    assert main(["prune", str(tmp_path), "--keep-best", "val/loss:x"]) == 2
    assert "expected KEY[:N][:min|max]" in capsys.readouterr().err
    assert _names(tmp_path) == ["snapshot_iter_10", "snapshot_iter_20", "snapshot_iter_30"]


def test_prune_says_which_snapshots_lack_the_key_in_one_line(tmp_path, capsys):
    _losses(tmp_path, {10: 0.9, 20: 0.3})
    _losses(tmp_path, {30: 0.5}, key="train/loss")
    assert main(["prune", str(tmp_path), "--keep-best", "val/loss", "--keep-latest", "1"]) == 0
    err = capsys.readouterr().err
    assert err == ("ppe-snapshot: warning: KeepBest('val/loss'): 1 snapshot(s) have no recorded value of 'val/loss' "
                   "(e.g. snapshot_iter_30) and are not candidates for it\n")
    assert _names(tmp_path) == ["snapshot_iter_20", "snapshot_iter_30"]
