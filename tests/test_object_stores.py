"""Every engine path, the extension with each writer, the command line and the DCP adapter on each object store
(S3, Google Cloud Storage, Azure Blob), against their emulators on 127.0.0.1; and listings that are never stale."""
from __future__ import annotations

import json
import sys

import fsspec.asyn
import pytest
import pytorch_pfn_extras as ppe
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import ppe_snapshot
from ppe_snapshot import CorruptSnapshotError, Snapshot, SnapshotNotFoundError, StateDict
from ppe_snapshot.cli import main
from ppe_snapshot.dcp import SnapshotStorageReader, SnapshotStorageWriter
from ppe_snapshot.retention import KeepBest, KeepLatest, list_snapshots
from ppe_snapshot.storage import join, open_storage, url_to_fs
from ppe_snapshot.storage.part_stores import part_store_type

import _sharded_workers
import _warm
from _asserts import assert_ranged_reads_scatter
from _extension_workers import Crash, Run, assert_same, dist_replace_latest, make_writer

ITERS = 10


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        optim.zero_grad()
        model(torch.randn(4, 16)).sum().backward()
        optim.step()
    return model, optim


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _assert_restored(model, optim, fresh, fresh_optim) -> None:
    assert_same(fresh.state_dict(), model.state_dict())
    assert_same(fresh_optim.state_dict()["state"], optim.state_dict()["state"])
    assert fresh_optim.state_dict()["param_groups"] == optim.state_dict()["param_groups"]


# -- the engine ----------------------------------------------------------------------------------------------


def test_take_restore_read_verify(object_store):
    url, options = object_store.url, object_store.options
    model, optim = _trained()
    Snapshot.take(f"{url}/run/snap", {"model": model, "optim": optim}, storage_options=options,
                  metadata={"iteration": 2})
    stored = sorted(p.split("/snap/", 1)[1] for p in object_store.fs().find(f"{url}/run/snap"))
    assert stored == ["data/rank0.bin", "index/rank0.idx", "index/shared.idx", "manifest.json"]
    snap = Snapshot(f"{url}/run/snap", storage_options=options)
    fresh, fresh_optim = _fresh()
    snap.restore({"model": fresh, "optim": fresh_optim})
    _assert_restored(model, optim, fresh, fresh_optim)
    assert torch.equal(snap.read_object("0/model/0.weight"), model[0].weight.detach())
    out = torch.empty(4)
    assert snap.read_object("0/model/2.bias", obj_out=out) is out and torch.equal(out, model[2].bias.detach())
    assert snap.read_object("0/optim/param_groups/0/lr") == 0.01
    assert snap.get_manifest()["0/model/0.weight"].shape == [8, 16]
    assert snap.metadata == {"iteration": 2}
    snap.verify()

    pending = Snapshot.async_take(f"{url}/run/async", {"model": model}, storage_options=options)
    pending.wait()
    fresh, _ = _fresh()
    Snapshot(f"{url}/run/async", storage_options=options).restore({"model": fresh})
    assert_same(fresh.state_dict(), model.state_dict())


def test_many_small_tensors_restore_in_bulk(object_store):
    url, options = object_store.url, object_store.options
    torch.manual_seed(1)
    state = {f"t{i}": torch.randn(i % 7 + 1, 3) for i in range(1500)}
    Snapshot.take(f"{url}/many", {"m": StateDict(state)}, storage_options=options)
    target = StateDict({k: torch.zeros_like(v) for k, v in state.items()})
    before = dict(target)
    Snapshot(f"{url}/many", storage_options=options).restore({"m": target})
    assert all(target[k] is before[k] for k in state)  # in place
    assert_same(dict(target), state)


