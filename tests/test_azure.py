"""Azure Blob storage (``az://``, adlfs) against Azurite on 127.0.0.1: the engine round trip, and retention."""
from __future__ import annotations

import fsspec
import pytest
import pytorch_pfn_extras as ppe
import torch

import ppe_snapshot
from ppe_snapshot import Snapshot, StateDict, writing


def _names(url: str, storage_options: dict) -> list[str]:
    """The run directory's entries, as a fresh client sees them."""
    fs = fsspec.filesystem("az", skip_instance_cache=True, **storage_options)
    return sorted(path.rstrip("/").rsplit("/", 1)[-1] for path in fs.ls(url.removeprefix("az://")))


def test_take_and_restore_round_trip(az_container):
    url, options = az_container
    state = {"m": StateDict(w=torch.randn(1000, 100), step=7)}
    Snapshot.take(f"{url}/snap", state, storage_options=options)
    out = {"m": StateDict(w=torch.zeros(1000, 100), step=0)}
    Snapshot(f"{url}/snap", storage_options=options).restore(out)
    assert torch.equal(out["m"]["w"], state["m"]["w"]) and out["m"]["step"] == 7
    Snapshot(f"{url}/snap", storage_options=options).verify()


@pytest.mark.parametrize("kind", ["SimpleWriter", "ThreadWriter"])
def test_retention_removes_old_snapshots(az_container, kind, tmp_path, monkeypatch):
    """adlfs answers a listing from its cache, whatever refresh=True says: retention saw the first snapshot only
    and removed nothing (4 saves left 4 snapshots)."""
    monkeypatch.chdir(tmp_path)  # ppe's manager makes its out_dir locally too; kept out of the repository
    url, options = az_container
    out = f"{url}/run"
    model = torch.nn.Linear(2, 2)
    manager = ppe.training.ExtensionsManager(model, torch.optim.SGD(model.parameters(), lr=0.1), 10,
                                             iters_per_epoch=4, out_dir=out)
    writer = getattr(writing, kind)(out_dir=out, storage_options=options)
    manager.extend(ppe_snapshot.snapshot(writer=writer, n_retains=2), trigger=(1, "iteration"))
    for _ in range(4):
        with manager.run_iteration():
            pass
    writer.finalize()
    assert _names(out, options) == ["snapshot_iter_3", "snapshot_iter_4"]
