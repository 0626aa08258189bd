"""The torch.distributed.checkpoint adapters: real dcp.save / dcp.load over ppe-snapshot snapshots."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import uuid
import warnings

import fsspec
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict

from ppe_snapshot import CorruptSnapshotError, Snapshot, SnapshotExistsError, SnapshotNotFoundError, StateDict
from ppe_snapshot.engine._files import packing
from ppe_snapshot.engine._format.manifest import BytesEntry, ShardedTensorEntry, TensorEntry
from ppe_snapshot.dcp import SnapshotStorageReader, SnapshotStorageWriter
from _asserts import manifest_doc

# DCP warns that it runs in one process when torch.distributed is not initialized; that is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable)")


# -- helpers ----------------------------------------------------------------------------------------


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model and its Adam optimizer after two steps (so every state tensor exists)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(5, 6)).square().sum().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    torch.manual_seed(123)
    model(torch.randn(5, 6)).square().sum().backward()
    optim.step()
    optim.zero_grad()


def _assert_same(a, b) -> None:
    """Bit-exact equality of nested state (tensors by torch.equal and dtype, the rest by ==)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (a, b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    else:
        assert type(a) is type(b) and a == b, (a, b)


def _failure(excinfo: pytest.ExceptionInfo) -> BaseException:
    """The one rank's exception inside DCP's CheckpointException."""
    assert isinstance(excinfo.value, CheckpointException)
    ((error, _trace),) = excinfo.value.failures.values()
    return error


@pytest.fixture(params=["local", "memory"])
def location(request, tmp_path):
    """A fresh snapshot location: a local directory, or a memory:// URL (removed afterwards)."""
    if request.param == "local":
        yield str(tmp_path / "snap")
        return
    url = f"memory://dcp-{uuid.uuid4().hex}/snap"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def _extra() -> dict:
    base = torch.arange(30, dtype=torch.float64).reshape(6, 5)
    return {
        "step": 7, "name": "run-1", "rate": 0.25, "flags": [True, None], "pair": (1, "a"),
        "transposed": base.t(),          # non-contiguous
        "rows": base[2:4],               # a view with a storage offset
        "scalar": torch.tensor(3, dtype=torch.int32),
        "empty": torch.zeros(0, 4),
        "half": torch.linspace(-1, 1, 9, dtype=torch.bfloat16),
    }


def _extra_target() -> dict:
    return {
        "step": 0, "name": "", "rate": 0.0, "flags": [], "pair": (),
        "transposed": torch.zeros(5, 6, dtype=torch.float64), "rows": torch.zeros(2, 5, dtype=torch.float64),
        "scalar": torch.tensor(0, dtype=torch.int32), "empty": torch.ones(0, 4),
        "half": torch.zeros(9, dtype=torch.bfloat16),
    }


def _save_dcp(path: str, storage_options=None) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    model, optim = _trained(0)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd, "extra": _extra()},
             storage_writer=SnapshotStorageWriter(path, storage_options))
    return model, optim, _extra()


def _load_dcp_and_check(path: str, model, optim, extra, storage_options=None) -> None:
    model2, optim2 = _trained(1)
    msd, osd = get_state_dict(model2, optim2)
    target = {"model": msd, "optim": osd, "extra": _extra_target()}
    dcp.load(target, storage_reader=SnapshotStorageReader(path, storage_options))
    set_state_dict(model2, optim2, model_state_dict=target["model"], optim_state_dict=target["optim"])
    _assert_same(model.state_dict(), model2.state_dict())
    _assert_same(optim.state_dict(), optim2.state_dict())
    _assert_same(extra, target["extra"])
    _step(model, optim)  # and training goes on identically
    _step(model2, optim2)
    _assert_same(model.state_dict(), model2.state_dict())


# -- snapshots written through DCP -----------------------------------------------------------------


def test_dcp_round_trip_model_adam_and_values(location):
    model, optim, extra = _save_dcp(location)
    _load_dcp_and_check(location, model, optim, extra)


