"""A partner's copy fetched at restore: received into memory, restored from there, written back in the
background; and the reads behind it (files held in memory, large chunks hashed piece by piece)."""
from __future__ import annotations

import pytest
import torch

import _tier_workers as w
from ppe_snapshot.engine import LOCAL, Snapshot, StateDict
from ppe_snapshot.engine._files import reads
from ppe_snapshot.errors import CorruptSnapshotError
from ppe_snapshot.storage import MemoryFiles, open_storage


def _files_of(path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(path)), p.stat().st_size) for p in path.rglob("*") if p.is_file())


def _in_memory(path) -> MemoryFiles:
    """The snapshot at ``path`` as files held in one buffer, as a fetched part is."""
    files = _files_of(path)
    buffer = bytearray(sum(size for _, size in files))
    at = 0
    for name, size in files:
        buffer[at:at + size] = (path / name).read_bytes()
        at += size
    return MemoryFiles(f"{path}-in-memory", memoryview(buffer), files)


def test_a_snapshot_restores_from_files_held_in_memory(tmp_path):
    Snapshot.take(str(tmp_path / "s"), {"s": StateDict(w.state(0))}, pg=LOCAL)
    held = _in_memory(tmp_path / "s")
    target = w.blank(0)
    Snapshot(held, pg=LOCAL).restore({"s": StateDict(target)})
    assert all(torch.equal(target[k], v) for k, v in w.state(0).items())
    assert Snapshot(held).path == f"{tmp_path / 's'}-in-memory"


def test_files_held_in_memory_are_read_only_and_bounded():
    held = MemoryFiles("mem://part", memoryview(bytearray(b"abcdefgh")), [("a", 3), ("d/b", 5)])
    out = bytearray(4)
    held.read_vectored("d/b", 1, [memoryview(out)[:2], memoryview(out)[2:]])
    assert bytes(out) == b"efgh" and held.read_bytes("a") == b"abc"
    assert held.exists("") and held.exists("d") and not held.exists("e") and held.is_file("a")
    with pytest.raises(EOFError, match="holds 3 bytes"):
        held.read_into("a", 1, memoryview(bytearray(3)))
    with pytest.raises(FileNotFoundError):
        held.read_bytes("c")
    with pytest.raises(PermissionError, match="read-only"):
        held.open_writer("a")
    with pytest.raises(ValueError, match="the files hold 9 bytes"):
        MemoryFiles("mem://part", memoryview(bytearray(8)), [("a", 9)])


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_a_large_chunk_damaged_in_any_piece_is_refused(tmp_path, where):
    """A chunk of several ``HASHED_PIECE``s is read and hashed piece by piece: a flipped byte in its third piece
    (past what a check of the first piece alone would see) is a checksum mismatch naming the file."""
    state = {"big": torch.arange(3 * reads.HASHED_PIECE // 4 + 5, dtype=torch.float32)}  # 4 pieces, the last short
    Snapshot.take(str(tmp_path / "s"), {"s": StateDict(state)}, pg=LOCAL)
    data = next(p for p in (tmp_path / "s").rglob("*.bin"))
    raw = bytearray(data.read_bytes())
    raw[2 * reads.HASHED_PIECE + 5] ^= 1
    data.write_bytes(bytes(raw))
    source = str(tmp_path / "s") if where == "disk" else _in_memory(tmp_path / "s")
    with pytest.raises(CorruptSnapshotError, match=r"checksum mismatch in .*\.bin at bytes"):
        Snapshot(source, pg=LOCAL).restore({"s": StateDict({"big": torch.zeros_like(state["big"])})})
    with pytest.raises(CorruptSnapshotError, match="checksum mismatch"):
        Snapshot(source, pg=LOCAL).read_object("s/big")


def test_large_chunks_are_read_in_pieces_only_where_small_reads_are_cheap(tmp_path):
    assert open_storage(str(tmp_path)).small_reads_cheap
    assert not open_storage("memory://somewhere").small_reads_cheap  # an fsspec store: one request per chunk


@pytest.mark.parametrize("fits", [True, False])
def test_a_part_received_into_memory_restores_bit_exact(tmp_path, dist_run, fits):
    got = dist_run(w.part_in_memory, 2, str(tmp_path), fits)[0]
    assert got["problem"] is None and got["same"]
    assert got["in_memory"] is fits and got["written"] is not fits  # short of memory: into the directory
    if fits:
        assert got["files"] == [name for name, _ in _files_of(tmp_path / "part")]


def test_a_lost_nodes_part_is_restored_from_memory_and_written_back(tmp_path, dist_run):
    lost = dist_run(w.node_lost, 2, str(tmp_path))
    assert [r["step"] for r in lost] == [4, 4]
    assert lost[0]["source"] == "its own local part" and lost[0]["restored_from"] == ["str"]
    assert lost[1]["source"] == "a partner copy from rank 0" and lost[1]["restored_from"] == ["MemoryFiles"]
    assert all(r["same"] and r["marked"] and r["written_same"] for r in lost)
