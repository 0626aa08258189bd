"""What the engine says when a snapshot or a restore target is wrong.

Damage is done for real on the files of a real snapshot: truncation, a
flipped byte, a deleted data file, a garbled or newer manifest.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from _asserts import manifest_doc
from ppe_snapshot import (
    CorruptSnapshotError, Snapshot, SnapshotExistsError, SnapshotNotFoundError, StateDict, StateMismatchError,
    UnsupportedFormatError,
)

DATA = Path("data") / "rank0.bin"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(64, 32)


@pytest.fixture
def snap(tmp_path) -> tuple[Path, nn.Module]:
    """A committed snapshot of a small model and the model it was taken from."""
    model = _model()
    path = tmp_path / "s"
    Snapshot.take(str(path), {"model": model, "extra": StateDict(step=3)})
    return path, model


def _restore_fresh(path: Path) -> nn.Module:
    fresh = nn.Linear(64, 32)
    Snapshot(str(path)).restore({"model": fresh})
    return fresh


def _flip_byte(file: Path, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


# -- missing and damaged snapshots ------------------------------------------------

def test_no_manifest(tmp_path):
    for path in (tmp_path / "never", tmp_path):  # absent directory; directory without a manifest
        with pytest.raises(SnapshotNotFoundError, match="manifest.json is missing") as info:
            Snapshot(str(path)).restore({"model": _model()})
        assert isinstance(info.value, FileNotFoundError)
        assert str(path) in str(info.value)
        with pytest.raises(SnapshotNotFoundError):
            Snapshot(str(path)).verify()


def test_truncated_data_file(snap):
    path, _ = snap
    size = os.path.getsize(path / DATA)
    os.truncate(path / DATA, size // 2)
    with pytest.raises(CorruptSnapshotError, match="missing or truncated") as info:
        _restore_fresh(path)
    assert str(DATA) in str(info.value)
    with pytest.raises(CorruptSnapshotError, match=f"{size // 2} bytes, the manifest says {size} bytes"):
        Snapshot(str(path)).verify(deep=False)


def test_flipped_byte(snap):
    path, _ = snap
    weight = Snapshot(str(path)).get_manifest()["0/model/weight"]
    _flip_byte(path / DATA, weight.chunks[0].offset + 100)
    with pytest.raises(CorruptSnapshotError, match="checksum mismatch") as info:
        _restore_fresh(path)
    assert str(DATA) in str(info.value) and "model/weight" in str(info.value)
    Snapshot(str(path)).verify(deep=False)  # sizes are right: only the deep check reads the bytes
    with pytest.raises(CorruptSnapshotError, match="checksum mismatch"):
        Snapshot(str(path)).verify()


def test_deleted_data_file(snap):
    path, _ = snap
    os.remove(path / DATA)
    with pytest.raises(CorruptSnapshotError, match="missing"):
        Snapshot(str(path)).verify()
    with pytest.raises(CorruptSnapshotError, match="missing or truncated"):
        _restore_fresh(path)


@pytest.mark.parametrize("damage", ["not-json", "truncated", "empty", "not-a-manifest", "entry-missing-field"])
def test_damaged_manifest(snap, damage):
    path, _ = snap
    manifest = path / "manifest.json"
    text = manifest.read_text()
    if damage == "not-json":
        manifest.write_text("this is not json")
    elif damage == "truncated":
        manifest.write_text(text[: len(text) // 2])
    elif damage == "empty":
        manifest.write_text("")
    elif damage == "not-a-manifest":
        manifest.write_text(json.dumps({"hello": "world"}))
    else:  # the version-1 layout: one document holds every entry (version 2: see test_untrusted_index.py)
        doc = manifest_doc(path)
        del doc["ranks"][0]["model/weight"]["chunks"]
        manifest.write_text(json.dumps(doc))
    with pytest.raises(CorruptSnapshotError, match=str(manifest)) as info:
        _restore_fresh(path)
    if damage == "entry-missing-field":
        assert "'model/weight' is malformed" in str(info.value)
    for deep in (False, True):
        with pytest.raises(CorruptSnapshotError, match=str(manifest)):
            Snapshot(str(path)).verify(deep=deep)


def test_newer_format_version(snap):
    path, _ = snap
    doc = json.loads((path / "manifest.json").read_text())
    assert doc["version"] == 2
    doc["version"] = 999
    (path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(UnsupportedFormatError, match="upgrade ppe-snapshot") as info:
        _restore_fresh(path)
    assert "999" in str(info.value) and isinstance(info.value, ValueError)
    with pytest.raises(UnsupportedFormatError, match="upgrade"):
        Snapshot(str(path)).verify()


def test_verify_passes_on_a_good_snapshot(snap):
    path, _ = snap
    Snapshot(str(path)).verify()
    Snapshot(str(path)).verify(deep=False)


@pytest.mark.parametrize("budget", [1000, 4096, 1 << 20], ids=["an eighth of the weight", "half of it", "weight and bias at once"])
def test_deep_verify_finds_a_flipped_byte_whatever_its_buffer(snap, budget):
    """verify reads through one buffer grown to the largest read up to its budget, a chunk beyond the budget in
    pieces: a sound snapshot passes each way, and a byte flipped in the weight's chunk or the bias's is found."""
    from ppe_snapshot.engine import read_manifest
    from ppe_snapshot.engine._files import verify_chunks
    from ppe_snapshot.storage import open_storage

    path, _ = snap
    storage = open_storage(str(path))
    verify_chunks(storage, read_manifest(storage), budget)
    sound = (path / DATA).read_bytes()
    for offset, tensor in ((5000, "model/weight"), (len(sound) - 100, "model/bias")):
        damaged = bytearray(sound)
        damaged[offset] ^= 0x5A
        (path / DATA).write_bytes(bytes(damaged))
        with pytest.raises(CorruptSnapshotError, match=f"checksum mismatch .*{tensor}"):
            verify_chunks(storage, read_manifest(storage), budget)


# -- taking onto an existing snapshot ---------------------------------------------

def test_take_onto_existing_snapshot(snap):
    path, model = snap
    data_before = (path / DATA).read_bytes()
    manifest_before = (path / "manifest.json").read_bytes()
    with pytest.raises(SnapshotExistsError, match="already exists") as info:
        Snapshot.take(str(path), {"model": nn.Linear(64, 32)})
    assert isinstance(info.value, FileExistsError) and str(path) in str(info.value)
    assert (path / DATA).read_bytes() == data_before
    assert (path / "manifest.json").read_bytes() == manifest_before
    restored = _restore_fresh(path)
    assert torch.equal(restored.weight, model.weight) and torch.equal(restored.bias, model.bias)


# -- restore targets that do not match ----------------------------------------------

def test_shape_mismatch(snap):
    path, _ = snap
    with pytest.raises(StateMismatchError) as info:
        Snapshot(str(path)).restore({"model": nn.Linear(64, 16)})
    message = str(info.value)
    assert "model/weight" in message and "[32, 64]" in message and "[16, 64]" in message
    assert isinstance(info.value, ValueError)


def test_dtype_mismatch(snap):
    path, _ = snap
    with pytest.raises(StateMismatchError) as info:
        Snapshot(str(path)).restore({"model": nn.Linear(64, 32).to(torch.float64)})
    message = str(info.value)
    assert "model/weight" in message and "float32" in message and "float64" in message


def test_key_missing_from_snapshot(snap):
    path, _ = snap
    with pytest.raises(StateMismatchError, match="'optim'") as info:
        Snapshot(str(path)).restore({"model": _model(), "optim": torch.optim.SGD(_model().parameters(), lr=1)})
    assert "['extra', 'model']" in str(info.value)


def test_non_stateful_app_state_value(snap, tmp_path):
    path, _ = snap
    with pytest.raises(TypeError, match="StateDict") as info:
        Snapshot.take(str(tmp_path / "t"), {"w": torch.ones(3)})
    assert "app_state['w']" in str(info.value)
    assert not (tmp_path / "t" / "manifest.json").exists()
    with pytest.raises(TypeError, match="StateDict"):
        Snapshot(str(path)).restore({"model": torch.ones(3)})


def test_metadata_that_is_not_json(tmp_path):
    with pytest.raises(TypeError, match="metadata") as info:
        Snapshot.take(str(tmp_path / "s"), {"s": StateDict(x=torch.ones(2))}, metadata={"when": object()})
    assert "JSON" in str(info.value)
    assert not (tmp_path / "s").exists()
    with pytest.raises(TypeError, match="metadata must be a dict"):
        Snapshot.take(str(tmp_path / "s"), {"s": StateDict(x=torch.ones(2))}, metadata=[("step", 1)])
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("path, error", [("", ValueError), ("file://", ValueError), (None, TypeError),
                                         (7, TypeError), (b"snap", TypeError)])
def test_a_path_that_names_no_snapshot_is_refused(tmp_path, monkeypatch, path, error):
    """An empty path used to name the current directory, where a take wrote its manifest; None became 'None'."""
    monkeypatch.chdir(tmp_path)
    match = "path is empty" if error is ValueError else "must be a str or os.PathLike"
    with pytest.raises(error, match=match):
        Snapshot(path)
    for take in (Snapshot.take, Snapshot.async_take):
        with pytest.raises(error, match=match):
            take(path, {"s": StateDict(x=torch.ones(2))})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("budget, error", [(0, ValueError), (-1, ValueError), ("1 MiB", TypeError),
                                           (1.5, TypeError), (True, TypeError)])
def test_read_object_refuses_a_memory_budget_that_is_no_number_of_bytes(snap, budget, error):
    path, _ = snap
    with pytest.raises(error, match="memory_budget_bytes must be a"):
        Snapshot(str(path)).read_object("0/model/weight", memory_budget_bytes=budget)