def test_dcp_snapshot_is_an_engine_snapshot(tmp_path):
    path = str(tmp_path / "snap")
    model, _, extra = _save_dcp(path)
    snap = Snapshot(path)
    snap.verify()
    manifest = snap.get_manifest()
    assert isinstance(manifest["0/model.0.weight"], TensorEntry)
    assert isinstance(manifest["0/optim.state.0.weight.exp_avg"], TensorEntry)
    assert isinstance(manifest["0/extra.step"], BytesEntry)
    assert isinstance(manifest["0/optim.param_groups.0.betas"], BytesEntry)
    assert sorted(os.listdir(path)) == ["data", "index", "manifest.json"]  # format version 2
    assert os.listdir(os.path.join(path, "data")) == ["rank0.bin"]
    assert sorted(os.listdir(os.path.join(path, "index"))) == ["rank0.idx", "shared.idx"]
    # the engine reads plain tensors, and hands DCP's serialized values back as bytes without unpickling them
    assert torch.equal(snap.read_object("model.0.weight"), model[0].weight)
    assert torch.equal(snap.read_object("extra.transposed"), extra["transposed"])
    raw = snap.read_object("extra.name")
    assert isinstance(raw, bytes) and torch.load(io.BytesIO(raw), weights_only=True) == "run-1"
    doc = manifest_doc(path)
    assert doc["metadata"]["dcp"]["adapter_version"] == 1
    assert doc["metadata"]["dcp"]["planner_data"]  # DCP's flatten mapping, as tagged JSON
    assert doc["ranks"] == [{}] and doc["files"] == {"data/rank0.bin": os.path.getsize(f"{path}/data/rank0.bin")}


def test_an_empty_fqn_is_an_item_like_any_other(tmp_path):
    """DCP takes ``""`` as a key: its item round-trips through DCP, and the engine reads it by the key
    get_manifest() lists for it (``"0/"``), as every other."""
    path = str(tmp_path / "snap")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (DCP: no process group, one process assumed)
        dcp.save({"": torch.arange(3.0), "a": {"": torch.ones(2)}}, storage_writer=SnapshotStorageWriter(path))
        loaded = {"": torch.zeros(3), "a": {"": torch.zeros(2)}}
        dcp.load(loaded, storage_reader=SnapshotStorageReader(path))
    assert torch.equal(loaded[""], torch.arange(3.0)) and torch.equal(loaded["a"][""], torch.ones(2))
    snap = Snapshot(path)
    snap.verify()
    assert sorted(snap.get_manifest()) == ["0/", "0/a."]
    assert torch.equal(snap.read_object("0/"), torch.arange(3.0))
    assert torch.equal(snap.read_object("0/a."), torch.ones(2))


def test_dcp_metadata_round_trips(tmp_path):
    path = str(tmp_path / "snap")
    state = {"w": torch.ones(2, 3, requires_grad=True), "v": {"n": 1}, "a/b%c": torch.arange(2)}
    saved = dcp.save(state, storage_writer=SnapshotStorageWriter(path))
    md = SnapshotStorageReader(path).read_metadata()
    assert md.state_dict_metadata == saved.state_dict_metadata  # chunks, sizes and TensorProperties
    assert md.state_dict_metadata["w"].properties.requires_grad
    assert md.planner_data == saved.planner_data == {"w": ("w",), "v.n": ("v", "n"), "a/b%c": ("a/b%c",)}
    assert torch.equal(Snapshot(path).read_object("a%2Fb%25c"), torch.arange(2))  # one escaped path segment
    assert md.storage_meta.load_id and md.storage_meta.checkpoint_id == path


def test_flipped_byte_fails_verify_and_dcp_load(tmp_path):
    path = str(tmp_path / "snap")
    model, _, _ = _save_dcp(path)
    chunk = Snapshot(path).get_manifest()["0/model.2.weight"].chunks[0]
    with open(os.path.join(path, chunk.file), "r+b") as f:
        f.seek(chunk.offset + 5)
        byte = f.read(1)
        f.seek(chunk.offset + 5)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CorruptSnapshotError, match="checksum mismatch"):
        Snapshot(path).verify()
    target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    with pytest.raises(CheckpointException) as excinfo:
        dcp.load(target, storage_reader=SnapshotStorageReader(path))
    error = _failure(excinfo)
    assert isinstance(error, CorruptSnapshotError)
    assert "checksum mismatch" in str(error) and "model.2.weight" in str(error)


def test_dcp_save_refuses_existing_snapshot_and_load_needs_one(tmp_path):
    path = str(tmp_path / "snap")
    dcp.save({"a": torch.ones(2)}, storage_writer=SnapshotStorageWriter(path))
    with pytest.raises(CheckpointException) as excinfo:
        dcp.save({"a": torch.zeros(2)}, storage_writer=SnapshotStorageWriter(path))
    assert isinstance(_failure(excinfo), SnapshotExistsError)
    assert "a snapshot already exists at" in str(_failure(excinfo))
    assert torch.equal(Snapshot(path).read_object("a"), torch.ones(2))  # untouched
    with pytest.raises(CheckpointException) as excinfo:
        dcp.load({"a": torch.zeros(2)}, storage_reader=SnapshotStorageReader(str(tmp_path / "none")))
    if torch.__version__ < "2.12":  # (DCP before torch 2.12 drops the reader's error, then asserts it has metadata)
        assert type(_failure(excinfo)) is AssertionError
    else:
        assert "no snapshot at" in str(_failure(excinfo)) and "manifest.json is missing" in str(_failure(excinfo))
    with pytest.raises(SnapshotNotFoundError, match="manifest.json is missing"):
        SnapshotStorageReader(str(tmp_path / "none")).read_metadata()
    assert not os.path.exists(tmp_path / "none")


