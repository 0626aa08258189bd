"""Background takes, and the memory the engine holds while taking and reading.

Memory is measured in a fresh Python process, one engine call at a time,
with the state already allocated and touched: the peak resident set size is
reset right before the call (``/proc/self/clear_refs``) and read right after
it (``VmHWM``), so the difference is what the call itself held at its peak.
``ru_maxrss`` cannot be used for this: a child inherits its parent's peak at
exec, so a pytest process that once held more hides the child's own peak.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

from ppe_snapshot import CorruptSnapshotError, Snapshot, SnapshotNotFoundError, StateDict, StateMismatchError
from ppe_snapshot.engine._util.gcpause import gc_paused
from ppe_snapshot.engine._files.packing import HOST_COPY_BYTES
from ppe_snapshot.engine._files.reads import ReadBatch

MiB = 1 << 20
needs_peak_reset = pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                                      reason="measuring a call's peak memory needs Linux /proc/self/clear_refs")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))


# -- async_take ---------------------------------------------------------------------

def test_async_take_snapshots_the_state_at_the_call(tmp_path):
    model = _model()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    pending = Snapshot.async_take(str(tmp_path / "s"), {"model": model, "optim": optim})
    with torch.no_grad():
        for t in model.state_dict().values():
            t.add_(1)
    snapshot = pending.wait()
    assert pending.done()
    assert snapshot.path == str(tmp_path / "s")

    fresh = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    Snapshot(str(tmp_path / "s")).restore({"model": fresh})
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, before[k]), k
        assert not torch.equal(v, model.state_dict()[k]), k


def test_async_take_failure_is_raised_by_wait(tmp_path):
    path = tmp_path / "s"
    path.mkdir()
    (path / "data").write_text("a file where the data directory must go")

    pending = Snapshot.async_take(str(path), {"s": StateDict(x=torch.ones(1000))})
    with pytest.raises(OSError) as info:
        pending.wait()
    assert str(path / "data") in str(info.value)
    assert pending.done()
    assert sorted(os.listdir(path)) == ["data"]  # no manifest, nothing else
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(str(path)).restore({"s": StateDict()})


# -- reads through a bounded buffer ------------------------------------------------

def test_reads_started_before_the_walk_ends_are_all_verified(tmp_path, monkeypatch):
    """Reads start in batches while restore still walks the manifest; each batch is checked, and a
    damaged tensor in the first, a middle or the last batch fails the restore and names that tensor."""
    monkeypatch.setattr(ReadBatch, "MAX_RUN", 16 << 10)  # a batch every 4 tensors of 4 KiB
    torch.manual_seed(0)
    saved = {f"t{i}": torch.randn(1024) for i in range(40)}
    path = str(tmp_path / "s")
    Snapshot.take(path, {"s": StateDict(saved)})
    out = StateDict({k: torch.zeros(1024) for k in saved})
    Snapshot(path).restore({"s": out})
    assert all(torch.equal(out[k], v) for k, v in saved.items())

    manifest = Snapshot(path).get_manifest()
    data = tmp_path / "s" / "data" / "rank0.bin"
    for name in ("t0", "t21", "t39"):
        offset = manifest[f"0/s/{name}"].chunks[0].offset + 17
        with open(data, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x01]))
        with pytest.raises(CorruptSnapshotError, match=f"checksum mismatch .*s/{name}\\)"):
            Snapshot(path).restore({"s": StateDict({k: torch.zeros(1024) for k in saved})})
        with open(data, "r+b") as f:
            f.seek(offset)
            f.write(byte)


def test_the_garbage_collector_is_paused_only_inside_engine_calls(tmp_path):
    """Pausing it nests across threads; it is enabled again only if it was enabled before."""
    assert gc.isenabled()
    path = str(tmp_path / "s")
    Snapshot.take(path, {"m": _model()})
    assert gc.isenabled()
    with pytest.raises(StateMismatchError):
        Snapshot(path).restore({"m": nn.Sequential(nn.Linear(8, 17), nn.BatchNorm1d(17), nn.Linear(17, 4))})
    assert gc.isenabled()

    inner_entered, outer_may_end = threading.Event(), threading.Event()

    def other_thread() -> None:
        with gc_paused():
            inner_entered.set()
            outer_may_end.wait(10)
            assert not gc.isenabled()

    thread = threading.Thread(target=other_thread)
    with gc_paused():
        thread.start()
        inner_entered.wait(10)
    assert not gc.isenabled()  # the other thread's pause is still on
    outer_may_end.set()
    thread.join()
    assert gc.isenabled()

    gc.disable()
    try:
        Snapshot(path).restore({"m": _model()})
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_strided_read_across_chunks_is_verified(tmp_path):
    """An 80 MiB tensor in blocks of 64 MiB is two chunks (64 + 16 MiB); a 24 MiB budget makes one read straddle
    them."""
    rows, cols = 5120, 4096
    bits = torch.arange(rows * cols, dtype=torch.int32)
    path = str(tmp_path / "s")
    Snapshot.take(path, {"s": StateDict(big=bits.view(torch.float32).reshape(rows, cols))}, block_bytes=64 * MiB)
    entry = Snapshot(path).get_manifest()["0/s/big"]
    assert [c.nbytes for c in entry.chunks] == [64 * MiB, 16 * MiB]

    out = torch.zeros(cols, rows).t()
    got = Snapshot(path).read_object("0/s/big", obj_out=out, memory_budget_bytes=24 * MiB)
    assert got is out and torch.equal(out.contiguous().view(torch.int32).reshape(-1), bits)

    data = tmp_path / "s" / "data" / "rank0.bin"
    for flip_at in (entry.chunks[0].offset + 63 * MiB, entry.chunks[1].offset + 15 * MiB):
        with open(data, "r+b") as f:
            f.seek(flip_at)
            byte = f.read(1)
            f.seek(flip_at)
            f.write(bytes([byte[0] ^ 0x01]))
        with pytest.raises(CorruptSnapshotError, match="checksum mismatch"):
            Snapshot(path).read_object("0/s/big", obj_out=torch.zeros(cols, rows).t(), memory_budget_bytes=24 * MiB)
        with open(data, "r+b") as f:
            f.seek(flip_at)
            f.write(byte)


# -- memory, measured in a fresh process ------------------------------------------

_CHILD = r"""
import json, sys
import torch
from ppe_snapshot import Snapshot, StateDict

