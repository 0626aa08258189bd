"""Reads into device tensors through page-locked buffers (``engine/_files/device_reads.py``), tested on CPU
tensors standing in for device ones: the packing of targets into buffers (whole chunks, each verified), the
gathered copy of a buffer of small tensors, a large tensor across buffers, the bound on host buffers, and the
failures. tests/test_cuda.py runs the same path on a GPU through ``Snapshot.restore`` and the DCP reader."""
from __future__ import annotations

import pytest
import torch

from _asserts import assert_same
from ppe_snapshot import CorruptSnapshotError, Snapshot, StateDict
from ppe_snapshot.engine import read_manifest
from ppe_snapshot.engine._files import device_reads
from ppe_snapshot.engine._files.device_reads import DeviceReads
from ppe_snapshot.engine._files.reads import ReadBatch
from ppe_snapshot.storage import open_storage

KiB = 1 << 10


def _saved(tmp_path, state: dict[str, torch.Tensor], block_bytes: int | None = None):
    """The state taken, its storage opened, and each tensor's chunks by key."""
    path = str(tmp_path / "s")
    Snapshot.take(path, {"m": StateDict(state)}, block_bytes=block_bytes)
    storage = open_storage(path)
    entries = read_manifest(storage).paths_for(0)
    return storage, {key: entries[f"m/{key}"].chunks for key in state}


@pytest.fixture
def transfers(monkeypatch):
    """Each buffer's copy to the "device": how many pieces it carried (the copy itself runs as it would)."""
    seen: list[int] = []
    to_device = device_reads._to_device

    def counted(batch, host):
        seen.append(len(batch.pieces))
        return to_device(batch, host)
    monkeypatch.setattr(device_reads, "_to_device", counted)
    return seen


def test_small_tensors_share_a_buffer_and_one_transfer(tmp_path, transfers):
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(250) for i in range(40)}  # 1000 bytes each, 1024 apart in a buffer
    state["flags"] = torch.rand(13) > 0.5
    state["half"] = torch.randn(3, 5).half()
    storage, chunks = _saved(tmp_path, state)
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    device = DeviceReads(ReadBatch(), buffer_bytes=16 * KiB, buffers=2)
    assert all(device.add(storage, chunks[k], targets[k], k) for k in state)
    device.join()
    assert_same(targets, state)
    assert sum(transfers) == len(state)  # every tensor in some buffer ...
    assert len(transfers) == 3 and max(transfers) == 16  # ... 16 of 1 KiB slots to a 16 KiB buffer


def test_a_large_tensor_goes_through_the_buffers_in_whole_chunks(tmp_path, transfers, monkeypatch):
    made = []
    new = device_reads.host_buffer
    monkeypatch.setattr(device_reads, "host_buffer", lambda n, pin: made.append(n) or new(n, pin))
    torch.manual_seed(1)
    state = {"big": torch.randn(64, 1024), "after": torch.arange(10)}  # 256 KiB in blocks of 32 KiB
    storage, chunks = _saved(tmp_path, state, block_bytes=32 * KiB)
    assert len(chunks["big"]) == 8
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    device = DeviceReads(ReadBatch(), buffer_bytes=80 * KiB, buffers=2)
    assert device.add(storage, chunks["big"], targets["big"], "big")
    assert device.add(storage, chunks["after"], targets["after"], "after")
    device.join()
    assert_same(targets, state)
    # 2 + 2 + 2 + 2 chunks of 32 KiB (a third does not fit 80 KiB); "after" shares the last buffer
    assert sorted(transfers) == [1, 1, 1, 2]  # (in the order the read threads ended)
    assert made == [80 * KiB, 80 * KiB]  # four buffers read through two, each used again after its copy


def test_what_cannot_go_through_a_buffer_is_left_to_the_caller(tmp_path):
    state = {"big": torch.randn(64, 64), "small": torch.randn(8)}
    storage, chunks = _saved(tmp_path, state)
    device = DeviceReads(ReadBatch(), buffer_bytes=4 * KiB)
    assert not device.add(storage, chunks["big"], torch.zeros(64, 64), "big")  # a 16 KiB chunk
    assert not device.add(storage, chunks["small"], torch.zeros(16)[::2], "small")  # not contiguous
    assert not device.add(storage, chunks["small"], torch.zeros(8)._neg_view(), "small")
    device.join()


def test_a_damaged_chunk_fails_the_join_and_nothing_waits_forever(tmp_path):
    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(12)}  # 4 KiB each
    storage, chunks = _saved(tmp_path, state)
    victim = chunks["t5"][0]
    data = tmp_path / "s" / victim.file
    raw = bytearray(data.read_bytes())
    raw[victim.offset + 7] ^= 0xFF
    data.write_bytes(bytes(raw))
    storage = open_storage(str(tmp_path / "s"))
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    device = DeviceReads(ReadBatch(), buffer_bytes=8 * KiB, buffers=1)  # one buffer: each batch waits for it
    with pytest.raises(CorruptSnapshotError, match=r"checksum mismatch .*\(t5\)"):
        for key in state:
            device.add(storage, chunks[key], targets[key], key)
        device.join()
    assert_same({k: targets[k] for k in ("t0", "t1", "t10", "t11")}, {k: state[k] for k in ("t0", "t1", "t10", "t11")})
