"""The writers of ppe_snapshot.writing: real saves, real failures, real worker processes."""
from __future__ import annotations

import contextlib
import copy
import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import fsspec
import pytest
import torch
from pytorch_pfn_extras import training as ppe_training
from pytorch_pfn_extras.training import extensions as ppe_extensions

from ppe_snapshot import Snapshot, SnapshotError, SnapshotNotFoundError, StateDict
from ppe_snapshot.writing import (
    BackgroundSaveError, ProcessQueueWriter, ProcessWriter, SimpleWriter, ThreadQueueWriter, ThreadWriter,
)
from _asserts import assert_same

ASYNC = ["thread", "thread_queue", "process", "process_queue"]
ALL = ["simple"] + ASYNC
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- helpers -------------------------------------------------------------------
def model_state(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def big_state(mib: int = 32) -> dict:
    n = mib * (1 << 20) // 4 // 4
    return {f"w{i}": torch.randn(n) for i in range(4)}




def restore_model_state(path: str, storage_options: dict | None = None) -> dict:
    """Restore into a model and optimizer of the same shape holding other values."""
    target = StateDict(state_of(*model_state(seed=1)))
    Snapshot(path, storage_options=storage_options).restore({"state": target})
    return dict(target)


def restore_like(path: str, expected: dict) -> dict:
    target = StateDict({k: torch.zeros_like(v) for k, v in expected.items()})
    Snapshot(path).restore({"state": target})
    return dict(target)


def settle(writer) -> None:
    """Finalize a writer of this test; only wait for a module-wide one."""
    if writer.__dict__.get("_shared"):
        writer.wait()
    else:
        writer.finalize()


@contextlib.contextmanager
def post_save_hook(writer, hook):
    writer._add_cleanup_hook(hook)
    try:
        yield
    finally:
        writer._post_save_hooks.remove(hook)


def in_thread(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, waiting to be reaped
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not process_gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- fixtures --------------------------------------------------------------------
def _shared(writer):
    writer._shared = True
    return writer


@pytest.fixture(scope="module")
def process_writer():
    writer = _shared(ProcessWriter())
    yield writer
    writer.finalize()


@pytest.fixture(scope="module")
def process_queue_writer():
    writer = _shared(ProcessQueueWriter(queue_depth=2))
    yield writer
    writer.finalize()


@pytest.fixture
def make_writer(request):
    """``make_writer(kind, **kwargs)``: a fresh writer, or the module's worker-backed one without kwargs."""
    made = []

    def make(kind: str, **kwargs):
        if kind in ("process", "process_queue") and not kwargs:
            made.append(request.getfixturevalue(f"{kind}_writer"))
        else:
            cls = {"simple": SimpleWriter, "thread": ThreadWriter, "thread_queue": ThreadQueueWriter,
                   "process": ProcessWriter, "process_queue": ProcessQueueWriter}[kind]
            made.append(cls(**kwargs))
        return made[-1]

    yield make
    for writer in made:  # a failure a test left unreported errors that test
        settle(writer)


# -- saving and restoring ------------------------------------------------------------
@pytest.mark.parametrize("kind", ALL)
def test_snapshot_restores_bit_exact(kind, make_writer, tmp_path):
    model, optimizer = model_state()
    state = state_of(model, optimizer)
    expected = copy.deepcopy(state)
    writer = make_writer(kind)
    writer("snap", str(tmp_path), state, metadata={"iteration": 7})
    settle(writer)

    path = str(tmp_path / "snap")
    assert_same(restore_model_state(path), expected)
    assert Snapshot(path).metadata == {"iteration": 7}
    stats = writer.last_stats
    assert stats["path"] == path
    assert stats["bytes"] == os.path.getsize(tmp_path / "snap" / "data" / "rank0.bin")
    assert stats["blocking_s"] >= 0 and stats["write_s"] >= 0
    assert writer.last_save.done() and writer.last_save.exception() is None  # the save's end, for other threads


def test_constructor_out_dir_takes_precedence(make_writer, tmp_path):
    writer = make_writer("thread", out_dir=str(tmp_path / "mine"))
    writer("snap", str(tmp_path / "theirs"), {"x": torch.arange(4)})
    writer.finalize()
    assert_same(restore_like(str(tmp_path / "mine" / "snap"), {"x": torch.arange(4)}), {"x": torch.arange(4)})
    assert not (tmp_path / "theirs").exists()


@pytest.mark.parametrize("kind", ASYNC)
def test_snapshot_is_the_state_at_the_call(kind, make_writer, tmp_path):
    state = big_state()
    expected = copy.deepcopy(state)
    writer = make_writer(kind)
    writer("snap", str(tmp_path), state)
    for tensor in state.values():  # while the write goes on
        tensor.add_(1.0)
    settle(writer)
    assert_same(restore_like(str(tmp_path / "snap"), expected), expected)


@pytest.mark.parametrize("kind", ASYNC)
def test_staging_buffer_is_reused_and_grown_only_when_needed(kind, make_writer, tmp_path):
    writer = make_writer(kind)
    state = {"x": torch.randn(1000)}
    writer("a", str(tmp_path), state)
    writer.wait()
    buffer = writer.staging_buffers[0]
    writer("b", str(tmp_path), state)
    writer.wait()
    assert writer.staging_buffers[0] is buffer
    assert writer.staging_buffers[0].data_ptr() == buffer.data_ptr()
    assert buffer.is_shared() == kind.startswith("process")
    assert not buffer.is_pinned()  # the state is on the CPU

    bigger = {"x": torch.randn(buffer.numel() // 4 + 1000)}
    writer("c", str(tmp_path), bigger)
    writer.wait()
    grown = writer.staging_buffers[0]
    assert grown.numel() > buffer.numel()
    writer("d", str(tmp_path), bigger)
    settle(writer)
    assert writer.staging_buffers[0] is grown
    assert_same(restore_like(str(tmp_path / "b"), state), state)
    assert_same(restore_like(str(tmp_path / "d"), bigger), bigger)


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_second_call_waits_for_the_save_in_flight(kind, make_writer, tmp_path):
    writer = make_writer(kind)
    release, events = threading.Event(), []

    def hook():
        if not events:  # the first save's hooks hold it in flight
            release.wait(60)
            events.append("first save done")

    def second_call():
        writer("b", str(tmp_path), {"x": torch.ones(3)})
        events.append("second call returned")

    with post_save_hook(writer, hook):
        writer("a", str(tmp_path), {"x": torch.zeros(3)})
        caller = in_thread(second_call)
        caller.join(0.5)
        assert caller.is_alive()
        release.set()
        caller.join(60)
        writer.wait()
    assert events == ["first save done", "second call returned"]
    for name in "ab":
        Snapshot(str(tmp_path / name)).verify()


@pytest.mark.parametrize("kind", ["thread_queue", "process_queue"])
def test_queue_depth_two_keeps_two_saves_in_flight(kind, make_writer, tmp_path):
    writer = make_writer("thread_queue", queue_depth=2) if kind == "thread_queue" else make_writer(kind)
    release, done = threading.Event(), []

    def hook():
        release.wait(60)
        done.append(len(done))

    with post_save_hook(writer, hook):
        calls = in_thread(lambda: [writer(n, str(tmp_path), {"x": torch.full((5,), float(i))})
                                   for i, n in enumerate("ab")])
        calls.join(60)
        assert not calls.is_alive() and not done  # both handed over while the first is held
        first, second = writer.staging_buffers
        assert first is not None and second is not None and first.data_ptr() != second.data_ptr()
        third = in_thread(lambda: writer("c", str(tmp_path), {"x": torch.full((5,), 2.0)}))
        third.join(0.5)
        assert third.is_alive()  # the queue is full
        release.set()
        third.join(60)
        writer.wait()
    assert done == [0, 1, 2]
    for i, name in enumerate("abc"):
        assert_same(restore_like(str(tmp_path / name), {"x": torch.zeros(5)}), {"x": torch.full((5,), float(i))})


# -- failures -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ASYNC)
def test_background_failure_is_raised_at_the_next_call(kind, make_writer, tmp_path):
    (tmp_path / "blocker").write_text("a file where a directory should be")
    writer = make_writer(kind)
    pid = getattr(writer, "worker_pid", None)
    writer("snap", str(tmp_path / "blocker"), {"x": torch.ones(3)})  # returns: the write fails later
    while writer.in_flight:  # a queue with a free slot would not wait for it
        time.sleep(0.01)
    with pytest.raises(RuntimeError) as raised:  # as ppe's writers raise for a failed worker
        writer("next", str(tmp_path), {"x": torch.ones(3)})
    error = raised.value
    assert isinstance(error, BackgroundSaveError) and isinstance(error.__cause__, NotADirectoryError)
    assert any(str(tmp_path / "blocker" / "snap") in note for note in error.__cause__.__notes__)
    # The message carries the traceback of the thread or worker process that ran the save.
    assert "Traceback (most recent call last)" in str(error) and "makedirs" in str(error)
    if kind.startswith("process"):
        assert "traceback in the writer process" in str(error)
    assert not (tmp_path / "next").exists()  # the raising call saved nothing

    writer("next", str(tmp_path), {"x": torch.ones(3)})  # the writer is still usable
    settle(writer)
    Snapshot(str(tmp_path / "next")).verify()
    assert getattr(writer, "worker_pid", None) == pid


@pytest.mark.parametrize("kind", ASYNC)
def test_disk_full_is_raised_at_wait_and_leaves_no_manifest(kind, make_writer, tmp_path):
    data = tmp_path / "snap" / "data"
    data.mkdir(parents=True)
    os.symlink("/dev/full", data / "rank0.bin")  # every write there fails with ENOSPC
    writer = make_writer(kind)
    writer("snap", str(tmp_path), {"x": torch.ones(1000)})
    assert writer.last_save.exception(timeout=60).errno == errno.ENOSPC  # another thread may wait on it
    with pytest.raises(BackgroundSaveError) as raised:
        writer.wait()
    assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == errno.ENOSPC
    assert not (tmp_path / "snap" / "manifest.json").exists()
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(str(tmp_path / "snap")).verify()
    writer.wait()  # reported once


@pytest.mark.parametrize("kind", ["thread", "thread_queue"])
def test_background_failure_is_raised_at_finalize(kind, make_writer, tmp_path):
    (tmp_path / "blocker").write_text("")
    writer = make_writer(kind)
    writer("snap", str(tmp_path / "blocker"), {"x": torch.ones(3)})
    with pytest.raises(RuntimeError, match="NotADirectoryError") as raised:
        writer.finalize()
    assert isinstance(raised.value.__cause__, NotADirectoryError)
    writer.finalize()  # idempotent, and the failure was reported once
    with pytest.raises(RuntimeError, match="finalized"):
        writer("again", str(tmp_path), {"x": torch.ones(3)})


# -- worker processes -------------------------------------------------------------------
@pytest.mark.fresh_workers  # the worker is this process's own child
def test_process_writer_keeps_one_worker_and_stops_it_at_finalize(make_writer, tmp_path):
    writer = make_writer("process", out_dir=str(tmp_path))
    pid = writer.worker_pid
    assert parent_of(pid) == os.getpid()  # our own child, started once
    for i in range(3):
        writer(f"snap{i}", "", {"x": torch.full((10,), float(i))})
        writer.wait()
        assert writer.worker_pid == pid
    assert not process_gone(pid)
    (tmp_path / "blocker").write_text("")
    writer("blocker/snap", "", {"x": torch.ones(3)})
    with pytest.raises(BackgroundSaveError) as raised:
        writer.finalize()
    assert isinstance(raised.value.__cause__, NotADirectoryError)
    assert writer.worker_pid is None
    assert process_gone(pid)
    for i in range(3):
        assert_same(restore_like(str(tmp_path / f"snap{i}"), {"x": torch.zeros(10)}), {"x": torch.full((10,), float(i))})


def test_killed_worker_fails_its_save_and_is_replaced(process_writer, tmp_path):
    data = tmp_path / "stuck" / "data"
    data.mkdir(parents=True)
    os.mkfifo(data / "rank0.bin")  # opening it for writing blocks until a reader comes: never
    pid = process_writer.worker_pid
    process_writer("stuck", str(tmp_path), {"x": torch.ones(3)})
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(SnapshotError, match=f"pid {pid}.*killed by SIGKILL.*stuck"):
        process_writer.wait()
    assert not (tmp_path / "stuck" / "manifest.json").exists()

    process_writer("after", str(tmp_path), {"x": torch.arange(3)})
    process_writer.wait()
    assert process_writer.worker_pid not in (None, pid)
    assert_same(restore_like(str(tmp_path / "after"), {"x": torch.zeros(3, dtype=torch.long)}),
                {"x": torch.arange(3)})


_PARENT = textwrap.dedent("""
    import os, signal, sys
    import torch

    if __name__ == "__main__":
        from ppe_snapshot.writing import ProcessWriter, ThreadWriter

        writer = ProcessWriter(out_dir=sys.argv[1])
        writer("snap", "", {"x": torch.arange(100000.0)})
        print(writer.worker_pid, flush=True)
        if sys.argv[2] == "kill":
            writer.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        # "exit": leave without finalize(), the save possibly still in flight; and with a writer finalized
        # before, which the interpreter's shutdown collects
        finalized = ThreadWriter(out_dir=sys.argv[1])
        finalized("thread", "", {"x": torch.ones(2)})
        finalized.finalize()
""")


def test_no_orphan_worker_when_the_parent_goes_away(tmp_path):
    """One parent exits without finalize() right after its call, one is killed with SIGKILL when idle."""
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    env = dict(os.environ, PYTHONPATH=REPO)
    parents = {how: subprocess.Popen([sys.executable, str(script), str(tmp_path / how), how], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for how in ("exit", "kill")}  # side by side: each start costs seconds
    expected = {"x": torch.arange(100000.0)}
    for how, parent in parents.items():
        out, err = parent.communicate(timeout=120)
        assert parent.returncode == (-signal.SIGKILL if how == "kill" else 0), err
        assert "Exception ignored" not in err, err
        worker = int(out.split()[0])
        assert wait_gone(worker), f"worker {worker} outlived its parent ({how})"
        assert_same(restore_like(str(tmp_path / how / "snap"), expected), expected)  # committed before the end


def test_process_writers_refuse_memory_urls(process_writer):
    with pytest.raises(ValueError, match="memory://.*ThreadWriter"):
        process_writer("snap", f"memory://{uuid.uuid4().hex}", {"x": torch.ones(3)})


def test_process_writer_needs_a_picklable_savefun(process_writer, tmp_path):
    with pytest.raises(TypeError, match="cannot be pickled.*torch.save"):
        process_writer("f.pt", str(tmp_path), {"x": torch.ones(3)}, savefun=lambda obj, f: torch.save(obj, f))
    process_writer("ok", str(tmp_path), {"x": torch.ones(3)})  # nothing left stuck
    process_writer.wait()
    Snapshot(str(tmp_path / "ok")).verify()


# -- single files (an explicit savefun) and other file systems ------------------------------------
@pytest.mark.parametrize("kind", ALL)
def test_savefun_writes_one_file_like_ppe(kind, make_writer, tmp_path):
    model, optimizer = model_state()
    state = state_of(model, optimizer)
    expected = copy.deepcopy(state)
    writer = make_writer(kind)
    writer("snap.pt", str(tmp_path), state, savefun=torch.save)
    for tensor in model.parameters():
        tensor.data.add_(1.0)
    settle(writer)
    assert sorted(os.listdir(tmp_path)) == ["snap.pt"]  # the temporary file was renamed
    assert_same(torch.load(tmp_path / "snap.pt"), expected)
    assert writer.last_stats["bytes"] == os.path.getsize(tmp_path / "snap.pt")


def save_half_then_fail(obj, f):
    """A savefun that writes part of a file, then fails (module level: a worker process imports it)."""
    f.write(b"half a file")
    raise KeyError("the savefun failed")


@pytest.mark.parametrize("kind", ALL)
def test_a_failing_savefun_leaves_the_old_file_and_no_temporary_one(kind, make_writer, tmp_path):
    (tmp_path / "snap.pt").write_bytes(b"the previous snapshot")
    writer = make_writer(kind)
    with pytest.raises((KeyError, BackgroundSaveError)) as raised:
        writer("snap.pt", str(tmp_path), {"x": torch.ones(3)}, savefun=save_half_then_fail)
        settle(writer)
    error = raised.value if kind == "simple" else raised.value.__cause__
    assert isinstance(error, KeyError) and error.args == ("the savefun failed",)
    assert sorted(os.listdir(tmp_path)) == ["snap.pt"]
    assert (tmp_path / "snap.pt").read_bytes() == b"the previous snapshot"


@pytest.mark.parametrize("where", ["memory", "s3"])
def test_a_failing_savefun_leaves_no_temporary_object(where, request):
    if where == "s3":
        bucket, options = request.getfixturevalue("s3_bucket")
        root = f"{bucket}/{uuid.uuid4().hex}"
    else:
        root, options = f"memory://{uuid.uuid4().hex}/run", {}
    fs, path = fsspec.core.url_to_fs(root, **options)
    writer = SimpleWriter(out_dir=root, storage_options=options)
    with pytest.raises(KeyError, match="the savefun failed"):
        writer("sub/snap.pt", "", {"x": torch.ones(3)}, savefun=save_half_then_fail)
    fs.invalidate_cache()
    assert not fs.exists(f"{path}/sub/tmp_snap.pt") and not fs.exists(f"{path}/sub/snap.pt")


@pytest.mark.parametrize("kind", ALL)
def test_a_target_that_is_not_a_dict_is_stored_as_it_is(kind, make_writer, tmp_path):
    """ppe's writers torch.save any target; ours store it as the snapshot's "state" entry."""
    writer = make_writer(kind)
    targets = {"text": "test", "tensor": torch.arange(4.0), "list": [1, "two", torch.ones(2)]}
    for name, target in targets.items():
        writer(name, str(tmp_path), target)
    settle(writer)
    for name, target in targets.items():
        assert_same(Snapshot(str(tmp_path / name)).read_object("0/state"), target)


@pytest.mark.parametrize("kind", ["simple", "thread", "thread_queue"])
def test_memory_url_out_dir(kind, make_writer):
    root = f"memory://{uuid.uuid4().hex}/run"
    model, optimizer = model_state()
    expected = copy.deepcopy(state_of(model, optimizer))
    writer = make_writer(kind, out_dir=root)
    writer("snap", "ignored", state_of(model, optimizer))
    writer("snap.pt", "ignored", state_of(model, optimizer), savefun=torch.save)
    writer.finalize()
    try:
        assert_same(restore_model_state(f"{root}/snap"), expected)
        with fsspec.open(f"{root}/snap.pt", "rb") as f:
            assert_same(torch.load(f), expected)
        assert not fsspec.filesystem("memory").exists(f"{root}/tmp_snap.pt")
    finally:
        fsspec.filesystem("memory").rm(root.replace("memory://", "/").rsplit("/", 1)[0], recursive=True)


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_s3_out_dir(kind, make_writer, s3_bucket):
    bucket, options = s3_bucket
    model, optimizer = model_state()
    expected = copy.deepcopy(state_of(model, optimizer))
    writer = make_writer(kind, out_dir=f"{bucket}/run", storage_options=options)
    writer("snap", "", state_of(model, optimizer))
    writer("snap.pt", "", state_of(model, optimizer), savefun=torch.save)
    writer.finalize()
    assert_same(restore_model_state(f"{bucket}/run/snap", options), expected)
    with fsspec.open(f"{bucket}/run/snap.pt", "rb", **options) as f:
        assert_same(torch.load(f), expected)


def test_bad_arguments_are_named(make_writer, tmp_path):
    with pytest.raises(ValueError, match="queue_depth"):
        ThreadQueueWriter(queue_depth=0)
    writer = make_writer("simple")
    with pytest.raises(ValueError, match="append=True needs a savefun"):
        writer("snap", str(tmp_path), {"x": torch.ones(1)}, append=True)


# -- as pytorch-pfn-extras' writer -------------------------------------------------------------
def _train(writer, out: str, as_manager_writer: bool = False):
    model, optimizer = model_state()
    manager = ppe_training.ExtensionsManager(model, optimizer, 2, iters_per_epoch=2, out_dir=out,
                                             writer=writer if as_manager_writer else None)
    manager.extend(ppe_extensions.snapshot(writer=None if as_manager_writer else writer), trigger=(1, "epoch"))
    while not manager.stop_trigger:
        with manager.run_iteration():
            model(torch.randn(2, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    writer.wait()
    return model, optimizer


def test_ppe_manager_writer_takes_engine_snapshots(tmp_path):
    writer = ThreadWriter(out_dir=str(tmp_path / "out"))
    model, optimizer = _train(writer, str(tmp_path / "out"), as_manager_writer=True)
    writer.finalize()
    saved = Snapshot(str(tmp_path / "out" / "snapshot_iter_4")).read_object("0/state/models/main")
    assert_same(saved, model.state_dict())
    Snapshot(str(tmp_path / "out" / "snapshot_iter_2")).verify()


def test_ppe_autoload_reads_the_savefun_files(tmp_path):
    writer = ThreadWriter(savefun=torch.save, out_dir=str(tmp_path))
    model, _ = _train(writer, str(tmp_path))
    writer.finalize()
    assert sorted(os.listdir(tmp_path)) == ["snapshot_iter_2", "snapshot_iter_4"]

    resumed = ThreadWriter(savefun=torch.save, out_dir=str(tmp_path))
    fresh, optimizer = model_state(seed=3)
    manager = ppe_training.ExtensionsManager(fresh, optimizer, 2, iters_per_epoch=2, out_dir=str(tmp_path))
    manager.extend(ppe_extensions.snapshot(writer=resumed, autoload=True), trigger=(1, "epoch"))
    manager.start_extensions()  # autoload: ppe's own torch.load of our file
    resumed.finalize()
    assert manager.iteration == 4
    assert_same(fresh.state_dict(), model.state_dict())


# -- CUDA ------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["thread", "process"])
def test_cuda_state_is_staged_to_host(kind, make_writer, tmp_path):
    model, optimizer = model_state()
    model.cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 8, device="cuda")).sum().backward()
    optimizer.step()
    state = state_of(model, optimizer)
    expected = copy.deepcopy(state)
    writer = make_writer(kind)
    writer("snap", str(tmp_path), state)
    writer("snap.pt", str(tmp_path), state, savefun=torch.save)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    writer.wait()
    assert writer.staging_buffers[0].is_pinned()
    target = StateDict(state_of(*model_state(seed=1)))  # CPU tensors
    Snapshot(str(tmp_path / "snap")).restore({"state": target})
    assert_same(dict(target), expected)
    assert_same(torch.load(tmp_path / "snap.pt"), expected)  # host copies, as CPU tensors


# -- ppe's StandardWriter / QueueWriter public surface -------------------------------------------------------
def test_writers_are_ppes_standard_and_queue_writers():
    from pytorch_pfn_extras import writing as ppe_writing
    assert issubclass(ThreadWriter, ppe_writing.StandardWriter) and issubclass(ProcessWriter, ppe_writing.StandardWriter)
    assert issubclass(ThreadQueueWriter, ppe_writing.QueueWriter)
    assert issubclass(ProcessQueueWriter, ppe_writing.QueueWriter)
    assert all(issubclass(cls, ppe_writing.Writer) for cls in (SimpleWriter, ThreadWriter, ProcessWriter))


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_create_worker_returns_a_worker_that_saves(kind, make_writer, tmp_path):
    import multiprocessing
    writer = make_writer(kind, out_dir=str(tmp_path))
    worker = writer.create_worker("by_worker", "", {"x": torch.arange(5.0)})
    assert isinstance(worker, threading.Thread if kind == "thread" else multiprocessing.Process)
    assert not (tmp_path / "by_worker").exists()  # created, not started
    worker.start()
    worker.join()
    assert getattr(worker, "exitcode", 0) == 0
    assert_same(restore_like(str(tmp_path / "by_worker"), {"x": torch.zeros(5)}), {"x": torch.arange(5.0)})
    file_worker = writer.create_worker("by_worker.pt", "", {"x": torch.ones(2)}, savefun=torch.save)
    file_worker.start()
    file_worker.join()
    assert_same(torch.load(tmp_path / "by_worker.pt"), {"x": torch.ones(2)})


def test_save_runs_in_the_caller_with_post_save_hooks(tmp_path):
    writer = ThreadWriter(out_dir=str(tmp_path))
    seen = []
    writer._add_cleanup_hook(lambda: seen.append(sorted(os.listdir(tmp_path))))
    writer.save("direct", "", {"x": torch.ones(3)})
    assert seen == [["direct"]]
    Snapshot(str(tmp_path / "direct")).verify()
    writer.save("direct", "", {"x": torch.zeros(3)})  # saved again: replaced, as ppe's save overwrites
    assert_same(restore_like(str(tmp_path / "direct"), {"x": torch.ones(3)}), {"x": torch.zeros(3)})
    writer.finalize()


@pytest.mark.parametrize("kind", ["thread_queue", "process_queue"])
def test_queue_writer_api(kind, make_writer, tmp_path):
    import multiprocessing
    import queue as queue_module
    writer = make_writer(kind, out_dir=str(tmp_path))
    task = writer.create_task(None)
    assert isinstance(task, SimpleWriter) and task.out_dir == str(tmp_path)
    q = writer.create_queue()
    consumer = writer.create_consumer(q)
    assert isinstance(consumer, threading.Thread if kind == "thread_queue" else multiprocessing.Process)
    if kind == "thread_queue":  # ppe's consume() loop over our task: an engine snapshot, then the stop marker
        assert isinstance(q, queue_module.Queue)
        consumer.start()
        q.put((task, "queued", "", {"x": torch.ones(4)}, None, False))
        q.put(None)
        consumer.join()
        Snapshot(str(tmp_path / "queued")).verify()


@pytest.mark.parametrize("kind", ALL)
def test_saving_again_under_a_name_replaces_it(kind, make_writer, tmp_path):
    writer = make_writer(kind, out_dir=str(tmp_path))
    for i in range(3):
        writer("same", "", {"x": torch.full((4,), float(i))})
    settle(writer)
    assert sorted(os.listdir(tmp_path)) == ["same"]
    assert_same(restore_like(str(tmp_path / "same"), {"x": torch.zeros(4)}), {"x": torch.full((4,), 2.0)})


def test_a_writer_added_by_the_recipe_saves_and_resumes(tmp_path):
    """docs/architecture.md "Adding a writer", followed: a runner that runs each save in a thread of its own, a
    writer class naming it; the extension saves through it in a real ppe loop, and autoload resumes bit-exact."""
    import queue

    from pytorch_pfn_extras.writing import StandardWriter

    from ppe_snapshot.writing._ppe_writers import _PpeWriter
    from ppe_snapshot.writing._runners import Runner, run_to_end
    from _extension_workers import Crash, Run

    ran_in: list[str] = []

    class OwnThread(Runner):  # step 1: a runner
        def __init__(self, depth: int = 1, writer: str = "") -> None:
            super().__init__(depth, writer)
            self._work: queue.SimpleQueue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._serve, name=f"toy-{writer}", daemon=True)
            self._thread.start()

        def _serve(self) -> None:
            while (item := self._work.get()) is not None:
                ran_in.append(threading.current_thread().name)
                run_to_end(*item)

        def run(self, work, on_done) -> None:
            self._work.put((work, on_done))

        def shutdown(self) -> None:
            self._work.put(None)
            self._thread.join()

    class ToyWriter(_PpeWriter, StandardWriter[threading.Thread]):  # step 2: a writer class naming it
        _runner_type = OwnThread

    reference = Run(str(tmp_path / "straight"), 8, None)
    reference.train()
    out = str(tmp_path / "run")
    first = Run(out, 8, {"writer": ToyWriter(), "autoload": True}, trigger=(4, "iteration"))
    with pytest.raises(Crash):
        first.train(crash_at=6)
    writer = first.snapshot.writer
    assert writer.staging_buffers[0] is not None  # a background runner: the core staged the save for it
    writer.finalize()
    assert ran_in == ["toy-ToyWriter"] and not writer._core.runner._thread.is_alive()
    Snapshot(os.path.join(out, "snapshot_iter_4")).verify()

    resumed = Run(out, 8, {"writer": ToyWriter(), "autoload": True}, trigger=(4, "iteration"), seed=1)
    resumed.train()
    assert resumed.snapshot.resumed_from.endswith("snapshot_iter_4") and resumed.manager.iteration == 8
    assert_same(resumed.state(), reference.state())
    resumed.snapshot.writer.finalize()
    assert ran_in == ["toy-ToyWriter"] * 2  # the resumed run saved at iteration 8 through its own thread