def test_a_damaged_manifest_is_named_through_dcp_load(tmp_path):
    path = tmp_path / "snap"
    dcp.save({"a": torch.ones(2)}, storage_writer=SnapshotStorageWriter(str(path)))
    doc = json.loads((path / "manifest.json").read_text())
    doc["world_size"] = "x"
    (path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointException) as excinfo:
        dcp.load({"a": torch.zeros(2)}, storage_reader=SnapshotStorageReader(str(path)))
    if torch.__version__ >= "2.12":  # (DCP's loader raises its own AssertionError, with the reader's message)
        assert "manifest.json is malformed: world_size 'x' is not a positive integer" in str(_failure(excinfo))
    with pytest.raises(CorruptSnapshotError, match="world_size 'x' is not a positive integer"):
        SnapshotStorageReader(str(path)).read_metadata()


def test_checkpoint_id_selects_the_path(tmp_path):
    writer = SnapshotStorageWriter(tmp_path / "unused")
    dcp.save({"a": torch.arange(3)}, checkpoint_id=tmp_path / "chosen", storage_writer=writer)
    assert writer.checkpoint_id == str(tmp_path / "chosen")
    out = {"a": torch.zeros(3, dtype=torch.int64)}
    dcp.load(out, checkpoint_id=tmp_path / "chosen", storage_reader=SnapshotStorageReader(tmp_path / "unused"))
    assert torch.equal(out["a"], torch.arange(3)) and not os.path.exists(tmp_path / "unused")


def test_validate_checkpoint_id():
    for cls in (SnapshotStorageWriter, SnapshotStorageReader):
        assert cls.validate_checkpoint_id("/tmp/x") and cls.validate_checkpoint_id("relative/dir")
        assert cls.validate_checkpoint_id(os.path.join(os.sep, "p")) and cls.validate_checkpoint_id("file:///tmp/x")
        assert cls.validate_checkpoint_id("memory://x") and cls.validate_checkpoint_id("s3://bucket/run")
        assert cls.validate_checkpoint_id("simplecache::s3://bucket/run")
        assert not cls.validate_checkpoint_id("nosuchproto://x")
        assert not cls.validate_checkpoint_id("")
        assert not cls.validate_checkpoint_id(42)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dcp_cuda_tensors(tmp_path):
    path = str(tmp_path / "snap")
    base = torch.randn(64, 33, device="cuda")
    dcp.save({"w": base, "t": base.t(), "cpu": base.cpu()}, storage_writer=SnapshotStorageWriter(path))
    out = {"w": torch.zeros_like(base), "t": torch.zeros(33, 64, device="cuda"), "cpu": torch.zeros(64, 33)}
    dcp.load(out, storage_reader=SnapshotStorageReader(path))
    assert torch.equal(out["w"], base) and torch.equal(out["t"], base.t()) and torch.equal(out["cpu"], base.cpu())


# -- snapshots taken by the engine, read through DCP -------------------------------------------------


def _engine_extra() -> StateDict:
    return StateDict(
        step=11, name="engine", rate=0.5, pair=(2, "b"), ids=[3, 4], none=None,
        t=torch.arange(10, dtype=torch.int16),
        nested={"a": [1, 2], "w": torch.full((2, 2), 1.5)},
        tensors=[torch.ones(3), torch.zeros(2, dtype=torch.int64)],
        mixed=(torch.tensor([7.0]), "x"),  # DCP loads a tuple as one value
        arr=np.arange(6, dtype=np.int32).reshape(2, 3),
    )


def _engine_extra_target() -> StateDict:
    return StateDict(
        step=0, name="", rate=0.0, pair=(), ids=[], none=1, t=torch.zeros(10, dtype=torch.int16),
        nested={"a": [], "w": torch.zeros(2, 2)}, tensors=[torch.zeros(3), torch.ones(2, dtype=torch.int64)],
        mixed=(), arr=np.zeros(1),
    )


