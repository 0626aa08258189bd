"""A local tier's own part known unchanged since it was completed: what its record holds, every change that voids
it, and reads that take the bytes of such a part as they are (storage/unchanged.py)."""
from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

from ppe_snapshot.engine import LOCAL, Snapshot, StateDict
from ppe_snapshot.engine._files import reads
from ppe_snapshot.errors import CorruptSnapshotError
from ppe_snapshot.storage import UnchangedFiles, open_unchanged, record_files
from ppe_snapshot.storage import unchanged


def _state() -> dict[str, torch.Tensor]:
    """Tensors that take each read path of a restore: many small ones (read in bulk straight into their targets),
    tiny ones (through a buffer), one of several ``HASHED_PIECE``s."""
    torch.manual_seed(0)
    return {**{f"small{i}": torch.randn(1000) for i in range(20)}, **{f"tiny{i}": torch.randn(3) for i in range(20)},
            "big": torch.randn(3 * reads.HASHED_PIECE // 4 + 5)}


def _part(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    state = _state()
    path = str(tmp_path / "step_4" / "rank0")
    Snapshot.take(path, {"s": StateDict(state)}, pg=LOCAL)
    return path, state


def _restored(source) -> dict[str, torch.Tensor]:
    target = {k: torch.zeros_like(v) for k, v in _state().items()}
    Snapshot(source, pg=LOCAL).restore({"s": StateDict(target)})
    return target


def _byte_of(path: str, name: str) -> int:
    """Where in the part's data file the first byte of tensor ``name`` lies."""
    entry = Snapshot(path, pg=LOCAL).get_manifest()[f"0/s/{name}"]
    return entry.chunks[0].offset


def test_an_unchanged_part_opens_as_unchanged_files_and_restores_bit_exact(tmp_path):
    """Its record: a file of ``STAT_BYTES`` or more (the data file) by size, inode and times, the smaller ones by
    size and xxh3."""
    path, state = _part(tmp_path)
    recorded = record_files(path)
    assert sorted(recorded) == ["data/rank0.bin", "index/rank0.idx", "index/shared.idx", "manifest.json"]
    assert len(recorded["data/rank0.bin"]) == 4 and recorded["data/rank0.bin"][0] >= unchanged.STAT_BYTES
    assert len(recorded["manifest.json"]) == 2 and isinstance(recorded["manifest.json"][1], str)
    reader = open_unchanged(path, recorded)
    assert isinstance(reader, UnchangedFiles) and not reader.verify_data and reader.url == path
    got = _restored(reader)
    assert all(torch.equal(got[k], v) for k, v in state.items())


@pytest.mark.parametrize("name", ["small3", "tiny5", "big"])
def test_a_storage_that_needs_no_check_takes_the_bytes_as_they_are(tmp_path, name):
    """What a part's record vouches for is what its reads skip: a byte changed behind a storage that needs no
    check lands as it is, on every read path, where an ordinary read refuses it."""
    path, state = _part(tmp_path)
    with open(os.path.join(path, "data", "rank0.bin"), "r+b") as f:
        at = _byte_of(path, name)
        f.seek(at)
        f.write(bytes([f.read(1)[0] ^ 0xFF]))
    with pytest.raises(CorruptSnapshotError, match="checksum mismatch"):
        _restored(path)
    got = _restored(UnchangedFiles(path))
    assert not torch.equal(got[name], state[name])
    assert all(torch.equal(got[k], v) for k, v in state.items() if k != name)
    read = Snapshot(UnchangedFiles(path), pg=LOCAL).read_object(f"s/{name}")
    assert torch.equal(read, got[name])
    with pytest.raises(CorruptSnapshotError, match="checksum mismatch"):  # an explicit check checks all the same
        Snapshot(UnchangedFiles(path), pg=LOCAL).verify(deep=True)


def _rewrite_a_byte_in_place(path: str) -> None:
    data = os.path.join(path, "data", "rank0.bin")
    before = os.stat(data)
    with open(data, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))  # the modification time set back


def _replace_with_a_copy(path: str) -> None:
    data = os.path.join(path, "data", "rank0.bin")
    shutil.copy2(data, data + ".new")
    os.replace(data + ".new", data)


def _touch_the_index(path: str) -> None:
    index = os.path.join(path, "index", "rank0.idx")
    raw = bytearray(open(index, "rb").read())
    raw[-1] ^= 1
    with open(index, "wb") as f:
        f.write(raw)


CHANGES = {
    "a data byte rewritten in place, its mtime set back": _rewrite_a_byte_in_place,
    "the data file grown": lambda path: open(os.path.join(path, "data", "rank0.bin"), "ab").write(b"\0"),
    "the data file replaced by a copy of itself": _replace_with_a_copy,
    "an index file's bytes": _touch_the_index,
    "a file added": lambda path: open(os.path.join(path, "data", "rank1.bin"), "wb").close(),
    "a file removed": lambda path: os.remove(os.path.join(path, "index", "shared.idx")),
    "the manifest rewritten the same": lambda path: open(os.path.join(path, "manifest.json"), "r+b").close(),
}


@pytest.mark.parametrize("change", CHANGES)
def test_any_change_to_a_parts_files_voids_its_record(tmp_path, change):
    path, _ = _part(tmp_path)
    recorded = record_files(path)
    assert open_unchanged(path, recorded) is not None
    CHANGES[change](path)
    expect_same = change == "the manifest rewritten the same"  # opened and closed: its bytes are the same
    assert (open_unchanged(path, recorded) is not None) == expect_same


def test_a_record_waits_until_the_data_files_change_time_is_settled(tmp_path):
    """A change within the clock's tick of the data file's last write could keep its change time: the record is
    made once that time is at least ``SETTLED_S`` old, so any later change shows."""
    path, _ = _part(tmp_path)
    os.utime(os.path.join(path, "data", "rank0.bin"))  # its change time: now
    recorded = record_files(path)
    assert time.time_ns() - recorded["data/rank0.bin"][3] >= unchanged.SETTLED_S * 1e9


def test_no_record_vouches_for_a_part_it_does_not_describe(tmp_path):
    path, _ = _part(tmp_path)
    assert record_files("memory://elsewhere/step_4/rank0") is None
    assert open_unchanged(path, None) is None and open_unchanged(path, {}) is None
    assert open_unchanged(path, ["data/rank0.bin"]) is None
    assert open_unchanged(str(tmp_path / "gone"), record_files(path)) is None