def test_missing_manifest_and_truncated_data(object_store):
    url, options = object_store.url, object_store.options
    with pytest.raises(SnapshotNotFoundError, match="manifest.json is missing"):
        Snapshot(f"{url}/nothing", storage_options=options).restore({"model": nn.Linear(2, 2)})
    Snapshot.take(f"{url}/snap", {"s": StateDict(a=torch.arange(100), b=torch.ones(50))}, storage_options=options)
    fs, data = object_store.fs(), f"{url}/snap/data/rank0.bin"
    fs.pipe_file(data, fs.cat_file(data)[:800])  # a whole, b (from byte 832) gone
    with pytest.raises(CorruptSnapshotError, match="missing or truncated"):
        Snapshot(f"{url}/snap", storage_options=options).restore({"s": StateDict()})
    with pytest.raises(CorruptSnapshotError, match="800 bytes"):
        Snapshot(f"{url}/snap", storage_options=options).verify()


def test_resharding_restore(object_store, dist_run):
    """Rows of a DTensor taken by two ranks, read back whole by one process."""
    url, options = object_store.url, object_store.options
    dist_run(_sharded_workers.take_rows_on_two, 2, f"{url}/dt2", options)
    expected = _sharded_workers.reference("chunky")
    snap = Snapshot(f"{url}/dt2", storage_options=options)
    assert torch.equal(snap.read_object("dt/w"), expected)
    target = StateDict(w=torch.zeros_like(expected))
    snap.restore({"dt": target})
    assert torch.equal(target["w"], expected)


def test_two_ranks_replace_a_snapshot_with_one_rank_late(object_store, dist_run):
    """SHARDED saves replacing ``latest`` (copied to the name: a store has no rename), rank 1 learning of each
    commit late: ``latest`` holds the last save, nothing of its take's records, and nothing stays beside it."""
    url, options = object_store.url, object_store.options
    dist_run(dist_replace_latest, 2, f"{url}/run", options, "ThreadWriter", 1)
    stored = sorted(p.split("/run/", 1)[1] for p in object_store.fs().find(f"{url}/run"))
    assert stored == ["latest/data/rank0.bin", "latest/data/rank1.bin", "latest/index/rank0.idx",
                      "latest/index/rank1.idx", "latest/index/shared.idx", "latest/manifest.json"]
    snap = Snapshot(f"{url}/run/latest", storage_options=options)
    assert snap.metadata == {"iteration": 2}
    assert [snap.read_object(f"{rank}/state/t").tolist() for rank in (0, 1)] == [[20.0] * 4, [21.0] * 4]


def test_google_cloud_storage_under_both_schemes(gcs_bucket):
    url, options = gcs_bucket
    bucket = url.removeprefix("gs://")
    state = StateDict(w=torch.randn(64, 64))
    Snapshot.take(f"gcs://{bucket}/a", {"s": state}, storage_options=options)
    out = StateDict(w=torch.zeros(64, 64))
    Snapshot(f"gs://{bucket}/a", storage_options=options).restore({"s": out})
    assert torch.equal(out["w"], state["w"])


def test_gcs_ranged_reads_stream_into_the_views(gcs_bucket):
    """GCS reads are streamed into place (storage/stores/gcs.py); a missing object is FileNotFoundError."""
    url, options = gcs_bucket
    storage = open_storage(url, options)
    assert_ranged_reads_scatter(storage, stream=True)
    with pytest.raises(FileNotFoundError):
        storage.read_into("none", 0, memoryview(bytearray(10)))


@pytest.mark.parametrize("tail", [b"\r", b"\n", b"\r\n", b"\n\r"])
def test_an_object_ending_in_a_line_break_reads_back_whole(object_store, tail):
    """An index file ends in its checksum, any byte: the GCS emulator stored one ending in \\r a byte short."""
    store = open_storage(f"{object_store.url}/snap", object_store.options)
    store.put_atomic("index/rank0.idx", b"PPESIDX2" + tail)
    assert store.read_bytes("index/rank0.idx") == b"PPESIDX2" + tail


# -- the extension -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run = Run(str(tmp_path_factory.mktemp("straight")), ITERS, {})
    run.train()
    return run.state()


