"""The engine's promises from its API reference, in one process: RNGState, StateDict, restore's
argument checks, and file systems that do not create parent directories."""
from __future__ import annotations

import os
import random
import uuid

import fsspec
import numpy as np
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from ppe_snapshot import RNGState, Snapshot, SnapshotNotFoundError, StateDict, UnsupportedValueError


class Noisy:
    """A stateful object that draws from every global generator in state_dict() and load_state_dict()."""

    def __init__(self) -> None:
        self.value = 0.0

    def state_dict(self) -> dict:
        torch.rand(3), np.random.rand(2), random.random()
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        torch.rand(5), np.random.rand(4), random.random()
        self.value = state["value"]


def _draws() -> tuple:
    return torch.rand(4), np.random.rand(3).tobytes(), random.random()


def _assert_draws_equal(actual: tuple, expected: tuple) -> None:
    assert torch.equal(actual[0], expected[0]) and actual[1:] == expected[1:]


@pytest.mark.parametrize("order", [("noisy", "rng", "late"), ("rng", "noisy", "late"), ("late", "noisy", "rng")])
def test_rng_state_is_the_same_after_restore_as_after_take(tmp_path, order):
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    objects = {"noisy": Noisy(), "rng": RNGState(), "late": Noisy()}
    app_state = {key: objects[key] for key in order}
    Snapshot.take(str(tmp_path / "s"), app_state)
    after_take = _draws()

    torch.rand(100), np.random.rand(100), random.random()  # move every generator on
    Snapshot(str(tmp_path / "s")).restore(app_state)
    _assert_draws_equal(_draws(), after_take)


def test_rng_state_is_left_as_captured_when_another_state_dict_fails(tmp_path):
    class Failing(Noisy):
        def state_dict(self) -> dict:
            super().state_dict()
            raise RuntimeError("boom")

    torch.manual_seed(2)
    expected = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="boom"):
        Snapshot.take(str(tmp_path / "s"), {"rng": RNGState(), "bad": Failing()})
    assert torch.equal(torch.get_rng_state(), expected)


def test_state_dict_of_a_state_dict_is_a_plain_dict(tmp_path):
    state = StateDict(a=torch.ones(2), b=3)
    plain = state.state_dict()
    assert type(plain) is dict and plain == {"a": state["a"], "b": 3}
    assert plain["a"] is state["a"]  # the same tensors: restores load into them in place
    Snapshot.take(str(tmp_path / "s"), {"s": state})
    target = StateDict(a=torch.zeros(2), b=0)
    tensor = target["a"]
    Snapshot(str(tmp_path / "s")).restore({"s": target})
    assert target["a"] is tensor and torch.equal(tensor, torch.ones(2)) and target["b"] == 3


@pytest.mark.parametrize("app_state", [{"x": object()}, {"x": torch.ones(2)}, {"ok": StateDict(), "x": 5},
                                       [StateDict()], None])
def test_restore_checks_app_state_before_touching_storage(tmp_path, app_state):
    missing = Snapshot(str(tmp_path / "never-taken"))
    with pytest.raises(TypeError, match="state_dict|dict of stateful"):
        missing.restore(app_state)  # a TypeError, not SnapshotNotFoundError: storage was never read
    assert not (tmp_path / "never-taken").exists()

    Snapshot.take(str(tmp_path / "s"), {"ok": StateDict(a=torch.ones(2))})
    target = StateDict(a=torch.zeros(2))
    if isinstance(app_state, dict):
        with pytest.raises(TypeError, match=r"app_state\['x'\] .*has no state_dict\(\)/load_state_dict\(\)"):
            Snapshot(str(tmp_path / "s")).restore({"ok": target, **app_state})
        assert torch.equal(target["a"], torch.zeros(2))  # nothing was loaded


# -- file systems that do not create parent directories ---------------------------------

class NoParentsFileSystem(LocalFileSystem):
    """The local file system with ``auto_mkdir=False`` under its own protocol (like SFTP or HDFS:
    opening a file in a missing directory fails)."""

    protocol = "noparents"

    def __init__(self, **kwargs) -> None:
        super().__init__(auto_mkdir=False, **kwargs)

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str) and path.startswith("noparents://"):
            path = path[len("noparents://"):]
        return super()._strip_protocol(path)


@pytest.fixture
def no_parents_fs():
    fsspec.register_implementation("noparents", NoParentsFileSystem, clobber=True)
    fs = fsspec.filesystem("noparents")
    assert fs.auto_mkdir is False
    yield fs


def test_file_system_without_auto_mkdir(tmp_path, no_parents_fs):
    with pytest.raises(FileNotFoundError):  # what the engine is up against
        no_parents_fs.pipe_file(str(tmp_path / "a" / "b"), b"x")
    url = f"noparents://{tmp_path}/deep/run/snap"
    state = {"s": StateDict(w=torch.arange(10.0), n=3)}
    Snapshot.take(url, state, storage_options={})
    assert (tmp_path / "deep" / "run" / "snap" / "data" / "rank0.bin").is_file()
    snapshot = Snapshot(url, storage_options={})
    snapshot.verify()
    target = StateDict(w=torch.zeros(10), n=0)
    snapshot.restore({"s": target})
    assert torch.equal(target["w"], torch.arange(10.0)) and target["n"] == 3

    pending = Snapshot.async_take(f"noparents://{tmp_path}/other", state, storage_options={})
    pending.wait().restore({"s": target})
    assert torch.equal(target["w"], torch.arange(10.0))