def peak() -> int:  # the peak resident set size since the last reset_peak(), in bytes
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

def reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return peak()

def counting(rows, cols, start=0):  # float32 tensor whose bits count up
    return torch.arange(start, start + rows * cols, dtype=torch.int32).view(torch.float32).reshape(rows, cols)

def same_bits(a, b):
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))

root = sys.argv[1]
result = {}

# One 256 MiB tensor, read back with a 16 MiB budget into a contiguous and a non-contiguous target.
Snapshot.take(root + "/big", {"s": StateDict(big=counting(8192, 8192))})
for name, make in [("read-contiguous", lambda: torch.zeros(8192, 8192)),
                   ("read-noncontiguous", lambda: torch.zeros(8192, 8192).t())]:
    out = make()
    before = reset_peak()
    got = Snapshot(root + "/big").read_object("0/s/big", obj_out=out, memory_budget_bytes=16 << 20)
    result[name] = {"growth": peak() - before, "in_place": got is out,
                    "equal": same_bits(out, counting(8192, 8192))}
    del out, got

# A sync take of 8 x 64 MiB, then of one transposed 128 MiB tensor.
for name, tensors in [("take", lambda: {f"w{i}": counting(4096, 4096, i) for i in range(8)}),
                      ("take-transposed", lambda: {"w0": counting(4096, 8192).t()})]:
    state = StateDict(tensors())
    before = reset_peak()
    Snapshot.take(root + "/" + name, {"s": state})
    result[name] = {"growth": peak() - before}
    restored = StateDict()
    Snapshot(root + "/" + name).restore({"s": restored})
    result[name]["equal"] = all(same_bits(restored[k], v) for k, v in state.items())
    del state, restored
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def memory(tmp_path_factory) -> dict:
    """Per measured call: the peak memory it added ("growth", bytes) and whether the data came back whole."""
    root = tmp_path_factory.mktemp("memory")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(root)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["root"] = root
    return result


@needs_peak_reset
@pytest.mark.parametrize("mode", ["read-contiguous", "read-noncontiguous"])
def test_read_object_memory_budget(memory, mode):
    result = memory[mode]
    assert result["in_place"] and result["equal"]
    assert result["growth"] < 64 * MiB, f"reading 256 MiB held {result['growth'] / MiB:.0f} MiB extra"


@needs_peak_reset
def test_sync_take_holds_no_copy_of_the_state(memory):
    state_bytes = 8 * (64 << 20)
    result = memory["take"]
    assert result["equal"]
    assert result["growth"] <= state_bytes // 10, f"take held {result['growth'] / MiB:.0f} MiB extra"
    assert os.path.getsize(memory["root"] / "take" / "data" / "rank0.bin") == state_bytes


@needs_peak_reset
def test_sync_take_of_non_contiguous_tensors_is_bounded(memory):
    result = memory["take-transposed"]
    assert result["equal"]
    assert result["growth"] <= HOST_COPY_BYTES + 16 * MiB, f"take held {result['growth'] / MiB:.0f} MiB extra"