@pytest.mark.parametrize("kind", ["SimpleWriter", "ThreadWriter", "ProcessWriter"])
def test_extension_autoload_and_retention(object_store, kind, straight, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url, options = f"{object_store.url}/run", object_store.options
    writer = lambda: make_writer(kind, out_dir=url, storage_options=options)  # noqa: E731
    first = Run(str(tmp_path), ITERS, {"writer": writer(), "n_retains": 2})
    with pytest.raises(Crash):
        first.train(crash_at=7)
    first.snapshot.writer.finalize()
    resumed = Run(str(tmp_path), ITERS, {"writer": writer(), "n_retains": 2, "autoload": True}, seed=1)
    resumed.train()
    resumed.snapshot.writer.finalize()
    assert resumed.snapshot.resumed_from == join(url, "snapshot_iter_6")
    assert_same(resumed.state(), straight)
    found = list_snapshots(url, "snapshot_iter_{.iteration}", options)
    assert [c.name for c in found] == ["snapshot_iter_8", "snapshot_iter_10"]
    assert _names(object_store, url) == ["snapshot_iter_10", "snapshot_iter_8"]


def test_extension_policies_and_snapshot_on_error(object_store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url, options = f"{object_store.url}/run", object_store.options
    writer = make_writer("ThreadWriter", out_dir=url, storage_options=options)
    run = Run(str(tmp_path), ITERS, {"writer": writer, "keep": KeepLatest(1) | KeepBest("loss", mode="max"),
                                     "snapshot_on_error": True})
    losses = iter([5.0, 9.0, 1.0])

    def report_loss(manager):
        ppe.reporting.report({"loss": next(losses)})
    run.manager.extend(report_loss, trigger=(2, "iteration"), priority=300)
    with pytest.raises(Crash), pytest.warns(UserWarning, match="no number for|no recorded value"):
        run.train(crash_at=7)
    writer.finalize()
    # saved at 2 (loss 5), 4 (loss 9, the best), 6 (loss 1), then 7 on error: the newest and the best are kept
    assert _names(object_store, url) == ["snapshot_iter_4", "snapshot_iter_7"]
    assert Snapshot(f"{url}/snapshot_iter_7", storage_options=options).metadata["iteration"] == 7


def _names(store, url: str) -> list[str]:
    """The run directory's entries, as a new client sees them."""
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in store.fs().ls(url, detail=False))


def test_listings_see_what_another_process_wrote(object_store, tmp_path):
    """A snapshot written by another process after this one listed the directory is listed and pruned here."""
    url, options = f"{object_store.url}/run", object_store.options
    Snapshot.take(f"{url}/snapshot_iter_1", {"s": StateDict(x=torch.ones(3))}, storage_options=options,
                  metadata={"iteration": 1})
    assert [c.name for c in list_snapshots(url, "snapshot_iter_{.iteration}", options)] == ["snapshot_iter_1"]
    code = ("import sys, json, torch; from ppe_snapshot import Snapshot, StateDict\n"
            "url, options = sys.argv[1], json.loads(sys.argv[2])\n"
            "for i in (2, 3):\n"
            "    Snapshot.take(f'{url}/snapshot_iter_{i}', {'s': StateDict(x=torch.ones(3))}, storage_options=options,"
            " metadata={'iteration': i})\n")
    done = _warm.run([sys.executable, "-c", code, url, json.dumps(options)], capture_output=True, text=True,
                     timeout=300)
    assert done.returncode == 0, done.stderr
    assert [c.name for c in list_snapshots(url, "snapshot_iter_{.iteration}", options)] == [
        "snapshot_iter_1", "snapshot_iter_2", "snapshot_iter_3"]
    removed = ppe_snapshot.retention.prune(url, "snapshot_iter_{.iteration}", 1, storage_options=options)
    assert sorted(removed) == [f"{url}/snapshot_iter_1", f"{url}/snapshot_iter_2"]
    assert _names(object_store, url) == ["snapshot_iter_3"]


# -- the command line and the DCP adapter ---------------------------------------------------------------------


def test_command_line(object_store, tmp_path, capsys):
    url, flags = f"{object_store.url}/run", object_store.cli_flags
    for i in (10, 20, 30):
        Snapshot.take(f"{url}/snapshot_iter_{i}", {"state": StateDict(w=torch.full((3, 4), float(i)))},
                      storage_options=object_store.options, metadata={"iteration": i})
    assert main(["ls", "--json", url, *flags]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["status"], r["resume"]) for r in rows] == [
        ("snapshot_iter_10", "complete", False), ("snapshot_iter_20", "complete", False),
        ("snapshot_iter_30", "complete", True)]
    assert main(["verify", f"{url}/snapshot_iter_30", *flags]) == 0
    assert main(["inspect", f"{url}/snapshot_iter_30", *flags]) == 0
    assert "0/state/w: tensor float32[3, 4] 48 B" in capsys.readouterr().out
    assert main(["convert", "--to", "safetensors", f"{url}/snapshot_iter_30", f"{url}/w.safetensors", *flags]) == 0
    assert main(["convert", "--to", "torch", f"{url}/snapshot_iter_20", str(tmp_path / "w.pt"), *flags]) == 0
    saved = torch.load(tmp_path / "w.pt", weights_only=True)  # the state alone, as ppe saves it
    assert torch.equal(saved["w"], torch.full((3, 4), 20.0))
    assert main(["prune", url, "--keep-latest", "1", *flags]) == 0
    assert _names(object_store, url) == ["snapshot_iter_30", "w.safetensors"]


@pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable)")
def test_dcp_round_trip(object_store):
    url, options = object_store.url, object_store.options
    model, optim = _trained()
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    dcp.save(state, storage_writer=SnapshotStorageWriter(f"{url}/dcp", storage_options=options))
    Snapshot(f"{url}/dcp", storage_options=options).verify()
    fresh, fresh_optim = _fresh()
    loaded = {"model": fresh.state_dict(), "optim": torch.optim.Adam(fresh.parameters()).state_dict()}
    dcp.load(loaded, storage_reader=SnapshotStorageReader(f"{url}/dcp", storage_options=options))
    assert_same(loaded["model"], model.state_dict())


@pytest.mark.parametrize("url, extra, package", [("gs://bucket/run", "gcs", "gcsfs"),
                                                 ("az://container/run", "azure", "adlfs")])
def test_a_store_whose_file_system_is_not_installed_names_the_extra(url, extra, package):
    code = ("import sys; sys.modules[sys.argv[1]] = None  # as if not installed\n"
            "import torch\nfrom ppe_snapshot import Snapshot, StateDict\nfrom ppe_snapshot.cli import main\n"
            "print('ls exit', main(['ls', sys.argv[2]]), flush=True)\n"
            "Snapshot.take(sys.argv[2] + '/snap', {'s': StateDict(x=torch.ones(1))})\n")
    done = _warm.run([sys.executable, "-c", code, package, url], capture_output=True, text=True, timeout=300)
    line = f"{url.split(':')[0]}:// needs {package}, which is not installed: pip install 'ppe-snapshot[{extra}]'"
    assert done.stdout == "ls exit 2\n"  # the CLI: one line on stderr, exit 2
    first, *rest = done.stderr.splitlines()
    assert first == f"ppe-snapshot: ImportError: {url}: {line}", done.stderr
    assert done.returncode == 1 and rest[-1] == f"ImportError: {url}/snap: {line}"  # the engine


# -- data files in parts sent in parallel -------------------------------------------------------------------------

#: Parts as small as each store takes (S3: 5 MiB), so that a small state goes up in many: GCS composes 48 here,
#: in two rounds (32 at a time).
PART_SIZE = {"s3": 5 << 20, "gcs": 256 << 10, "azure": 1 << 20}


