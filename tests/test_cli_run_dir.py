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

import _warm

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


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "ppe_snapshot.cli", *args]


ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def test_output_into_a_pipe_that_closes_early_ends_quietly(tmp_path):
    """``diff a b | head -4``: the diff outlasts head (more than a pipe's buffer), exits 141 and says nothing."""
    for name, value in (("a", 0.0), ("b", 1.0)):
        Snapshot.take(str(tmp_path / name), {"s": StateDict({f"layer{i}.weight": torch.full((2,), value)
                                                             for i in range(5000)})})
    script = f"{' '.join(_command('diff', str(tmp_path / 'a'), str(tmp_path / 'b')))} 2>{tmp_path / 'err'} | head -4"
    done = subprocess.run(["bash", "-c", f"{script}; echo \"exit ${{PIPESTATUS[0]}}\""], capture_output=True,
                          text=True, env=ENV, timeout=300)
    lines = done.stdout.splitlines()
    assert len(lines) == 5 and all(line.startswith("differs:") for line in lines[:4]), done.stdout
    assert lines[4] == "exit 141" and (tmp_path / "err").read_text() == ""
    # a reader gone before the first byte: the same
    process = _warm.popen(_command("ls", str(tmp_path)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    process.stdout.close()
    assert process.stderr.read() == b"" and process.wait(timeout=300) == 141
    process.stderr.close()


def test_ls_of_one_snapshot_lists_it_and_says_what_it_is(tmp_path, capsys):
    _losses(tmp_path, {10: 0.9})
    snapshot = tmp_path / "snapshot_iter_10"
    assert main(["ls", str(snapshot)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"{snapshot} is one snapshot, not a run directory: listed alone ('ppe-snapshot inspect "
                      f"{snapshot}' shows its entries; 'ppe-snapshot ls DIR' lists the snapshots in DIR)")
    assert out[1].split()[:3] == ["NAME", "KIND", "ITERATION"]
    assert out[2].split()[:3] == ["snapshot_iter_10", "snapshot", "10"] and out[2].endswith("complete")
    assert len(out) == 3  # not the one autoload resumes from: no run directory, no mark
    torch.save({"x": torch.ones(1)}, tmp_path / "model.pt")
    assert main(["ls", str(tmp_path / "model.pt")]) == 0
    assert capsys.readouterr().out.splitlines()[2].split()[:2] == ["model.pt", "ppe-file"]
    assert main(["ls", str(tmp_path / "empty")]) == 2  # still: a missing path is an error
    (tmp_path / "empty").mkdir()
    assert main(["ls", str(tmp_path / "empty")]) == 0
    assert capsys.readouterr().out == f"no snapshots in {tmp_path / 'empty'}\n"


def test_ls_lists_ppes_per_rank_files_and_the_one_snapshot_commands_point_to_a_rank(tmp_path, capsys):
    for i in (2, 4):  # what SHARDED mode with a savefun writes, as ppe does
        (tmp_path / f"snapshot_iter_{i}").mkdir()
        for rank in (0, 1):
            torch.save({"_start_iteration": i, "models": {}}, tmp_path / f"snapshot_iter_{i}" / str(rank))
        torch.save({}, tmp_path / f"snapshot_iter_{i}" / "complete")
    assert main(["ls", str(tmp_path)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:3]]
    assert [row[:3] for row in rows] == [["snapshot_iter_2", "ppe-rank-files", "2"],
                                         ["*", "snapshot_iter_4", "ppe-rank-files"]]
    assert rows[0][-1] == rows[1][-1] == "complete"
    for command in ("inspect", "verify"):
        assert main([command, str(tmp_path / "snapshot_iter_4")]) == 2
        assert capsys.readouterr().err.strip() == (
            f"ppe-snapshot: {tmp_path / 'snapshot_iter_4'}: holds ppe's per-rank files of a SHARDED run (a "
            f"torch.save file per rank): give one rank's file, e.g. {tmp_path / 'snapshot_iter_4'}/0")
    assert main(["inspect", str(tmp_path / "snapshot_iter_4" / "1")]) == 0
    assert "0/state/_start_iteration: value 4" in capsys.readouterr().out


def test_ls_of_a_bucket_without_credentials_names_the_url_and_what_to_do(monkeypatch, capsys):
    pytest.importorskip("s3fs", reason="s3fs is not installed (make venv installs it)")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert main(["ls", "s3://nobucket/run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ppe-snapshot: s3://nobucket/run: NoCredentialsError: Unable to locate credentials; set "
                          "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    assert "--storage-option key=... --storage-option secret=..." in err and err.count("\n") == 1


def test_convert_without_to_refuses_a_destination_that_names_no_format(tmp_path, capsys):
    snapshot = tmp_path / "snapshot_iter_10"
    Snapshot.take(str(snapshot), {"state": StateDict(w=torch.arange(4.0)), "rng": StateDict({0: RNGState().state_dict()})})
    assert main(["convert", str(snapshot), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == (f"ppe-snapshot: {tmp_path / 'out'}: say which format to write with --to "
                   "{snapshot,torch,dcp,safetensors} (snapshot keeps everything, RNG states included; torch: a "
                   "torch.save file as ppe writes; dcp: torch's DCP format; safetensors: tensors only); without --to "
                   "only a .pt/.pth/.pkl or .safetensors name chooses the format\n")
    assert not (tmp_path / "out").exists()
    # a name that states the format is enough; what it cannot hold is named
    assert main(["convert", str(snapshot), str(tmp_path / "out.pt")]) == 0
    assert "not written: 0/rng" in capsys.readouterr().err
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True)["w"], torch.arange(4.0))
    assert main(["convert", "--to", "snapshot", str(tmp_path / "out.pt"), str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "manifest.json").exists()
