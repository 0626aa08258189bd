"""Reading an untrusted snapshot runs no code and stays inside it (issue 10, items 1 and 4).

Pickled entries are unpickled only with ``allow_pickle`` (the library and
``ppe-snapshot convert --allow-pickle``); chunk file names that leave the
snapshot and data files that are symbolic links out of it are refused. The
"code" a hostile pickle runs here is ``os.mkdir`` of a marker directory, so
a test sees whether it ran.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from _asserts import written_as
from _crafted import DATA, WEIGHT, append_payload, craft, entry, take_small
from ppe_snapshot import CorruptSnapshotError, Snapshot, StateDict, UnsupportedValueError, load_snapshot
from ppe_snapshot.cli import main
from ppe_snapshot.dcp import SnapshotStorageReader, SnapshotStorageWriter
from ppe_snapshot.storage import LocalStorage


@pytest.fixture(autouse=True)
def _version_1():
    """These tests craft the one JSON document of format version 1 (version 2's index files:
    test_untrusted_index.py); the reader of version 1 stays, for snapshots written before version 2."""
    with written_as(1):
        yield


class _MakesDirectory:
    """Unpickling this calls ``os.mkdir(marker)``: the stand-in for code a crafted snapshot would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


# -- item 1: no code runs unless the reader opts in -------------------------------------------------

def _hostile_snapshot(tmp_path: Path) -> tuple[Path, Path]:
    """A snapshot whose ``state/hook`` entry is a pickle that makes ``marker`` when unpickled; written by
    hand from the format document (a writer without allow_pickle could never produce it)."""
    marker = tmp_path / "code-ran"
    path = tmp_path / "s"
    Snapshot.take(str(path), {"state": StateDict(w=WEIGHT.clone(), hook=1)})

    def plant(doc):
        chunk = append_payload(path, doc, pickle.dumps(_MakesDirectory(marker)))
        doc["ranks"][0]["state/hook"] = {"type": "pickle", "chunks": [chunk]}
    craft(path, plant)
    return path, marker


def test_library_reads_refuse_a_pickle_entry_without_allow_pickle(tmp_path):
    path, marker = _hostile_snapshot(tmp_path)
    reads = {
        "restore": lambda: Snapshot(str(path)).restore({"state": StateDict()}),
        "read_object": lambda: Snapshot(str(path)).read_object("0/state"),
        "read_object of the entry": lambda: Snapshot(str(path)).read_object("0/state/hook"),
        "dcp reader": lambda: SnapshotStorageReader(str(path)).read_metadata().state_dict_metadata["state.hook"]
        and _dcp_bytes(path, "state.hook"),
    }
    for name, read in reads.items():
        with pytest.raises(UnsupportedValueError, match="allow_pickle=True") as info:
            read()
        assert "'state/hook'" in str(info.value), name
        assert not marker.exists(), name
    Snapshot(str(path)).verify()  # checking the bytes unpickles nothing
    assert not marker.exists()
    assert Snapshot(str(path), allow_pickle=True).read_object("0/state/hook") is None  # os.mkdir's result
    assert marker.is_dir()


def _dcp_bytes(path: Path, fqn: str) -> bytes:
    reader = SnapshotStorageReader(str(path))
    reader.read_metadata()
    source = reader._sources[(fqn, None)]
    return source.load(LocalStorage(str(path)))


@pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable)")
def test_dcp_load_runs_no_code_of_a_crafted_dcp_value_without_allow_pickle(tmp_path, capsys):
    """A value DCP saved is a torch.save stream that DCP's load planner unpickles whole: one crafted to run code
    is refused before the planner sees it, unless the reader allows pickle; plain values still load."""
    marker, path = tmp_path / "code-ran", tmp_path / "s"
    state = {"w": WEIGHT.clone(), "extra": {"name": "run-1", "hook": 0}}
    dcp.save(state, storage_writer=SnapshotStorageWriter(str(path)))
    hostile = io.BytesIO()
    torch.save(_MakesDirectory(marker), hostile)
    craft(path, lambda doc: entry(doc, "extra.hook")["chunks"].__setitem__(
        0, append_payload(path, doc, hostile.getvalue())))
    Snapshot(str(path)).verify()  # (a crafted snapshot, whole: nothing but its content is wrong)
    target = {"w": torch.zeros(3, 4), "extra": {"name": "", "hook": 0}}
    with pytest.raises(CheckpointException) as info:
        dcp.load(target, storage_reader=SnapshotStorageReader(str(path)))
    ((error, _trace),) = info.value.failures.values()
    assert isinstance(error, UnsupportedValueError) and "'extra.hook'" in str(error)
    assert "allow_pickle=True" in str(error) and "mkdir" in str(error)  # (torch's reason: the global refused)
    assert not marker.exists()
    out = tmp_path / "out.pt"  # the command line reads it through the same reader
    assert main(["convert", str(path), str(out)]) == 2
    assert "'extra.hook'" in capsys.readouterr().err and not marker.exists() and not out.exists()
    assert main(["convert", "--allow-pickle", str(path), str(out)]) == 0
    assert marker.is_dir()
    marker.rmdir()
    dcp.load(target, storage_reader=SnapshotStorageReader(str(path), allow_pickle=True))
    assert marker.is_dir() and target["extra"]["name"] == "run-1" and torch.equal(target["w"], WEIGHT)


@pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable)")
def test_a_torch_dcp_directory_is_unpickled_only_with_allow_pickle(tmp_path, capsys):
    """torch's own DCP checkpoint of an object that runs code when unpickled: load_snapshot and convert read its
    values with torch's restricted unpickler, and run it only when allowed."""
    marker, path = tmp_path / "code-ran", tmp_path / "dcp"
    dcp.save({"w": WEIGHT.clone(), "hook": _MakesDirectory(marker)}, storage_writer=dcp.FileSystemWriter(path),
             no_dist=True)
    with pytest.raises(UnsupportedValueError, match="'hook' needs pickle"):
        load_snapshot(str(path))
    assert main(["convert", str(path), str(tmp_path / "out.pt")]) == 2
    assert "allow-pickle" in capsys.readouterr().err and not marker.exists()
    assert torch.equal(load_snapshot(str(path), allow_pickle=True)["w"], WEIGHT)
    assert marker.is_dir()


def test_cli_convert_unpickles_only_with_allow_pickle(tmp_path, capsys):
    path, marker = _hostile_snapshot(tmp_path)
    out = tmp_path / "out.pt"
    assert main(["inspect", str(path)]) == 0
    assert "0/state/hook: pickled" in capsys.readouterr().out
    assert main(["verify", str(path)]) == 0
    assert main(["convert", str(path), str(out)]) == 2
    err = capsys.readouterr().err
    assert "'state/hook'" in err and "allow_pickle" in err
    assert not marker.exists() and not out.exists()

    assert main(["convert", "--allow-pickle", str(path), str(out)]) == 0
    assert marker.is_dir()
    saved = torch.load(out, weights_only=True)
    assert torch.equal(saved["w"], WEIGHT) and saved["hook"] is None


def test_cli_convert_of_a_torch_file_needs_allow_pickle_for_objects(tmp_path, capsys):
    marker = tmp_path / "code-ran"
    torch.save({"w": WEIGHT.clone(), "hook": _MakesDirectory(marker)}, tmp_path / "in.pt")
    assert main(["convert", "--to", "snapshot", str(tmp_path / "in.pt"), str(tmp_path / "snap")]) != 0
    assert not marker.exists() and not (tmp_path / "snap" / "manifest.json").exists()
    capsys.readouterr()
    assert main(["convert", "--allow-pickle", "--to", "snapshot", str(tmp_path / "in.pt"), str(tmp_path / "snap")]) == 0
    assert marker.is_dir()


# -- item 4: reads stay inside the snapshot ----------------------------------------------------------

def _outside_copy(small: Path) -> Path:
    """A file outside the snapshot with the data file's exact bytes (so checksums would pass)."""
    outside = small.parent / "outside.bin"
    shutil.copyfile(small / DATA, outside)
    return outside


READS = {
    "restore": lambda p: Snapshot(p).restore({"m": StateDict()}),
    "restore_in_place": lambda p: Snapshot(p).restore({"m": StateDict(w=torch.zeros(3, 4))}),
    "read_object": lambda p: Snapshot(p).read_object("0/m/w"),
    "verify": lambda p: Snapshot(p).verify(),
    "verify_quick": lambda p: Snapshot(p).verify(deep=False),
    "get_manifest": lambda p: Snapshot(p).get_manifest(),
}


@pytest.mark.parametrize("name", ["../outside.bin", "../../outside.bin", "data/../../outside.bin", "/ABS",
                                  "data\\rank0.bin", "", "data//rank0.bin", "./data/rank0.bin", "data/./rank0.bin"])
def test_data_file_names_that_leave_the_snapshot_are_refused(tmp_path, name):
    small = take_small(tmp_path / "s")
    outside = _outside_copy(small)
    name = str(outside) if name == "/ABS" else name

    def point_outside(doc):
        doc["files"][name] = doc["files"][DATA]
        for chunk in entry(doc, "m/w")["chunks"]:
            chunk["file"] = name
    craft(small, point_outside)
    for read_name, read in READS.items():
        with pytest.raises(CorruptSnapshotError, match="not a normalised relative path inside the snapshot") as info:
            read(str(small))
        assert repr(name)[:20] in str(info.value), read_name


