"""Many small device tensors restored in bulk through host slabs (``engine/_restore/device_slabs.py``), tested on
CPU tensors standing in for device ones (the bulk path is told they are not in host memory): each slab the exact
concatenation of its targets, one copy per slab, a slab copied by the read that completes it and placed into again,
the bound on the slabs held, damaged chunks, negative views. tests/test_cuda.py restores thousands of small CUDA
tensors through the same path."""
from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest
import torch

from _asserts import assert_same
from ppe_snapshot import CorruptSnapshotError, Snapshot, StateDict
from ppe_snapshot.engine._restore import bulk, device_slabs
from ppe_snapshot.engine._restore.device_slabs import DeviceSlabs


@pytest.fixture
def on_device(monkeypatch):
    """Every bulk target treated as a device one; each slab's copy recorded as (dtype, tensors, the thread)."""
    monkeypatch.setattr(bulk, "in_host_memory", lambda target: False)
    copies: list[tuple[torch.dtype, int, str]] = []
    to_device = device_slabs._to_device

    def recorded(slab):
        copies.append((slab.dtype, len(slab.targets), threading.current_thread().name))
        return to_device(slab)
    monkeypatch.setattr(device_slabs, "_to_device", recorded)
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
    assert sorted((copy[:2] for copy in on_device), key=str) == sorted(
        [(torch.float32, 301), (torch.int64, 50), (torch.bool, 1), (torch.float16, 1), (torch.bfloat16, 1)],
        key=str)  # one slab per dtype, each copied once


@pytest.mark.parametrize("mixed", [False, True], ids=["flat", "mixed"])
def test_targets_receive_the_values_in_negative_and_conjugate_views_too(tmp_path, on_device, mixed):
    """A slab is copied into its targets in one call (one split copy where every target is flat); a negative or
    conjugate view among them still shows the saved values, not the saved bytes."""
    g = torch.Generator().manual_seed(1)
    state = {f"v{i}": torch.randn(i % 7 + 1, generator=g) for i in range(40)}
    state.update({f"c{i}": torch.randn(i + 2, dtype=torch.complex64, generator=g) for i in range(3)})
    state.update(negated=torch.randn(9, generator=g), conjugated=torch.randn(4, dtype=torch.complex64, generator=g))
    if mixed:  # matrices and scalars among the vectors, a conjugate matrix among the complex ones
        state.update({f"m{i}": torch.randn(i % 3 + 1, 5, generator=g) for i in range(10)})
        state.update({f"s{i}": torch.tensor(float(i)) for i in range(5)})
        state["conjugated"] = torch.randn(2, 2, dtype=torch.complex64, generator=g)
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(state)})
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    targets.update(negated=torch.zeros(9)._neg_view(), conjugated=torch.zeros_like(state["conjugated"]).conj())
    Snapshot(str(tmp_path / "s")).restore({"m": StateDict(targets)})
    assert_same({k: v.resolve_neg().resolve_conj() for k, v in targets.items()}, state)
    floats = 41 + (15 if mixed else 0)
    assert sorted((copy[:2] for copy in on_device), key=str) == [(torch.complex64, 4), (torch.float32, floats)]


def test_slabs_are_copied_each_time_the_bound_is_reached(tmp_path, on_device, monkeypatch):
    monkeypatch.setattr(device_slabs, "SLAB_BYTES", 1024)
    monkeypatch.setattr(device_slabs, "HELD_BYTES", 4096)
    made = []
    host_buffer = device_slabs.host_buffer
    monkeypatch.setattr(device_slabs, "host_buffer", lambda *a: made.append(a) or host_buffer(*a))
    state = _state()
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(state)})
    targets = _targets(state)
    Snapshot(str(tmp_path / "s")).restore({"m": StateDict(targets)})
    assert_same({k: v.resolve_neg() for k, v in targets.items()}, state)
    assert len(on_device) > 3 and sum(n for _, n, _ in on_device) == len(state) - 1  # all but "big"
    assert len(made) <= 4  # never more than the bound's 4 slabs of 1 KiB: the others placed into again


def test_a_closed_slab_is_copied_by_the_read_that_lands_its_last_bytes(tmp_path, on_device, monkeypatch):
    """Slabs of 1 KiB: every slab the walk closed is copied on the read thread that completed it; only the one
    left open per dtype is copied at the end of the walk, on its thread."""
    monkeypatch.setattr(device_slabs, "SLAB_BYTES", 1024)
    state = _state()
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(state)})
    targets = _targets(state)
    Snapshot(str(tmp_path / "s")).restore({"m": StateDict(targets)})
    assert_same({k: v.resolve_neg() for k, v in targets.items()}, state)
    walk = threading.current_thread().name
    assert sorted((dtype for dtype, _, thread in on_device if thread == walk), key=str) == sorted(
        [torch.float32, torch.int64, torch.bool, torch.float16, torch.bfloat16], key=str)
    on_reads = [thread for _, _, thread in on_device if thread != walk]
    assert len(on_reads) > 10 and all(thread.startswith("ppe-snapshot-read") for thread in on_reads)


