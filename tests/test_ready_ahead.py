"""``ReadyAhead``: a staging buffer made ready in a background thread of low priority. A save that needs it before
that thread is done faults in the rest itself instead of waiting for a thread the machine may starve."""
from __future__ import annotations

import ctypes
import mmap
import os
import threading

import numpy as np
import pytest
import torch

from ppe_snapshot import Snapshot, StateDict
from ppe_snapshot.engine._take import staging_pool
from ppe_snapshot.engine._util import hostmem
from ppe_snapshot.writing import ThreadWriter

NBYTES = 200 << 20  # four pieces of POPULATE_BYTES and a part
_libc = ctypes.CDLL(None, use_errno=True)


def resident(buffer: torch.Tensor) -> np.ndarray:
    """Whether each page of ``buffer`` is in memory (``mincore``)."""
    pages = -(-buffer.numel() // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    assert _libc.mincore(ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(buffer.numel()), vector) == 0
    return np.frombuffer(vector, dtype=np.uint8) & 1 == 1


@pytest.fixture
def held(monkeypatch):
    """The background threads stop where they would start faulting pages in, until the event is set (a thread the
    machine does not schedule); set at the end of the test either way."""
    release = threading.Event()
    lower = hostmem._lower_priority

    def starved() -> None:
        lower()
        release.wait()
    monkeypatch.setattr(hostmem, "_lower_priority", starved)
    yield release
    release.set()


needs_populate = pytest.mark.skipif(not hostmem.can_populate(), reason="needs MADV_POPULATE_WRITE (Linux 5.14+)")


@needs_populate
def test_a_save_before_the_thread_is_done_faults_the_buffer_in_itself(held):
    ahead = hostmem.ReadyAhead(lambda: hostmem.new_private_buffer(NBYTES), "test-ready-ahead")
    buffer = ahead.result()  # the background thread has not faulted in a page
    assert not held.is_set() and not ahead.ready.done()
    assert buffer.numel() == NBYTES and resident(buffer).all()
    buffer[:5] = 7  # the save's to fill; the background thread, let go, writes nothing into it
    held.set()
    assert ahead.ready.result() is buffer and buffer[:5].tolist() == [7] * 5


def test_without_populate_the_save_waits_for_the_thread_that_writes_the_pages(held, monkeypatch):
    monkeypatch.setattr(hostmem, "can_populate", lambda: False)
    ahead = hostmem.ReadyAhead(lambda: hostmem.new_private_buffer(NBYTES), "test-ready-ahead")
    got: list[torch.Tensor] = []
    waiting = threading.Thread(target=lambda: got.append(ahead.result()))
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive() and not got  # it waits: the thread would write into what the save fills
    held.set()
    waiting.join(30)
    assert got and got[0] is ahead.ready.result() and resident(got[0]).all()


def test_the_failure_to_allocate_is_the_result():
    def refused() -> torch.Tensor:
        raise MemoryError("no memory to be had")
    ahead = hostmem.ReadyAhead(refused, "test-ready-ahead")
    with pytest.raises(MemoryError, match="no memory to be had"):
        ahead.result()
    assert isinstance(ahead.ready.exception(), MemoryError)


@pytest.mark.skipif(os.getpriority(os.PRIO_PROCESS, 0) > hostmem.FAULT_IN_NICE, reason="this process runs niced")
def test_the_threads_nice_value_is_raised_to_yield_to_training(monkeypatch):
    seen: list[int] = []
    lower = hostmem._lower_priority

    def recorded() -> None:
        lower()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    monkeypatch.setattr(hostmem, "_lower_priority", recorded)
    hostmem.ReadyAhead(lambda: hostmem.new_private_buffer(1 << 20), "test-ready-ahead").ready.result()
    assert seen == [hostmem.FAULT_IN_NICE]


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"w": torch.randn(NBYTES // 8), "b": torch.arange(1000)}


@needs_populate
def test_a_writers_first_save_does_not_wait_for_a_starved_preparation(held, tmp_path):
    state = _state()
    expected = {k: v.clone() for k, v in state.items()}
    writer = ThreadWriter()
    try:
        writer.prepare_staging(state)
        writer("s", str(tmp_path), state)  # returns while the preparation's thread is still held
        assert not held.is_set()
        state["w"].add_(1.0)
        writer.wait()
    finally:
        writer.finalize()
    saved = Snapshot(str(tmp_path / "s")).read_object("0/state")
    assert torch.equal(saved["w"], expected["w"]) and torch.equal(saved["b"], expected["b"])


@needs_populate
def test_the_first_async_take_does_not_wait_for_a_starved_preparation(held, tmp_path):
    Snapshot.release_staging()
    state = {"m": StateDict(_state())}
    expected = state["m"]["w"].clone()
    Snapshot.prepare_staging(state)
    ahead = staging_pool._preparing[False][0]
    pending = Snapshot.async_take(str(tmp_path / "s"), state)  # takes the buffer being made
    assert not held.is_set() and staging_pool._preparing == {}
    state["m"]["w"].add_(1.0)
    pending.wait()
    held.set()
    assert staging_pool._idle[False].data_ptr() == ahead.ready.result().data_ptr()  # given back once written
    assert torch.equal(Snapshot(str(tmp_path / "s")).read_object("0/m/w"), expected)
    Snapshot.release_staging()