def test_chunk_file_not_listed_in_files_is_refused(tmp_path):
    small = take_small(tmp_path / "s")
    _outside_copy(small)
    craft(small, lambda doc: entry(doc, "m/w")["chunks"][0].__setitem__("file", "../outside.bin"))
    for read in READS.values():
        with pytest.raises(CorruptSnapshotError, match="'../outside.bin', which is not among the manifest's files"):
            read(str(small))


@pytest.mark.parametrize("link", ["file", "directory"])
def test_data_file_that_links_out_of_the_snapshot_is_refused(tmp_path, link):
    small = take_small(tmp_path / "s")
    if link == "file":
        outside = _outside_copy(small)
        os.remove(small / DATA)
        os.symlink(outside, small / DATA)
    else:
        shutil.move(small / "data", tmp_path / "data-outside")
        os.symlink(tmp_path / "data-outside", small / "data")
    for name, read in READS.items():
        if name == "get_manifest":
            continue  # reads no data file
        with pytest.raises(CorruptSnapshotError, match="outside the snapshot directory") as info:
            read(str(small))
        assert DATA in str(info.value), name


def test_links_inside_the_snapshot_and_a_linked_snapshot_directory_are_read(tmp_path):
    small = take_small(tmp_path / "s")
    os.rename(small / DATA, small / "data" / "real.bin")
    os.symlink("real.bin", small / DATA)  # relative, inside the snapshot
    os.symlink(small, tmp_path / "latest")  # the snapshot reached through a link
    for path in (small, tmp_path / "latest"):
        Snapshot(str(path)).verify()
        assert torch.equal(Snapshot(str(path)).read_object("0/m/w"), WEIGHT)


def test_local_storage_refuses_names_outside_its_root(tmp_path):
    small = take_small(tmp_path / "s")
    _outside_copy(small)
    storage = LocalStorage(str(small))
    out = memoryview(bytearray(8))
    for name in ("../outside.bin", str(tmp_path / "outside.bin"), "data/../../outside.bin"):
        with pytest.raises(CorruptSnapshotError, match="a data file name must be a normalised relative path"):
            storage.read_into(name, 0, out)
        with pytest.raises(CorruptSnapshotError, match="normalised relative path"):
            storage.size(name)
    storage.read_into(DATA, 0, out)
    assert bytes(out) == WEIGHT.numpy().tobytes()[:8]
    storage.close()


def test_object_store_snapshots_are_checked_the_same(tmp_path):
    """On fsspec storage (here the real in-memory file system) names are refused by the manifest's checks,
    and claimed sizes against the stored object's size before allocating."""
    url = f"memory://untrusted-{uuid.uuid4().hex}/s"
    Snapshot.take(url, {"m": StateDict(w=WEIGHT.clone())})
    fs = fsspec.filesystem("memory")
    manifest = f"{url}/manifest.json".removeprefix("memory://")
    good = fs.cat_file(manifest)
    try:
        doc = json.loads(good)
        doc["files"]["../other/data.bin"] = doc["files"][DATA]
        entry(doc, "m/w")["chunks"][0]["file"] = "../other/data.bin"
        fs.pipe_file(manifest, json.dumps(doc).encode())
        with pytest.raises(CorruptSnapshotError, match="not a normalised relative path"):
            Snapshot(url).read_object("0/m/w")

        doc = json.loads(good)
        entry(doc, "m/w")["shape"], entry(doc, "m/w")["chunks"][0]["nbytes"] = [1 << 40], 4 << 40
        doc["files"][DATA] = (4 << 40) + 64
        fs.pipe_file(manifest, json.dumps(doc).encode())
        with pytest.raises(CorruptSnapshotError, match="missing or truncated") as info:
            Snapshot(url).read_object("0/m/w")
        assert "'m/w'" in str(info.value)
    finally:
        fs.rm(url.removeprefix("memory://"), recursive=True)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_data_file_or_manifest_that_is_not_a_regular_file_is_refused(tmp_path, kind):
    """A FIFO would block the reader's open forever, a directory fail its reads with an OSError."""
    small = take_small(tmp_path / "s")
    manifest = (small / "manifest.json").read_bytes()
    os.remove(small / DATA)
    os.mkfifo(small / DATA) if kind == "fifo" else os.mkdir(small / DATA)
    for name, read in READS.items():
        if name == "get_manifest":
            continue  # reads no data file
        with pytest.raises(CorruptSnapshotError) as info:  # its size, or opening it, refuses it
            read(str(small))
        assert DATA in str(info.value), name
    with pytest.raises(CorruptSnapshotError, match="it is not a regular file"):
        READS["restore_in_place"](str(small))  # no size asked: the open refuses it

    os.remove(small / "manifest.json")
    os.mkfifo(small / "manifest.json") if kind == "fifo" else os.mkdir(small / "manifest.json")
    with pytest.raises(CorruptSnapshotError, match="'manifest.json': it is not a regular file"):
        Snapshot(str(small)).get_manifest()
    assert manifest  # the snapshot was readable before
