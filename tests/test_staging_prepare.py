"""``Snapshot.prepare_staging``: the first ``async_take`` stages into a buffer made ready ahead, in the background,
instead of allocating and faulting one in while the caller waits."""
from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from _asserts import assert_same
from ppe_snapshot import Snapshot, StateDict
from ppe_snapshot.engine._take import staging_pool


@pytest.fixture(autouse=True)
def empty_pool():
    Snapshot.release_staging()
    yield
    Snapshot.release_staging()


def _state() -> dict[str, StateDict]:
    torch.manual_seed(0)
    return {"m": StateDict(w=torch.randn(1 << 20), b=torch.randn(100), step=3)}


def _ready(pin: bool = False) -> torch.Tensor:
    """The buffer made ready, once its thread gave it to the pool."""
    preparing = staging_pool._preparing.get(pin)
    if preparing is not None:
        preparing[0].ready.result()
    deadline = time.monotonic() + 30
    while pin not in staging_pool._idle and time.monotonic() < deadline:
        time.sleep(0.01)
    return staging_pool._idle[pin]


def test_the_first_async_take_stages_into_the_buffer_made_ready(tmp_path):
    state = _state()
    Snapshot.prepare_staging(state)
    prepared = _ready()
    assert prepared.numel() >= (1 << 22) + 400  # the tensors' bytes, and room for the small values
    expected = {k: v.clone() for k, v in state["m"].items() if isinstance(v, torch.Tensor)}
    pending = Snapshot.async_take(str(tmp_path / "s"), state)
    assert staging_pool._idle == {}  # taken by the call
    state["m"]["w"].add_(1.0)
    pending.wait()
    assert staging_pool._idle[False].data_ptr() == prepared.data_ptr()  # given back to the pool
    target = {"m": StateDict(w=torch.zeros(1 << 20), b=torch.zeros(100), step=0)}
    Snapshot(str(tmp_path / "s")).restore(target)
    assert_same({k: target["m"][k] for k in expected}, expected)
    assert target["m"]["step"] == 3
    Snapshot.prepare_staging(state)  # one of its kind is idle and holds it: nothing more made
    assert staging_pool._preparing == {} and staging_pool._idle[False].data_ptr() == prepared.data_ptr()
    assert Snapshot.release_staging() == prepared.numel()


def test_an_async_take_during_the_preparation_waits_for_its_buffer(tmp_path, monkeypatch):
    made: list[torch.Tensor] = []
    new = staging_pool.new_staging_buffer

    def slow(nbytes: int, pin: bool) -> torch.Tensor:
        time.sleep(0.5)
        made.append(new(nbytes, pin))
        return made[-1]
    monkeypatch.setattr(staging_pool, "new_staging_buffer", slow)
    state = _state()
    Snapshot.prepare_staging(state)
    Snapshot.async_take(str(tmp_path / "s"), state).wait()  # before the buffer is ready
    assert len(made) == 1 and staging_pool._idle[False].data_ptr() == made[0].data_ptr()


def test_a_preparation_that_fails_only_warns(tmp_path, monkeypatch, caplog):
    def refused(nbytes: int, pin: bool) -> torch.Tensor:
        raise RuntimeError("no memory to be had")
    monkeypatch.setattr(staging_pool, "new_staging_buffer", refused)
    state = _state()
    with caplog.at_level(logging.WARNING):
        Snapshot.prepare_staging(state)
        for thread in threading.enumerate():
            if thread.name == "ppe-snapshot-prepare-staging":
                thread.join()
    assert "making a staging buffer of" in caplog.text and "no memory to be had" in caplog.text
    assert staging_pool._idle == {} and staging_pool._preparing == {}
    Snapshot.async_take(str(tmp_path / "s"), state).wait()  # allocates its own, as without the preparation
    assert Snapshot(str(tmp_path / "s")).read_object("0/m/step") == 3


def test_prepare_staging_refuses_what_async_take_refuses():
    with pytest.raises(TypeError, match="wrap tensors and plain values in ppe_snapshot.StateDict"):
        Snapshot.prepare_staging({"m": {"w": torch.zeros(3)}})