def _fill(address: int, values: torch.Tensor) -> None:
    ctypes.memmove(address, values.data_ptr(), values.nbytes)


def _place(slabs: DeviceSlabs, target: torch.Tensor) -> int | None:
    """Where the walk would place ``target`` alone (its dtype and flatness it knows from the index); None where it
    is larger than a slab (the walk sends it the usual way)."""
    if target.nbytes > slabs.slab_bytes:
        return None
    (address,) = slabs.place_many([target], np.array([target.nbytes]), [target.dtype], [target.dim() == 1]).tolist()
    return address


def test_a_slab_is_copied_once_closed_and_landed_then_placed_into_again():
    slabs = DeviceSlabs(slab_bytes=64, held_bytes=1 << 20)
    a, b, c, d = torch.zeros(4), torch.zeros(4), torch.zeros(16), torch.zeros(16)
    first, second = _place(slabs, a), _place(slabs, b)
    _fill(first, torch.full((4,), 1.0))
    _fill(second, torch.full((4,), 2.0))
    slabs.landed([first], [16])
    third = _place(slabs, c)  # no room left: a and b's slab is closed, with b's bytes not landed yet
    assert not a.any() and not b.any()
    slabs.landed([second, 64], [16, 8])  # (an address outside every slab is left alone)
    assert a.eq(1).all() and b.eq(2).all()  # closed, all landed: copied
    _fill(third, torch.full((16,), 3.0))
    slabs.landed([third], [64])
    assert not c.any()  # still open
    assert _place(slabs, d) in (first, third)  # c's slab closed (copied at once), d in a slab copied out of
    assert c.eq(3).all()
    slabs.copy()  # d's slab, open: nothing landed in it, so it holds c's or a and b's bytes
    assert d.eq(3).all() or d[:8].tolist() == [1.0] * 4 + [2.0] * 4


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
    first = _place(slabs, a)
    assert _place(slabs, b) is not None and _place(slabs, c) == first + 16  # after a, in the float32 slab
    assert _place(slabs, torch.zeros(32)) is None  # larger than a slab: the usual path
    assert _place(slabs, torch.zeros(8)) != first + 48  # would overflow the slab: a new one


def test_a_batch_is_placed_per_kind_in_order_and_in_part_at_the_bound():
    """``place_many``: runs of one device and dtype each follow the last place of their kind, in the order given,
    a new slab where one is full; where the slabs in use would pass the bound, it stops, and after ``copy`` the
    rest is placed in the slabs copied out of."""
    slabs = DeviceSlabs(slab_bytes=64, held_bytes=192)
    floats = [torch.zeros(4) for _ in range(5)]  # 16 bytes each
    longs = [torch.zeros(2, dtype=torch.int64) for _ in range(3)]
    meta = torch.zeros(4, device="meta")  # another device: a slab of its own
    batch = [floats[0], floats[1], longs[0], longs[1], meta, floats[2], floats[3], floats[4], longs[2]]
    nbytes = np.array([t.nbytes for t in batch])
    got = slabs.place_many(batch, nbytes, [t.dtype for t in batch], [True] * len(batch)).tolist()
    assert len(got) == 7  # three slabs (float32, int64, meta) hold 192 bytes: floats[4] would need a fourth
    f0, f1, l0, l1, m0, f2, f3 = got
    assert (f1, f2, f3) == (f0 + 16, f0 + 32, f0 + 48) and l1 == l0 + 16 and len({f0, l0, m0}) == 3
    slabs.copy()
    rest = slabs.place_many(batch[7:], nbytes[7:], [torch.float32, torch.int64], [True, True]).tolist()
    assert len(rest) == 2 and rest[0] != rest[1] and {rest[0], rest[1]} <= {f0, l0, m0}  # slabs copied out of


def test_a_batch_of_one_dtype_on_two_devices_gets_a_slab_per_device():
    slabs = DeviceSlabs(slab_bytes=64, held_bytes=1 << 20)
    batch = [torch.zeros(4), torch.zeros(4, device="meta"), torch.zeros(4), torch.zeros(4, device="meta")]
    got = slabs.place_many(batch, np.array([16] * 4), [torch.float32] * 4, [True] * 4).tolist()
    assert got[2] == got[0] + 16 and got[3] == got[1] + 16 and abs(got[1] - got[0]) >= 64