def _assembled_from(store, path: str) -> int | None:
    """How many parts the object at ``path`` was assembled from, as the store records it (None: not recorded,
    as by the GCS emulator, which keeps no ``componentCount``)."""
    fs = store.fs()
    if store.kind == "s3":
        etag = fs.info(path)["ETag"].strip('"')
        return int(etag.split("-")[1]) if "-" in etag else 1
    if store.kind == "azure":
        container, blob, _ = fs.split_path(path)
        client = fs.service_client.get_blob_client(container, blob)
        committed, _ = fsspec.asyn.sync(fs.loop, client.get_block_list, "committed")
        return len(committed)
    return fs.info(path).get("componentCount")


def test_a_data_file_goes_up_in_parallel_parts_and_reads_back(object_store, monkeypatch):
    url, options = object_store.url, {**object_store.options, "ppe_part_size": PART_SIZE[object_store.kind]}
    sent: list[int] = []
    store_type = part_store_type(object_store.fs())
    put_part = store_type.put_part

    async def counted(self, number, body):
        sent.append(number)
        return await put_part(self, number, body)
    monkeypatch.setattr(store_type, "put_part", counted)
    torch.manual_seed(2)
    state = StateDict(big=torch.randn(3 << 20), small=torch.randn(3, 5))  # 12 MiB
    Snapshot.take(f"{url}/parts", {"s": state}, storage_options=options)
    data = f"{url}/parts/data/rank0.bin"
    parts = -(-object_store.fs().info(data)["size"] // PART_SIZE[object_store.kind])
    assert sorted(sent) == list(range(1, parts + 1)) and parts > 2
    assert _assembled_from(object_store, data) in (parts, None)
    assert _names(object_store, f"{url}/parts/data") == ["rank0.bin"]  # no component left beside it
    out = StateDict(big=torch.zeros(3 << 20), small=torch.zeros(3, 5))
    Snapshot(f"{url}/parts", storage_options=options).restore({"s": out})
    assert torch.equal(out["big"], state["big"]) and torch.equal(out["small"], state["small"])
    Snapshot(f"{url}/parts", storage_options=options).verify()


def test_an_abandoned_upload_leaves_nothing_visible(object_store):
    options = {**object_store.options, "ppe_part_size": PART_SIZE[object_store.kind]}
    store = open_storage(f"{object_store.url}/snap", options)
    writer = store.open_writer("data/rank0.bin")
    writer.write([memoryview(bytes(3 * PART_SIZE[object_store.kind] + 10))])  # 3 parts sent, one filling
    writer.abort()
    assert not store.exists("data/rank0.bin")
    assert object_store.fs().find(f"{object_store.url}/snap") == []


def test_a_listing_cached_before_a_snapshot_was_complete_is_not_used(object_store):
    """The file system instance the library uses listed a snapshot's directory while another client was still
    writing it; once complete, the listing sees it complete (it did not on GCS: the stale listing answered)."""
    url, options = f"{object_store.url}/run", object_store.options
    fs, root = url_to_fs(url, options)  # the library's own, cached instance
    other = {**options, "skip_instance_cache": True}  # another client, as another process would be
    Snapshot.take(f"{url}/snapshot_iter_1", {"s": StateDict(x=torch.ones(3))}, storage_options=other,
                  metadata={"iteration": 1})
    object_store.fs().pipe_file(f"{url}/snapshot_iter_2/data/rank0.bin", b"a take in progress")
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/snapshot_iter_2", detail=False)] == ["data"]
    Snapshot.take(f"{url}/snapshot_iter_2", {"s": StateDict(x=torch.ones(3))}, storage_options=other,
                  metadata={"iteration": 2})
    found = list_snapshots(url, "snapshot_iter_{.iteration}", options)
    assert [(c.name, c.complete) for c in found] == [("snapshot_iter_1", True), ("snapshot_iter_2", True)]