def test_engine_snapshot_loads_through_dcp(location):
    model, optim = _trained(0)
    extra = _engine_extra()
    Snapshot.take(location, {"model": model, "optim": optim, "extra": extra})
    model2, optim2 = _trained(1)
    target = _engine_extra_target()
    dcp.load({"model": model2, "optim": optim2, "extra": target}, storage_reader=SnapshotStorageReader(location))
    _assert_same(model.state_dict(), model2.state_dict())
    _assert_same(optim.state_dict(), optim2.state_dict())
    _assert_same(dict(extra), dict(target))
    _step(model, optim)
    _step(model2, optim2)
    _assert_same(model.state_dict(), model2.state_dict())


def test_engine_snapshot_metadata_follows_dcp_flattening(tmp_path):
    path = str(tmp_path / "snap")
    model, optim = _trained(0)
    Snapshot.take(path, {"model": model, "optim": optim, "extra": _engine_extra()})
    md = SnapshotStorageReader(path).read_metadata().state_dict_metadata
    # exactly the keys DCP itself gives the same state
    flat, _ = flatten_state_dict(_stateful_to_state_dict({"model": model, "optim": optim, "extra": _engine_extra()}))
    assert sorted(md) == sorted(flat)
    for fqn, value in flat.items():
        kind = TensorStorageMetadata if isinstance(value, torch.Tensor) else BytesStorageMetadata
        assert isinstance(md[fqn], kind), fqn
    assert md["optim.state.0.exp_avg"].size == optim.state_dict()["state"][0]["exp_avg"].shape
    # and DCP can rebuild the state without a template, from the planner_data
    rebuilt = _load_state_dict_from_keys(storage_reader=SnapshotStorageReader(path))
    _assert_same(model.state_dict(), dict(rebuilt["model"]))
    _assert_same(dict(_engine_extra()), rebuilt["extra"])


# -- several ranks -----------------------------------------------------------------------------------


def _per_rank(rank: int) -> torch.Tensor:
    return torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * rank


_SHARED = torch.linspace(0, 1, 17, dtype=torch.float64)


def _dist_save_and_load(path: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({f"own{rank}": _per_rank(rank), "shared": _SHARED.clone(), "info": {"world": world}},
                 storage_writer=SnapshotStorageWriter(path))
        out = {f"own{r}": torch.zeros(3, 4) for r in range(world)}
        out.update(shared=torch.zeros(17, dtype=torch.float64), info={"world": 0})
        dcp.load(out, storage_reader=SnapshotStorageReader(path))
    for r in range(world):
        assert torch.equal(out[f"own{r}"], _per_rank(r))
    assert torch.equal(out["shared"], _SHARED) and out["info"] == {"world": world}


def test_two_ranks_save_and_load_one_snapshot(dist_run, tmp_path):
    path = str(tmp_path / "snap")
    dist_run(_dist_save_and_load, 2, path)
    snap = Snapshot(path)
    snap.verify()
    assert sorted(os.listdir(os.path.join(path, "data"))) == ["rank0.bin", "rank1.bin"]
    assert torch.equal(snap.read_object("own1"), _per_rank(1))
    assert torch.equal(snap.read_object("shared"), _SHARED)
    out = {"own0": torch.zeros(3, 4), "shared": torch.zeros(17, dtype=torch.float64)}
    dcp.load(out, storage_reader=SnapshotStorageReader(path))  # one process reads what two wrote
    assert torch.equal(out["own0"], _per_rank(0)) and torch.equal(out["shared"], _SHARED)


_FULL = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)


def _dist_save_dtensor(path: str, engine_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    chunk_bytes = packing.CHUNK_BYTES
    packing.CHUNK_BYTES = 40  # 10 floats: chunks straddle rows, so partial reads span several checksummed chunks
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"w": distribute_tensor(_FULL, mesh, [Shard(0)]), "p": _FULL * 2},
                     storage_writer=SnapshotStorageWriter(path))
            # load back resharded: w by columns (non-contiguous pieces of each saved shard), p by rows
            out = {"w": distribute_tensor(torch.zeros(7, 6), mesh, [Shard(1)]),
                   "p": distribute_tensor(torch.zeros(7, 6), mesh, [Shard(0)])}
            dcp.load(out, storage_reader=SnapshotStorageReader(path))
            # a DTensor taken by the engine (its manifest's sharded section) loads through DCP too
            Snapshot.take(engine_path, {"model": StateDict(w=distribute_tensor(_FULL, mesh, [Shard(1)]))})
            from_engine = {"model": {"w": distribute_tensor(torch.zeros(7, 6), mesh, [Shard(0)])}}
            dcp.load(from_engine, storage_reader=SnapshotStorageReader(engine_path))
    finally:
        packing.CHUNK_BYTES = chunk_bytes
    assert torch.equal(out["w"].to_local(), distribute_tensor(_FULL, mesh, [Shard(1)]).to_local())
    assert torch.equal(out["p"].to_local(), distribute_tensor(_FULL * 2, mesh, [Shard(0)]).to_local())
    assert torch.equal(from_engine["model"]["w"].to_local(), distribute_tensor(_FULL, mesh, [Shard(0)]).to_local())


