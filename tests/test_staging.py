"""Staging: the copy a background save makes in the caller, and the host memory it goes to."""
from __future__ import annotations

import ctypes
import fractions
import os
import pickle
import resource
import time

import numpy as np
import pytest
import torch

from ppe_snapshot import Snapshot
from ppe_snapshot.engine import LOCAL, MANIFEST_NAME, StateDict, new_shared_buffer, new_staging_buffer, prepare_take
from ppe_snapshot.engine._take.staging import SMALL_COPY_BYTES, stage
from ppe_snapshot.writing import ProcessQueueWriter, ProcessWriter, ThreadQueueWriter, ThreadWriter
from _asserts import assert_same

PAGE = os.sysconf("SC_PAGE_SIZE")


def mixed_state() -> tuple[dict, list]:
    """Every way a tensor reaches staging: small (one memmove each) and large (``copy_``), contiguous with an
    offset, transposed, conjugate and negative views, 0-d, empty, several dtypes, and a numpy array. Also the
    tensors and arrays that own the memory, for the test to mutate."""
    g = torch.Generator().manual_seed(0)
    complex_base = torch.randn(6, dtype=torch.complex64, generator=g)
    neg_base = torch.randn(8, generator=g)
    sliced_base = torch.randn(100, generator=g)
    transposed_base = torch.randn(5, 7, generator=g)
    large = torch.randn(SMALL_COPY_BYTES // 4 + 1000, generator=g)  # past the memmove size: copy_
    small = {f"t{i}": torch.randn(i % 7 + 1, generator=g) for i in range(300)}
    state = {
        "small": small,
        "large": large,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "int64": torch.randint(-5, 5, (33,), dtype=torch.int64, generator=g),
        "bool": torch.rand(17, generator=g) > 0.5,
        "bfloat16": torch.randn(9, generator=g).to(torch.bfloat16),
        "sliced": sliced_base[10:50],
        "transposed": transposed_base.t(),
        "conj": complex_base.conj(),
        "neg": neg_base._neg_view(),
        "array": np.arange(12, dtype=np.float64).reshape(3, 4),
    }
    owners = [*small.values(), large, state["scalar"], state["int64"], state["bool"], state["bfloat16"],
              sliced_base, transposed_base, complex_base, neg_base, state["array"]]
    return state, owners


def values_of(state):
    """The values the state holds now, as plain tensors and arrays of their own."""
    if isinstance(state, dict):
        return {k: values_of(v) for k, v in state.items()}
    if isinstance(state, np.ndarray):
        return state.copy()
    return state.resolve_conj().resolve_neg().clone()


def assert_values(actual, expected) -> None:
    """Bit-exact, numpy arrays included (same dtype, same values)."""
    def tensors(state):
        if isinstance(state, dict):
            return {k: tensors(v) for k, v in state.items()}
        return torch.from_numpy(state) if isinstance(state, np.ndarray) else state
    assert isinstance(actual["array"], np.ndarray)
    assert_same(tensors(actual), tensors(expected))


def mutate(owners) -> None:
    """What a training step does right after the call returns: every byte changes, in place."""
    for owner in owners:
        if isinstance(owner, np.ndarray):
            owner += 1
        elif owner.dtype == torch.bool:
            owner.logical_not_()
        else:
            owner.add_(1)


@pytest.fixture(scope="module")
def process_writers():
    writers = {"process": ProcessWriter(), "process_queue": ProcessQueueWriter(queue_depth=2)}
    yield writers
    for writer in writers.values():
        writer.finalize()


@pytest.mark.parametrize("kind", ["thread", "thread_queue", "process", "process_queue"])
def test_snapshot_is_the_state_at_the_call_bit_exact(kind, process_writers, tmp_path):
    writer = process_writers[kind] if kind.startswith("process") else \
        {"thread": ThreadWriter, "thread_queue": ThreadQueueWriter}[kind]()
    try:
        for i in range(3):  # the later rounds stage into the buffer the first one allocated
            state, owners = mixed_state()
            mutate(owners[i:])  # other values each round
            expected = values_of(state)
            writer(f"snap{i}", str(tmp_path), state)
            mutate(owners)  # at once, while the write goes on
            writer.wait()
            restored = Snapshot(str(tmp_path / f"snap{i}")).read_object("0/state")
            assert_values(restored, expected)
            assert writer.last_stats["staging_s"] <= writer.last_stats["blocking_s"]
    finally:
        if not kind.startswith("process"):
            writer.finalize()


def test_async_take_is_the_state_at_the_call_bit_exact(tmp_path):
    state, owners = mixed_state()
    expected = values_of(state)
    pending = Snapshot.async_take(str(tmp_path / "s"), {"state": StateDict(state)})
    mutate(owners)
    assert_values(pending.wait().read_object("0/state"), expected)


def test_staged_image_holds_each_payload_at_its_offset(tmp_path):
    state, _ = mixed_state()
    job = prepare_take(str(tmp_path / "s"), {"state": StateDict(state)}, pg=LOCAL)
    buffer = new_staging_buffer(job.layout.size)
    buffer.fill_(0xAB)  # the pads keep what was there; the payloads must all be overwritten
    stage(job.layout, buffer)
    layout = job.layout
    assert len(layout.tensors) > 300  # the plain tensors' rows come first, then the other payloads
    for path, data, offset, nbytes in zip(layout.paths, layout.datas(), layout.offsets, layout.sizes):
        value = np.ascontiguousarray(data) if isinstance(data, np.ndarray) else values_of(data).contiguous()
        expected = value.reshape(-1).view(np.uint8) if isinstance(value, np.ndarray) else \
            value.reshape(-1).view(torch.uint8).numpy()
        assert bytes(buffer[offset:offset + nbytes].numpy()) == expected.tobytes(), path


def test_a_reused_buffer_leaves_nothing_of_its_last_image_in_the_file(tmp_path):
    """A writer's buffer holds the previous snapshot's image: staged again, the bytes between the payloads are
    zeroed, so the file an async take writes from it is the very file a sync take writes."""
    state, _ = mixed_state()
    state["big"] = torch.randn(3 * SMALL_COPY_BYTES // 4 + 5)  # a large payload between runs of small ones
    state["after"] = {f"u{i}": torch.randn(i % 5 + 1) for i in range(50)}
    Snapshot.take(str(tmp_path / "sync"), {"state": StateDict(state)})
    expected = (tmp_path / "sync" / "data" / "rank0.bin").read_bytes()
    job = prepare_take(str(tmp_path / "s"), {"state": StateDict(state)}, pg=LOCAL)
    buffer = new_staging_buffer(job.layout.size + 100)
    buffer.fill_(0xAB)  # the last image
    stage(job.layout, buffer, reused=True)
    assert bytes(buffer[:job.layout.size].numpy()) == expected

    dirty = new_staging_buffer(job.layout.size)
    dirty.fill_(0xCD)
    Snapshot.async_take(str(tmp_path / "async"), {"state": StateDict(state)}, staging=lambda n: dirty).wait()
    assert (tmp_path / "async" / "data" / "rank0.bin").read_bytes() == expected


def test_async_take_stages_into_the_buffer_of_its_last_call(tmp_path):
    """``Snapshot.async_take`` keeps the buffer of a write that ended and stages the next call into it (its pages
    are already there): one idle buffer, the largest, whatever the number of calls; the file is the very file a
    sync take writes, with nothing of the older, larger image in it."""
    Snapshot.release_staging()
    large = {"w": torch.full((3 << 20,), 7.0)}  # 12 MiB of sevens, then a smaller state staged over them
    Snapshot.async_take(str(tmp_path / "large"), {"state": StateDict(large)}).wait()
    state, _ = mixed_state()
    Snapshot.take(str(tmp_path / "sync"), {"state": StateDict(state)})
    before = _minor_faults()
    for i in range(3):
        Snapshot.async_take(str(tmp_path / f"small{i}"), {"state": StateDict(state)}).wait()
        assert (tmp_path / f"small{i}" / "data" / "rank0.bin").read_bytes() == \
            (tmp_path / "sync" / "data" / "rank0.bin").read_bytes()
    assert _minor_faults() - before < (12 << 20) // PAGE // 4  # not one fresh 12 MiB buffer a call
    held = Snapshot.release_staging()
    assert 12 << 20 <= held < 13 << 20  # the large one, kept alone
    assert Snapshot.release_staging() == 0


def test_async_takes_in_flight_together_stage_into_buffers_of_their_own(tmp_path):
    Snapshot.release_staging()
    a, b = {"x": torch.full((1 << 20,), 1.0)}, {"x": torch.full((2 << 20,), 2.0)}
    first = Snapshot.async_take(str(tmp_path / "a"), {"state": StateDict(a)})
    second = Snapshot.async_take(str(tmp_path / "b"), {"state": StateDict(b)})
    a["x"].fill_(-1.0), b["x"].fill_(-2.0)
    assert torch.equal(first.wait().read_object("0/state/x"), torch.full((1 << 20,), 1.0))
    assert torch.equal(second.wait().read_object("0/state/x"), torch.full((2 << 20,), 2.0))
    assert 8 << 20 <= Snapshot.release_staging() < 9 << 20  # of the two given back, the larger is kept


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.parametrize("make", [new_staging_buffer, new_shared_buffer], ids=["private", "shared"])
def test_buffers_are_zeroed_page_aligned_and_shared_only_when_asked(make):
    for nbytes in (1, 4096, 10_000_000):
        buffer = make(nbytes)
        assert buffer.numel() == nbytes and buffer.data_ptr() % PAGE == 0
        assert not buffer.any()
        assert buffer.is_shared() == (make is new_shared_buffer)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_fork_leaves_the_staging_buffer_to_the_parent():
    """A forked child (a DataLoader worker) must not share the pages copy-on-write while it lives: the next
    staging copy would fault on every one. The child sees zeros (wiped) or the same shared pages."""
    nbytes = 64 << 20
    buffer = new_staging_buffer(nbytes)
    buffer.fill_(7)
    to_parent, from_child = os.pipe()
    to_child, from_parent = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report the first byte it sees, live until the parent is done, leave without cleanup
        try:
            os.write(from_child, bytes([ctypes.string_at(buffer.data_ptr(), 1)[0]]))
            os.read(to_child, 1)
        finally:
            os._exit(0)
    try:
        seen = os.read(to_parent, 1)[0]
        before = _minor_faults()
        buffer.fill_(9)  # the next staging copy, the child still alive
        faults = _minor_faults() - before
    finally:
        os.write(from_parent, b"x")
        os.waitpid(pid, 0)
        for fd in (to_parent, from_child, to_child, from_parent):
            os.close(fd)
    assert seen in (0, 7)
    assert faults < nbytes // PAGE // 10  # 16,384 if each page had turned copy-on-write


def test_a_staged_job_pickles_whole(tmp_path):
    """A ProcessWriter sends each staged job to its worker: the layout (pickled by columns) comes back the same."""
    state, _ = mixed_state()
    state["pickled"] = fractions.Fraction(1, 3)  # a payload of bytes
    job = prepare_take(str(tmp_path / "s"), {"state": StateDict(state)}, pg=LOCAL, allow_pickle=True)
    job.stage()
    job.release_staging()
    copy = pickle.loads(pickle.dumps(job))
    assert copy.layout.file == job.layout.file and copy.layout.size == job.layout.size
    assert len(copy.layout.paths) == len(job.layout.paths) > 300
    assert (copy.layout.paths, copy.layout.offsets, copy.layout.sizes, copy.layout.dtypes) == \
        (job.layout.paths, job.layout.offsets, job.layout.sizes, job.layout.dtypes)
    shapes, sent = job.layout.shapes, copy.layout.shapes
    assert copy.layout.tensors == [] and len(shapes) > 300
    assert (sent.ndims.tolist(), sent.dims.tolist()) == (shapes.ndims.tolist(), shapes.dims.tolist())
    assert {p.kind for p in copy.layout.payloads} == {"ndarray", "pickle"}
    for a, b in zip(copy.layout.payloads, job.layout.payloads):
        assert (a.kind, a.replicated) == (b.kind, b.replicated)
        assert a.data == b.data  # what the entry needs: dtype and shape, or the bytes


@pytest.mark.parametrize("bad", ["small", "float", "strided"])
def test_a_staging_buffer_that_cannot_hold_the_image_is_refused(bad, tmp_path):
    state = {"x": torch.randn(1000), "y": torch.arange(10)}
    buffer = {"small": torch.zeros(100, dtype=torch.uint8), "float": torch.zeros(10_000),
              "strided": torch.zeros(20_000, dtype=torch.uint8)[::2]}[bad]
    before = buffer.clone()
    with pytest.raises(ValueError, match="staging buffer must be a contiguous CPU uint8 tensor"):
        Snapshot.async_take(str(tmp_path / "s"), {"state": StateDict(state)}, staging=lambda nbytes: buffer)
    assert torch.equal(buffer, before)
    assert not (tmp_path / "s" / MANIFEST_NAME).exists()


def test_a_job_is_staged_into_the_buffer_handed_to_it_not_one_it_asks_for(tmp_path):
    """Writers hand the engine their staging buffer (``TakeJob.stage(buffer)``); a provider function is refused."""
    from ppe_snapshot.engine import LOCAL, prepare_take
    state = {"state": StateDict(x=torch.arange(6.0))}
    job = prepare_take(str(tmp_path / "s"), state, pg=LOCAL)
    with pytest.raises(TypeError, match="stage\\(\\) takes the staging buffer itself"):
        job.stage(lambda nbytes: torch.zeros(nbytes, dtype=torch.uint8))
    job = prepare_take(str(tmp_path / "s"), state, pg=LOCAL)
    buffer = torch.full((job.layout.size + 4096,), 7, dtype=torch.uint8)  # an older image's bytes in it
    job.stage(buffer)
    assert job.staged is buffer
    job.write_and_commit()
    out = StateDict(x=torch.zeros(6))
    Snapshot(str(tmp_path / "s")).restore({"state": out})
    assert torch.equal(out["x"], torch.arange(6.0))


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


def _grows_by(start: int, nbytes: int, timeout: float = 20.0) -> bool:
    """Whether this process's RSS reaches ``start + nbytes`` within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while _rss() < start + nbytes:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _settled_rss(timeout: float = 20.0) -> int:
    """This process's RSS once it stopped changing for half a second (background allocations done)."""
    deadline, last, still = time.monotonic() + timeout, _rss(), 0
    while still < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
        now = _rss()
        still, last = (still + 1 if now == last else 0), now
    return last


@pytest.mark.parametrize("writer_class", [ThreadWriter, ProcessWriter], ids=["thread", "process"])
def test_prepare_staging_makes_the_first_save_find_its_memory_ready(writer_class, tmp_path):
    """The staging buffer is allocated and its pages touched in the background after ``prepare_staging``: the
    memory is there before the first save, which then only copies into it, bit-exact."""
    state = {"w": torch.randn(12 << 20 >> 2), "b": {"c": torch.arange(1000)}}  # 12 MiB
    writer = writer_class()
    try:
        before = _rss()
        writer.prepare_staging(state)
        assert _grows_by(before, 11 << 20), "the staging buffer was not made ready in the background"
        expected = state["w"].clone()
        ready = _settled_rss()
        writer("s", str(tmp_path), state)
        assert _rss() - ready < 6 << 20  # a fresh buffer would have added its 12 MiB here
        state["w"].add_(1.0)
        writer.wait()
        saved = Snapshot(str(tmp_path / "s")).read_object("0/state")
        assert torch.equal(saved["w"], expected) and torch.equal(saved["b"]["c"], torch.arange(1000))
    finally:
        writer.finalize()


class _RecordingWriter(ThreadWriter):
    """A ThreadWriter that records the tensor bytes of each state it is asked to prepare staging for."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared: list[int] = []

    def prepare_staging(self, target):
        self.prepared.append(sum(t.numel() * t.element_size() for t in _tensors(target)))
        super().prepare_staging(target)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def test_the_extension_has_the_writer_prepare_staging_at_start_and_after_the_first_optimizer_step(tmp_path):
    """At initialize() for the model (Adam has no state yet), after the first optimizer step for the model and
    Adam's state, then never again; the first save stages into a buffer that fits, bit-exact."""
    import pytorch_pfn_extras as ppe
    import ppe_snapshot

    model = torch.nn.Linear(2048, 1024)  # 8 MiB of weights, 16 MiB of Adam state
    optimizer = torch.optim.Adam(model.parameters())
    manager = ppe.training.ExtensionsManager(model, optimizer, 1, iters_per_epoch=3, out_dir=str(tmp_path))
    writer = _RecordingWriter()
    manager.extend(ppe_snapshot.snapshot(writer=writer), trigger=(2, "iteration"))
    weights = (2048 * 1024 + 1024) * 4
    x = torch.randn(4, 2048)
    for _ in range(3):
        with manager.run_iteration():
            model(x).sum().backward()
            optimizer.step()
        if manager.iteration == 2:
            expected = {k: v.clone() for k, v in model.state_dict().items()}
    writer.wait()
    assert writer.prepared == [weights, 3 * weights + 8]  # Adam: exp_avg, exp_avg_sq and a 4-byte step per tensor
    assert writer.staging_buffers[0].numel() >= writer.last_stats["bytes"]
    saved = ppe_snapshot.Snapshot(str(tmp_path / "snapshot_iter_2")).read_object("0/state/models/main")
    assert all(torch.equal(saved[k], v) for k, v in expected.items())
    writer.finalize()


def test_after_a_restore_the_staging_is_prepared_when_the_first_optimizer_step_begins(tmp_path):
    """Nothing is prepared beside the restore: at a restart the buffers are made ready once training has resumed
    (the first optimizer step begins), for the restored state with Adam's; the first save after it fits."""
    import pytorch_pfn_extras as ppe
    import ppe_snapshot

    def run(iterations: int, before_step=lambda writer: None) -> tuple[_RecordingWriter, torch.nn.Module]:
        torch.manual_seed(iterations)
        model = torch.nn.Linear(2048, 1024)
        optimizer = torch.optim.Adam(model.parameters())
        manager = ppe.training.ExtensionsManager(model, optimizer, 1, iters_per_epoch=6, out_dir=str(tmp_path))
        writer = _RecordingWriter()
        manager.extend(ppe_snapshot.snapshot(writer=writer, autoload=True), trigger=(2, "iteration"))
        x = torch.randn(4, 2048)
        for _ in range(iterations):
            with manager.run_iteration():
                model(x).sum().backward()
                before_step(writer)
                optimizer.step()
        writer.wait()
        return writer, model

    first, _ = run(2)
    first.finalize()
    restored = (2048 * 1024 + 1024) * 4 * 3 + 8  # the weights, exp_avg, exp_avg_sq and a 4-byte step per tensor
    seen = []
    writer, model = run(2, before_step=lambda w: seen.append(list(w.prepared)))
    assert seen[0] == []  # resumed at iteration 2: nothing prepared before its first step
    assert writer.prepared and set(writer.prepared) == {restored}
    assert writer.staging_buffers[0].numel() >= writer.last_stats["bytes"]
    saved = ppe_snapshot.Snapshot(str(tmp_path / "snapshot_iter_4")).read_object("0/state/models/main")
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    writer.finalize()
