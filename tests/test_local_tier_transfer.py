"""A partner's copy read at restore by the rank whose part it is, over real gloo groups, straight into its tensors;
and the reads behind every restore (large chunks hashed piece by piece)."""
from __future__ import annotations

import pytest
import torch

import _tier_workers as w
from ppe_snapshot.engine import LOCAL, Snapshot, StateDict
from ppe_snapshot.engine._files import reads
from ppe_snapshot.errors import CorruptSnapshotError
from ppe_snapshot.storage import open_storage


def test_a_large_chunk_damaged_in_any_piece_is_refused(tmp_path):
    """A chunk of several ``HASHED_PIECE``s is read and hashed piece by piece: a flipped byte in its third piece
    is a checksum mismatch naming the file, on both read paths (a restore's batch, a single read)."""
    state = {"big": torch.arange(3 * reads.HASHED_PIECE // 4 + 5, dtype=torch.float32)}  # 4 pieces, the last short
    Snapshot.take(str(tmp_path / "s"), {"s": StateDict(state)}, pg=LOCAL)
    target = {"big": torch.zeros_like(state["big"])}
    Snapshot(str(tmp_path / "s"), pg=LOCAL).restore({"s": StateDict(target)})
    assert torch.equal(target["big"], state["big"])
    data = next(p for p in (tmp_path / "s").rglob("*.bin"))
    raw = bytearray(data.read_bytes())
    raw[2 * reads.HASHED_PIECE + 5] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptSnapshotError, match=r"checksum mismatch in .*\.bin at bytes"):
        Snapshot(str(tmp_path / "s"), pg=LOCAL).restore({"s": StateDict(target)})
    with pytest.raises(CorruptSnapshotError, match="checksum mismatch"):
        Snapshot(str(tmp_path / "s"), pg=LOCAL).read_object("s/big")


def test_large_chunks_are_read_in_pieces_only_where_small_reads_are_cheap(tmp_path):
    assert open_storage(str(tmp_path)).small_reads_cheap
    assert not open_storage("memory://somewhere").small_reads_cheap  # an fsspec store: one request per chunk


@pytest.mark.parametrize("holds", [True, False])
@pytest.mark.parametrize("where", ["directory", "memory"])
def test_a_part_is_restored_from_a_partners_copy_over_the_group(tmp_path, dist_run, holds, where):
    root = str(tmp_path) if where == "directory" else f"memory://{tmp_path.name}"  # mapped, or read in buffers
    got = dist_run(w.read_from_peer, 2, root, holds)[0]
    if holds:
        assert got == {"none": False, "same": True, "url": f"{root}/copy",
                       "sent with the header": ["index/rank0.idx", "index/shared.idx", "manifest.json"]}
    else:
        assert got == {"none": True}


def test_a_read_outside_the_copy_is_refused_and_ends_the_serving(tmp_path, dist_run):
    got = dist_run(w.crafted_request, 2, str(tmp_path))[0]
    assert got["refused"].startswith("rank 1 refused to send bytes 0.. of ")
    assert got["ended"].startswith("no more reads of ") and "refused" in got["ended"]


@pytest.mark.parametrize("header", [
    {"files": [["../outside", 1]], "path": "/copy"},
    {"files": [], "path": 7},
    {"files": [["manifest.json", 10]], "path": "/copy", "inline": ["index/rank0.idx"]},  # not one of its files
    {"files": [["data/rank0.bin", 1 << 30]], "path": "/copy", "inline": ["data/rank0.bin"]},  # 1 GiB "small" file
    {"files": [["manifest.json", 10]], "path": "/copy", "inline": ["manifest.json", "manifest.json"]},
])
def test_a_malformed_copy_header_is_refused_and_the_holder_told(dist_run, header):
    got = dist_run(w.crafted_header, 2, header)
    assert got == [{"error": "rank 1 sent a malformed part header"}, {"told": {"done": True}}]


def test_a_lost_nodes_part_is_read_from_the_partners_copy(tmp_path, dist_run):
    lost = dist_run(w.node_lost, 2, str(tmp_path))
    assert [r.get("step") for r in lost] == [4, 4], lost
    assert lost[0]["source"] == "its own local part" and lost[0]["restored_from"] == ["UnchangedFiles"]
    assert lost[0]["path"] == str(tmp_path / "node0" / "step_4" / "rank0")
    assert lost[1]["source"] == "a partner copy from rank 0" and lost[1]["restored_from"] == ["PeerFiles"]
    assert lost[1]["path"] == str(tmp_path / "node0" / "step_4" / "copy-rank1")
    assert all(r["same"] for r in lost)
    serving = [name for r in lost for name in r["threads"] if name == "ppe-snapshot-local-tier-serve"]
    assert serving == []  # the holder's serving thread ended (not "ppe-snapshot-reserve": staging made ready)
