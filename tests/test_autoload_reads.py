"""Autoload reads each snapshot's manifest and index files at most once: listing, choosing, restoring the target
and the RNG state, and the start-up pruning share what the listing read."""
from __future__ import annotations

import collections
import os

import pytorch_pfn_extras as ppe
import torch

import ppe_snapshot
from ppe_snapshot.storage import LocalStorage


def _manager(out_dir: str, iterations: int):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ppe.training.ExtensionsManager(model, optimizer, 100, iters_per_epoch=2, out_dir=out_dir,
                                             stop_trigger=(iterations, "iteration"))
    manager.extend(ppe_snapshot.snapshot(n_retains=5, autoload=True), trigger=(1, "iteration"))
    return manager, model, optimizer


def _train(manager, model, optimizer) -> None:
    while not manager.stop_trigger:
        with manager.run_iteration():
            model(torch.ones(4, 3)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()


def test_an_autoload_over_five_snapshots_reads_each_manifest_and_index_once(tmp_path, monkeypatch):
    out = str(tmp_path)
    manager, model, optimizer = _manager(out, 5)
    _train(manager, model, optimizer)
    assert sorted(os.listdir(out)) == [f"snapshot_iter_{i}" for i in range(1, 6)]

    reads: collections.Counter = collections.Counter()
    read_bytes = LocalStorage.read_bytes

    def counted(self, rel):
        reads[(os.path.basename(self.root), rel)] += 1
        return read_bytes(self, rel)

    monkeypatch.setattr(LocalStorage, "read_bytes", counted)
    manager, model, optimizer = _manager(out, 6)
    manager.start_extensions()  # autoload, then the start-up pruning
    assert manager.iteration == 5  # resumed from snapshot_iter_5
    manifests = {name for name, rel in reads if rel == "manifest.json"}
    assert manifests == {f"snapshot_iter_{i}" for i in range(1, 6)}, reads  # every one listed (checked) once ...
    assert max(reads.values()) == 1, reads  # ... and no file read twice
    newest = {rel for name, rel in reads if name == "snapshot_iter_5"}
    assert any(rel != "manifest.json" for rel in newest), newest  # the resumed one's index was read, once


def test_a_listing_holds_at_most_the_newest_snapshot_open(tmp_path):
    """A run directory of many snapshots is never held in memory at once: only the newest candidate keeps the
    snapshot its check opened, and only when asked (autoload restores from it)."""
    from ppe_snapshot.retention import list_snapshots
    for i in (3, 1, 2):  # listed in name order, not in the order of their positions
        ppe_snapshot.Snapshot.take(str(tmp_path / f"snapshot_iter_{i}"), {"s": ppe_snapshot.StateDict(x=torch.ones(2))},
                                   metadata={"iteration": i})
    listed = list_snapshots(str(tmp_path), "snapshot_iter_{.iteration}", keep_newest_open=True)
    assert [(c.name, c.snapshot is not None) for c in listed] == [
        ("snapshot_iter_1", False), ("snapshot_iter_2", False), ("snapshot_iter_3", True)]
    assert all(c.snapshot is None for c in list_snapshots(str(tmp_path), "snapshot_iter_{.iteration}"))
