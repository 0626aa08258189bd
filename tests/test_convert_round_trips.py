"""Conversions of a real training run's snapshots with the command line, read back the way their users read them:
a DCP round trip that autoload resumes from, bit-exactly."""
from __future__ import annotations

import shutil

import pytorch_pfn_extras as ppe
import torch

import ppe_snapshot
from ppe_snapshot.cli import main

from _asserts import assert_same

ITERATIONS = 4


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def _run(out_dir, iterations: int = ITERATIONS):
    """A manager with Adam (its state keyed by ints) and an autoloading snapshot extension (whose state holds
    empty dicts), trained to ``iterations``."""
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    manager = ppe.training.ExtensionsManager(model, optimizer, 100, iters_per_epoch=2, out_dir=str(out_dir),
                                             stop_trigger=(iterations, "iteration"))
    manager.extend(ppe_snapshot.snapshot(autoload=True), trigger=(2, "iteration"))
    manager.start_extensions()
    while not manager.stop_trigger:
        with manager.run_iteration():
            model(torch.randn(4, 3)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    return manager, model, optimizer


def test_a_dcp_round_trip_keeps_what_autoload_needs(tmp_path, capsys):
    _run(tmp_path / "run")
    original = tmp_path / "run" / f"snapshot_iter_{ITERATIONS}"
    assert main(["convert", "--to", "dcp", str(original), str(tmp_path / "dcp")]) == 0
    assert main(["convert", "--to", "snapshot", str(tmp_path / "dcp"), str(tmp_path / "back")]) == 0
    assert "not written: rng" in capsys.readouterr().err  # the one thing DCP does not hold, named

    back = ppe_snapshot.Snapshot(str(tmp_path / "back"))
    saved = ppe_snapshot.Snapshot(str(original)).read_object("0/state")
    assert_same(back.read_object("0/state"), saved)  # empty dicts, int keys, order: all as saved
    assert back.metadata == ppe_snapshot.Snapshot(str(original)).metadata

    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "back", resumed_dir / f"snapshot_iter_{ITERATIONS}")
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    shutil.copytree(original, reference_dir / original.name)
    resumed = _run(resumed_dir, ITERATIONS)
    reference = _run(reference_dir, ITERATIONS)
    assert resumed[0].iteration == reference[0].iteration == ITERATIONS
    assert_same(resumed[1].state_dict(), reference[1].state_dict(), "model")
    assert_same(resumed[2].state_dict(), reference[2].state_dict(), "optimizer")
    assert list(resumed[2].state_dict()["state"]) == [0, 1, 2, 3]
