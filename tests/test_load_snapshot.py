"""``load_snapshot`` reads what the command line reads, with the command line's errors (each a SnapshotError
naming the path), and never unpickles without the caller's consent; the engine names a file where a snapshot
directory was expected."""
from __future__ import annotations

import os
import pickle
import re

import pytest
import pytorch_pfn_extras as ppe
import torch
from safetensors.torch import save_file

import ppe_snapshot
from ppe_snapshot import Snapshot, StateDict
from ppe_snapshot.cli import main

from _asserts import assert_same


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))


@pytest.fixture
def trained(tmp_path):
    """A run's engine snapshot after two Adam steps, and the model and optimizer it saved."""
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    manager = ppe.training.ExtensionsManager(model, optimizer, 10, iters_per_epoch=2, out_dir=str(tmp_path / "run"))
    manager.extend(ppe_snapshot.snapshot(), trigger=(2, "iteration"))
    for _ in range(2):
        with manager.run_iteration():
            model(torch.ones(4, 2)).sum().backward()
            optimizer.step()
    return tmp_path / "run" / "snapshot_iter_2", model, optimizer


def test_a_text_file_is_an_unsupported_format(tmp_path):
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(ppe_snapshot.UnsupportedFormatError,
                       match=f"^{tmp_path / 'notes.txt'}: is neither a snapshot directory, a torch.save file nor a "
                             "safetensors file$"):
        ppe_snapshot.load_snapshot(str(tmp_path / "notes.txt"))


def test_a_missing_path_is_snapshot_not_found(tmp_path):
    with pytest.raises(ppe_snapshot.SnapshotNotFoundError,
                       match=f"^{tmp_path / 'nothing'}: no such file or directory$"):
        ppe_snapshot.load_snapshot(str(tmp_path / "nothing"), model=_model())


def test_a_safetensors_file_of_a_model_loads_into_it(tmp_path):
    torch.manual_seed(1)
    model = _model()
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    fresh = _model()
    state = ppe_snapshot.load_snapshot(str(tmp_path / "model.safetensors"), model=fresh)
    assert sorted(state) == sorted(model.state_dict())
    assert_same(fresh.state_dict(), model.state_dict())


def test_a_dcp_directory_converted_from_a_snapshot_loads(trained, tmp_path, capsys):
    snapshot, model, optimizer = trained
    assert main(["convert", "--to", "dcp", str(snapshot), str(tmp_path / "dcp")]) == 0
    fresh = _model()
    fresh_optimizer = torch.optim.Adam(fresh.parameters())
    state = ppe_snapshot.load_snapshot(str(tmp_path / "dcp"), model=fresh, optimizer=fresh_optimizer)
    assert state["_start_iteration"] == 2
    assert_same(fresh.state_dict(), model.state_dict())
    assert_same(fresh_optimizer.state_dict(), optimizer.state_dict())


def test_a_file_needing_pickle_is_refused_without_torch_advice(tmp_path):
    torch.save({"models": {"main": {}}, "odd": pickle.PickleError("x")}, tmp_path / "file.pt")
    with pytest.raises(ppe_snapshot.UnsupportedValueError, match="allow_pickle=True") as raised:
        ppe_snapshot.load_snapshot(str(tmp_path / "file.pt"))
    assert "weights_only" not in str(raised.value) and str(tmp_path / "file.pt") in str(raised.value)
    assert "odd" in ppe_snapshot.load_snapshot(str(tmp_path / "file.pt"), allow_pickle=True)


class _Marker:
    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_a_crafted_dcp_metadata_is_refused_without_running_it(trained, tmp_path, capsys):
    snapshot, _, _ = trained
    assert main(["convert", "--to", "dcp", str(snapshot), str(tmp_path / "dcp")]) == 0
    marker = _Marker()
    marker.path = str(tmp_path / "ran")
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(marker))
    with pytest.raises(ppe_snapshot.CorruptSnapshotError, match="names posix.mkdir, which DCP's metadata is not"):
        ppe_snapshot.load_snapshot(str(tmp_path / "dcp"))
    assert main(["inspect", str(tmp_path / "dcp")]) == 2
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("module", ["pathlib", "pathlib._local"])
def test_a_dcp_metadata_names_its_paths_as_any_python_does(tmp_path, module):
    """torch's own DCP checkpoint keeps its directory as a pathlib path, which Python 3.13 pickles as
    ``pathlib._local.PosixPath`` and earlier versions as ``pathlib.PosixPath``: both load on this Python."""
    import torch.distributed.checkpoint as dcp

    saved = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(tmp_path / "dcp"), no_dist=True)
    metadata_file = tmp_path / "dcp" / ".metadata"
    data = pickle.dumps(pickle.loads(metadata_file.read_bytes()), protocol=2)  # (globals as text lines)
    spelled = re.sub(rb"cpathlib(?:\._local)?\n", b"c" + module.encode() + b"\n", data)
    assert spelled.count(b"c" + module.encode() + b"\nPosixPath\n") >= 1
    metadata_file.write_bytes(spelled)
    assert_same(ppe_snapshot.load_snapshot(str(tmp_path / "dcp")), saved)


def test_take_onto_a_file_is_snapshot_exists(tmp_path):
    (tmp_path / "file").write_text("kept")
    with pytest.raises(ppe_snapshot.SnapshotExistsError, match=f"^{tmp_path / 'file'} is a file; a snapshot is a "
                                                               "directory"):
        Snapshot.take(str(tmp_path / "file"), {"a": StateDict(x=torch.ones(2))})
    assert (tmp_path / "file").read_text() == "kept"


def test_a_file_is_no_snapshot_to_the_engine(tmp_path):
    (tmp_path / "file").write_text("kept")
    with pytest.raises(ppe_snapshot.SnapshotNotFoundError, match=f"^no snapshot at {tmp_path / 'file'}: it is a "
                                                                 "file, not a snapshot directory"):
        Snapshot(str(tmp_path / "file")).get_manifest()


def test_a_model_of_another_dtype_is_a_mismatch_on_every_path(trained, tmp_path):
    """One rule for load_snapshot, restore and autoload: a saved tensor is never cast into a target of another
    dtype; StateMismatchError names the key and both dtypes, and nothing is loaded."""
    snapshot, _, _ = trained
    double = _model().double()
    before = {k: v.clone() for k, v in double.state_dict().items()}
    with pytest.raises(ppe_snapshot.StateMismatchError,
                       match=r"other dtypes \(0\.bias: saved float32, model float64; 0\.weight: saved float32"):
        ppe_snapshot.load_snapshot(str(snapshot), model=double)
    assert_same(double.state_dict(), before)

    manager = ppe.training.ExtensionsManager(double, torch.optim.Adam(double.parameters()), 10, iters_per_epoch=2,
                                             out_dir=str(snapshot.parent))
    manager.extend(ppe_snapshot.snapshot(autoload=True), trigger=(2, "iteration"))
    with pytest.raises(ppe_snapshot.StateMismatchError, match=r"state/models/main/0\.weight: the snapshot holds a "
                       r"tensor of shape \[3, 2\] and dtype float32, but the restore target has shape \[3, 2\] and "
                       r"dtype float64"):
        manager.start_extensions()
    assert_same(double.state_dict(), before)
