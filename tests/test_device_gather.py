"""Small device tensors staged in one go (``engine/_take/device_gather.py``), tested on CPU tensors standing in for
device ones: which tensors form a run, the run's bytes in the image (padding zeroed, nothing outside it touched),
and staging through it bit-exact. tests/test_cuda.py stages many small CUDA tensors through the same path."""
from __future__ import annotations

import numpy as np
import torch

from ppe_snapshot import Snapshot, StateDict
from ppe_snapshot.engine import LOCAL, new_staging_buffer, prepare_take
from ppe_snapshot.engine._files import ALIGNMENT
from ppe_snapshot.engine._take import device_gather, staging
from ppe_snapshot.engine._take.device_gather import DeviceGather
from test_staging import assert_values, mixed_state, mutate, values_of


def test_runs_are_cut_by_gaps_by_other_payloads_and_by_their_span(monkeypatch):
    monkeypatch.setattr(device_gather, "RUN_BYTES", 1024)
    gather = DeviceGather()
    a, b, c, d, e = (torch.full((n,), float(i + 1)) for i, n in enumerate((10, 16, 4, 200, 100)))
    gather.add(a, 0, 40)
    gather.add(b, 64, 64)  # only padding between: the same run
    gather.add(c, 192, 16)  # a gap of ALIGNMENT bytes (another payload's room): a new run
    gather.break_run()
    gather.add(d, 256, 800)  # after something else: a new run
    gather.add(e, 1088, 400)  # would make the run span more than RUN_BYTES: a new run
    assert [[offset for _, offset, _ in run.tensors] for run in gather.runs] == [[0, 64], [192], [256], [1088]]
    assert 192 - (64 + 64) == ALIGNMENT

    image = torch.full((1600,), 0xEE, dtype=torch.uint8)
    assert gather.copy_into(image) is False  # nothing left running off the host
    as_floats = image.view(torch.float32)
    assert torch.equal(as_floats[:10], a) and torch.equal(as_floats[16:32], b)
    assert torch.equal(as_floats[48:52], c) and torch.equal(as_floats[64:264], d)
    assert torch.equal(as_floats[272:372], e)
    assert image[40:64].eq(0).all() and image[208:256].eq(0).all()  # padding after each tensor: zeroed, ...
    assert image[1056:1088].eq(0).all() and image[1488:1536].eq(0).all()  # ... up to the next ALIGNMENT, after
    assert image[128:192].eq(0xEE).all()  # a run's last tensor too; between runs: not the runs' bytes
    assert image[1536:].eq(0xEE).all()


def test_a_run_of_one_dtype_is_gathered_as_it_is_and_a_run_of_several_as_bytes():
    """Tensors of any shape (a scalar, a matrix) in a run of one dtype, and a run mixing dtypes, land at their
    offsets in the image, the padding after each zeroed."""
    scalar, matrix, vector = torch.tensor(2.5), torch.arange(6.0).reshape(2, 3), torch.full((3,), -1.0)
    flags, halves, longs = torch.tensor([True, False, True]), torch.arange(5).half(), torch.arange(3)
    eights = torch.arange(7.0).to(torch.float8_e4m3fn).reshape(7, 1)  # a dtype concatenated as bytes
    gather = DeviceGather()
    for tensor, offset in ((scalar, 0), (matrix, 64), (vector, 128)):
        gather.add(tensor, offset, tensor.nbytes)
    gather.break_run()
    for tensor, offset in ((flags, 192), (halves, 256), (longs, 320)):
        gather.add(tensor, offset, tensor.nbytes)
    gather.break_run()
    gather.add(eights, 384, 7)
    gather.add(eights, 448, 7)
    assert [run.dtype for run in gather.runs] == [torch.float32, None, torch.float8_e4m3fn]

    image = torch.full((512,), 0xEE, dtype=torch.uint8)
    assert gather.copy_into(image) is False
    placed = ((scalar, 0), (matrix, 64), (vector, 128), (flags, 192), (halves, 256), (longs, 320), (eights, 384),
              (eights, 448))
    for tensor, offset in placed:
        assert torch.equal(image[offset:offset + tensor.nbytes], tensor.reshape(-1).view(torch.uint8))
        end = offset + tensor.nbytes
        assert image[end:-(-end // 64) * 64].eq(0).all()


def test_staging_through_the_gather_is_the_state_at_the_call(monkeypatch, tmp_path):
    """The small tensors of a state of every layout gathered as if they lay on a device; the values at the call
    restored bit-exact after the state changed, twice (the second take stages into the first one's buffer)."""
    monkeypatch.setattr(staging, "on_device", lambda layout: True)
    monkeypatch.setattr(staging, "is_copyable_raw", lambda tensor: False)
    monkeypatch.setattr(staging, "gathers", device_gather.gatherable)  # (the rule, but for the device)
    runs: list[int] = []
    copy_into = DeviceGather.copy_into
    monkeypatch.setattr(DeviceGather, "copy_into",
                        lambda self, buffer: runs.extend(len(r.tensors) for r in self.runs) or copy_into(self, buffer))
    for i in range(2):
        state, owners = mixed_state()
        mutate(owners[i:])
        expected = values_of(state)
        pending = Snapshot.async_take(str(tmp_path / f"s{i}"), {"state": StateDict(state)})
        mutate(owners)
        pending.wait()
        assert_values(Snapshot(str(tmp_path / f"s{i}")).read_object("0/state"), expected)
    assert len(runs) == 2 and runs[0] == runs[1] >= 300  # per take, the small tensors (plain ones first) in a run
    assert not device_gather.gatherable(torch.zeros(4, 4).t(), 64)  # copied on their own: not contiguous, ...
    assert not device_gather.gatherable(torch.zeros(4)._neg_view(), 16)  # ... a negative view, ...
    assert not device_gather.gatherable(torch.zeros(1 << 18), 1 << 20)  # ... not small


def test_a_reused_buffer_holds_nothing_of_its_last_image_where_device_tensors_go(monkeypatch, tmp_path):
    """Staging leaves a device tensor's slot to its stager (the gather writes its runs' slots whole; a device tensor
    copied on its own, or from another take's image, has its padding zeroed after it): with every plain tensor
    standing in for a device one, a dirty buffer staged again, through an image or not, is the very file a sync
    take writes."""
    state, _ = mixed_state()
    state["big"] = torch.randn((1 << 20) // 4 + 3)  # too large to gather: copied on its own
    Snapshot.take(str(tmp_path / "sync"), {"state": StateDict(state)})
    expected = (tmp_path / "sync" / "data" / "rank0.bin").read_bytes()
    monkeypatch.setattr(staging, "on_device", lambda layout: True)
    monkeypatch.setattr(staging, "is_copyable_raw", lambda tensor: False)
    monkeypatch.setattr(staging, "gathers", device_gather.gatherable)
    monkeypatch.setattr(staging, "device_rows", lambda layout: np.arange(len(layout.sizes)) < len(layout.tensors))
    first = prepare_take(str(tmp_path / "first"), {"state": StateDict(state)}, pg=LOCAL)
    image = first.stage(new_staging_buffer(first.layout.size), keep_image=True)
    for name, source in (("plain", None), ("through an image", image)):
        job = prepare_take(str(tmp_path / name), {"state": StateDict(state)}, pg=LOCAL)
        dirty = new_staging_buffer(job.layout.size)
        dirty.fill_(0xAB)  # the last image
        job.stage(dirty, image=source)
        job.write_and_commit()
        assert (tmp_path / name / "data" / "rank0.bin").read_bytes() == expected, name
