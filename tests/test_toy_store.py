"""The recipe "Adding a store" of docs/architecture.md, followed: ``toy://``, a store no part of ppe-snapshot
knows (a memory file system of its own under a new protocol), is registered with fsspec and given a profile
(``register_store``). Nothing above the storage floor tells stores apart, so the engine, the extension with each
writer, retention and the CLI work on it unchanged; the profile says what differs (its data lives in this process:
a ProcessWriter refuses it)."""
from __future__ import annotations

import json
import uuid

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import ppe_snapshot
from ppe_snapshot import Snapshot, StateDict
from ppe_snapshot.cli import main
from ppe_snapshot.storage import StoreProfile, join, register_store

from _extension_workers import Run, assert_same

ITERS = 6


class ToyFileSystem(MemoryFileSystem):
    """``toy://``: a memory file system with a store of its own (nothing shared with ``memory://``)."""
    protocol = ("toy",)
    store: dict = {}
    pseudo_dirs = [""]


#: Keys rather than directories, in this process only, no network (plain reads), nothing else of its own.
TOY = StoreProfile("toy store", ("toy",), object_store=True, remote=False, one_process=True)


@pytest.fixture(scope="module", autouse=True)
def toy_store():
    fsspec.register_implementation("toy", ToyFileSystem, clobber=True)
    register_store(TOY)
    yield
    ToyFileSystem.store.clear()  # the protocol stays registered: fsspec has no call to unregister one


def _url() -> str:
    return f"toy://run-{uuid.uuid4().hex}"


def test_the_engine_takes_and_restores_there():
    url = join(_url(), "snap")
    state = StateDict(w=torch.arange(12.0).reshape(3, 4), step=7)
    Snapshot.take(url, {"s": state})
    out = StateDict(w=torch.zeros(3, 4), step=0)
    snap = Snapshot(url)
    snap.verify()
    snap.restore({"s": out})
    assert torch.equal(out["w"], state["w"]) and out["step"] == 7
    assert ToyFileSystem.store and not any("run-" in key for key in MemoryFileSystem.store if key)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run = Run(str(tmp_path_factory.mktemp("straight")), ITERS, {})
    run.train()
    return run.state()


@pytest.mark.parametrize("writer", ["SimpleWriter", "ThreadWriter", "ThreadQueueWriter"])
def test_the_extension_saves_resumes_and_retains_there(tmp_path, straight, writer):
    """Each writer that writes from this process."""
    url = _url()
    make = getattr(ppe_snapshot.writing, writer)
    first = Run(str(tmp_path), 4, {"writer": make(out_dir=url), "n_retains": 1})
    first.train()
    first.snapshot.writer.finalize()
    resumed = Run(str(tmp_path), ITERS, {"writer": make(out_dir=url), "n_retains": 1, "autoload": True}, seed=1)
    resumed.train()
    resumed.snapshot.writer.finalize()
    assert resumed.snapshot.resumed_from == join(url, "snapshot_iter_4")
    assert_same(resumed.state(), straight)
    listed = ppe_snapshot.retention.list_snapshots(url, "snapshot_iter_{.iteration}")
    assert [c.name for c in listed] == ["snapshot_iter_6"]  # retention removed the older ones there


def test_the_cli_lists_and_prunes_there(capsys):
    url = _url()
    for iteration in (1, 2, 3):
        Snapshot.take(join(url, f"snapshot_iter_{iteration}"), {"s": StateDict(x=torch.ones(4) * iteration)},
                      metadata={"iteration": iteration})
    assert main(["ls", url, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["status"], r["iteration"]) for r in rows] == [
        ("snapshot_iter_1", "complete", 1), ("snapshot_iter_2", "complete", 2), ("snapshot_iter_3", "complete", 3)]
    assert rows[-1]["resume"]
    assert main(["prune", url, "--keep-latest", "1"]) == 0
    assert [c.name for c in ppe_snapshot.retention.list_snapshots(url, "snapshot_iter_{.iteration}")] == [
        "snapshot_iter_3"]


@pytest.mark.parametrize("writer", ["ProcessWriter", "ProcessQueueWriter"])
def test_a_process_writer_refuses_a_store_of_one_process(tmp_path, writer):
    """The writers whose worker is another interpreter: the profile says the toy store's data lives in this
    process, so they refuse it at the save, naming the URL and what to use instead."""
    url = _url()
    saver = getattr(ppe_snapshot.writing, writer)(out_dir=url)
    try:
        with pytest.raises(ValueError, match=f"cannot save to {url}/s: .* lives in one process.*ThreadWriter"):
            saver("s", "", {"x": torch.ones(2)})
    finally:
        saver.finalize()


def test_a_package_registers_its_store_through_an_entry_point(monkeypatch):
    """A package names its profile in entry point group ``ppe_snapshot.stores``: found at the first look-up, beside
    the built-in stores."""
    from ppe_snapshot.storage import stores

    class Point:
        def load(self) -> StoreProfile:
            return StoreProfile("entry store", ("entrytoy",), one_process=True)

    monkeypatch.setattr(stores, "entry_points", lambda group: [Point()] if group == stores.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(stores, "_loaded", False)
    monkeypatch.setattr(stores, "_PROFILES", {})
    assert stores.store_profile("entrytoy").name == "entry store"
    assert stores.profile_of_url("s3://bucket/run").name == "S3" and stores.store_profile("nothing") is None
