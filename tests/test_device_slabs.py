"""Many small device tensors restored in bulk through host slabs (``engine/_restore/device_slabs.py``), tested on
CPU tensors standing in for device ones (the bulk path is told they are not in host memory): each slab the exact
concatenation of its targets, one copy per slab, the bound on the slabs held, damaged chunks, negative views.
tests/test_cuda.py restores thousands of small CUDA tensors through the same path."""
from __future__ import annotations

import pytest
import torch

from _asserts import assert_same
from ppe_snapshot import CorruptSnapshotError, Snapshot, StateDict
from ppe_snapshot.engine._restore import bulk, device_slabs
from ppe_snapshot.engine._restore.device_slabs import DeviceSlabs


@pytest.fixture
def on_device(monkeypatch):
    """Every bulk target treated as a device one; each copy's slabs recorded as (dtype, tensors)."""
    monkeypatch.setattr(bulk, "in_host_memory", lambda target: False)
    copies: list[list[tuple[torch.dtype, int]]] = []
    copy = DeviceSlabs.copy

    def recorded(self):
        copies.append(sorted(((slab.dtype, len(slab.targets)) for slab in
                              self._filled + list(self._open.values())), key=str))
        copy(self)
    monkeypatch.setattr(DeviceSlabs, "copy", recorded)
    return copies


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {f"f{i}": torch.randn(i % 9 + 1, 3, generator=g) for i in range(300)}
    state.update({f"i{i}": torch.randint(0, 99, (i % 5 + 1,), generator=g) for i in range(50)})
    state.update(flags=torch.rand(11, generator=g) > 0.5, half=torch.randn(6, generator=g).half(),
                 bf16=torch.randn(5, generator=g).bfloat16(), negated=torch.randn(7, generator=g),
                 big=torch.randn(300_000, generator=g))  # over SMALL_BYTES: the usual path
    return state


def _targets(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    targets["negated"] = torch.zeros(7)._neg_view()  # shows its memory negated
    return targets


def test_small_targets_go_through_one_slab_per_dtype(tmp_path, on_device):
    state = _state()
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(state)})
    targets = _targets(state)
    Snapshot(str(tmp_path / "s")).restore({"m": StateDict(targets)})
    assert_same({k: v.resolve_neg() for k, v in targets.items()}, state)
    assert on_device == [sorted([(torch.float32, 301), (torch.int64, 50), (torch.bool, 1), (torch.float16, 1),
                                 (torch.bfloat16, 1)], key=str)]  # one copy, one slab per dtype


def test_slabs_are_copied_each_time_the_bound_is_reached(tmp_path, on_device, monkeypatch):
    monkeypatch.setattr(device_slabs, "SLAB_BYTES", 1024)
    monkeypatch.setattr(device_slabs, "HELD_BYTES", 4096)
    state = _state()
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(state)})
    targets = _targets(state)
    Snapshot(str(tmp_path / "s")).restore({"m": StateDict(targets)})
    assert_same({k: v.resolve_neg() for k, v in targets.items()}, state)
    assert len(on_device) > 3  # copied during the walk, each time 4 slabs were in use, and at its end
    assert sum(n for copy in on_device for _, n in copy) == len(state) - 1  # all but "big"


def test_a_damaged_chunk_names_its_tensor(tmp_path, on_device):
    state = _state()
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(state)})
    data = next((tmp_path / "s" / "data").iterdir())
    raw = bytearray(data.read_bytes())
    entry = Snapshot(str(tmp_path / "s")).get_manifest()["0/m/i7"]
    raw[entry.chunks[0].offset] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptSnapshotError, match=r"checksum mismatch .*m/i7"):
        Snapshot(str(tmp_path / "s")).restore({"m": StateDict(_targets(state))})


def test_places_follow_one_another_per_kind():
    slabs = DeviceSlabs(slab_bytes=64, held_bytes=1 << 20)
    a, b, c = torch.zeros(4), torch.zeros(2, dtype=torch.int64), torch.zeros(8)
    first = slabs.place(a, 16)
    assert slabs.place(b, 16) is not None and slabs.place(c, 32) == first + 16  # after a, in the float32 slab
    assert slabs.place(torch.zeros(32), 128) is None  # larger than a slab: the usual path
    assert slabs.place(torch.zeros(8), 32) != first + 48  # would overflow the slab: a new one