def test_object_store_bucket_is_never_created(s3_bucket, s3_endpoint):
    import boto3

    _, options = s3_bucket
    missing = f"missing-{uuid.uuid4().hex[:12]}"
    with pytest.raises(FileNotFoundError):
        Snapshot.take(f"s3://{missing}/run/snap", {"s": StateDict(w=torch.ones(2))}, storage_options=options)
    client = boto3.client("s3", endpoint_url=s3_endpoint["endpoint_url"], region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    assert missing not in {b["Name"] for b in client.list_buckets()["Buckets"]}
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(f"s3://{missing}/run/snap", storage_options=options).restore({"s": StateDict()})


def test_local_paths_still_get_their_directories(tmp_path):
    path = tmp_path / "a" / "b" / "snap"
    Snapshot.take(f"file://{path}", {"s": StateDict(w=torch.ones(2))}, storage_options={"auto_mkdir": False})
    assert os.path.isfile(path / "manifest.json")


@pytest.mark.parametrize("replicated", ["model/*", [1], [None]])
def test_replicated_must_be_a_list_of_globs(tmp_path, replicated):
    with pytest.raises(TypeError, match="replicated must be a list of glob strings"):
        Snapshot.take(str(tmp_path / "s"), {"model": StateDict(w=torch.ones(2))}, replicated=replicated)
    assert not (tmp_path / "s").exists()


def test_replicated_globs_may_be_any_iterable(tmp_path):
    Snapshot.take(str(tmp_path / "s"), {"model": StateDict(w=torch.ones(2))}, replicated=(g for g in ["model/*"]))
    assert Snapshot(str(tmp_path / "s")).get_manifest()["0/model/w"].replicated


class _Opaque:
    """A value with no pickle-free encoding."""


@pytest.mark.parametrize("writer_name", ["SimpleWriter", "ThreadWriter", "ThreadQueueWriter", "ProcessWriter"])
def test_value_needing_pickle_is_named_by_every_writer(tmp_path, writer_name):
    from ppe_snapshot import UnsupportedValueError, writing

    writer = getattr(writing, writer_name)(out_dir=str(tmp_path))
    try:
        with pytest.raises(UnsupportedValueError, match=r"extra/obj: .*can only be saved with pickle; "
                                                         r"pass allow_pickle=True"):
            writer("snap", str(tmp_path), {"model": {"w": torch.ones(2)}, "extra": {"obj": _Opaque()}})
    finally:
        writer.finalize()
    assert not (tmp_path / "snap" / "manifest.json").exists()


# -- the commit protocol on file systems where a file is visible before it is complete ---------

def test_a_part_still_being_written_is_read_again(tmp_path):
    import threading

    from ppe_snapshot.engine._versions import protocol as commit
    from ppe_snapshot.storage import open_storage

    storage = open_storage(str(tmp_path / "snap"))
    part = commit.RankPart(1, error="boom").to_bytes()
    (tmp_path / "snap" / ".parts").mkdir(parents=True)
    storage.put_atomic(".parts/abc.rank0.json", commit.RankPart(0).to_bytes())
    (tmp_path / "snap" / ".parts" / "abc.rank1.json").write_bytes(part[: len(part) // 2])  # half written
    finish = threading.Timer(0.2, lambda: (tmp_path / "snap" / ".parts" / "abc.rank1.json").write_bytes(part))
    finish.start()
    try:
        parts = commit.gather_parts(storage, "abc", 2, timeout=60)
    finally:
        finish.join()
    assert [p.rank for p in parts] == [0, 1] and parts[1].error == "boom"


def test_fsspec_put_atomic_renames_into_place(tmp_path, no_parents_fs):
    from ppe_snapshot.storage import FsspecStorage, open_storage

    storage = open_storage(f"noparents://{tmp_path}/snap", {})
    assert isinstance(storage, FsspecStorage)
    storage.put_atomic("a/b/manifest.json", b"{}")
    storage.put_atomic("a/b/manifest.json", b"[1]")  # replaces
    assert storage.read_bytes("a/b/manifest.json") == b"[1]"
    assert os.listdir(tmp_path / "snap" / "a" / "b") == ["manifest.json"]  # no temporary left


# -- _custom_tensor_prepare_func (the seed's take / async_take argument) ---------------------------------------

def test_custom_tensor_prepare_func_chooses_what_is_stored(tmp_path):
    seen = []

    def to_half(path: str, tensor: torch.Tensor, tracing: bool) -> torch.Tensor:
        seen.append((path, tracing))
        return tensor.to(torch.float16)

    state = StateDict(w=torch.arange(6, dtype=torch.float32).reshape(2, 3), step=3)
    snap = Snapshot.take(str(tmp_path / "sync"), {"s": state}, None, None, None, to_half)
    assert seen == [("s/w", False)]
    stored = snap.read_object("0/s/w")
    assert stored.dtype == torch.float16 and torch.equal(stored, state["w"].half())
    assert snap.read_object("0/s/step") == 3

    pending = Snapshot.async_take(str(tmp_path / "async"), {"s": state}, _custom_tensor_prepare_func=to_half)
    assert pending.wait().read_object("0/s/w").dtype == torch.float16


def test_custom_tensor_prepare_func_must_return_a_storable_tensor(tmp_path):
    path = tmp_path / "s"
    with pytest.raises(UnsupportedValueError, match=r"s/w: _custom_tensor_prepare_func returned a list"):
        Snapshot.take(str(path), {"s": StateDict(w=torch.ones(2))},
                      _custom_tensor_prepare_func=lambda p, t, tracing: [1, 2])
    assert not path.exists()