def test_dtensor_shards_reshard_to_one_process(dist_run, tmp_path):
    path, engine_path = str(tmp_path / "snap"), str(tmp_path / "engine")
    dist_run(_dist_save_dtensor, 2, path, engine_path)
    snap = Snapshot(path)
    snap.verify()
    entry = snap.get_manifest()["0/w"]
    assert isinstance(entry, ShardedTensorEntry) and entry.shape == [7, 6]
    assert [(s.offsets, s.sizes) for s in entry.shards] == [([0, 0], [4, 6]), ([4, 0], [3, 6])]
    assert [c.nbytes for c in entry.shards[0].chunks] == [40, 40, 16]
    out = {"w": torch.empty(7, 6), "p": torch.empty(7, 6)}
    dcp.load(out, storage_reader=SnapshotStorageReader(path))
    assert torch.equal(out["w"], _FULL) and torch.equal(out["p"], _FULL * 2)
    full = {"model": {"w": torch.empty(7, 6)}}
    dcp.load(full, storage_reader=SnapshotStorageReader(engine_path))
    assert torch.equal(full["model"]["w"], _FULL)


def _dist_engine_take_then_dcp_load(path: str) -> None:
    rank = dist.get_rank()
    Snapshot.take(path, {"mine": StateDict(w=_per_rank(rank), tag=f"rank{rank}"), "common": StateDict(s=_SHARED)},
                  replicated=["common/*"])
    out = {"mine": {"w": torch.zeros(3, 4), "tag": ""}, "common": {"s": torch.zeros(17, dtype=torch.float64)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=SnapshotStorageReader(path))
    assert torch.equal(out["mine"]["w"], _per_rank(rank)) and out["mine"]["tag"] == f"rank{rank}"
    assert torch.equal(out["common"]["s"], _SHARED)


def test_multi_rank_engine_snapshot_each_rank_reads_its_own(dist_run, tmp_path):
    dist_run(_dist_engine_take_then_dcp_load, 2, str(tmp_path / "snap"))


def test_one_process_engine_snapshot_is_read_by_every_rank(dist_run, tmp_path):
    path = str(tmp_path / "snap")
    Snapshot.take(path, {"mine": StateDict(w=_per_rank(0), tag="rank0"), "common": StateDict(s=_SHARED)})
    dist_run(_dist_read_rank0_state, 2, path)


def _dist_read_rank0_state(path: str) -> None:
    out = {"mine": {"w": torch.zeros(3, 4), "tag": ""}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=SnapshotStorageReader(path))
    assert torch.equal(out["mine"]["w"], _per_rank(0)) and out["mine"]["tag"] == "rank0"


_A_BYTE_ITEM_OF_A_PLANNERS_BUFFER = """
import gc, io, sys
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from ppe_snapshot.dcp.writer import _resolve

buffer = io.BytesIO()
torch.save(3, buffer)
value = buffer.getvalue()

class Planner:
    def resolve_data(self, item):
        return buffer

unraisable = []
sys.unraisablehook = unraisable.append
payload = _resolve(WriteItem(index=MetadataIndex("step"), type=WriteItemType.BYTE_IO), Planner())
buffer.write(b"more")  # (a BufferError while a view of it is exported)
assert bytes(payload.data) == value
cycle = [payload]
cycle.append(cycle)
del payload, cycle, buffer
gc.collect()
assert not unraisable, [u.exc_value for u in unraisable]
"""


def test_a_byte_item_is_written_from_its_bytes_not_from_a_view_pinning_the_planners_buffer():
    """A BYTE_IO item's payload holds the BytesIO's bytes, not a getbuffer() view of it: the planner's buffer stays
    resizable, and a payload caught in a reference cycle is collected (on Python 3.12.0-3.12.1 the collector
    crashed the process on such a view: CPython gh-111049; hence a process of its own)."""
    done = subprocess.run([sys.executable, "-c", _A_BYTE_ITEM_OF_A_PLANNERS_BUFFER], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
