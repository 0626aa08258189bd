"""Sharded state (DTensor, FSDP2, ShardedTensor): written once, restored on other world sizes.

All multi-rank work runs on real gloo groups in four ``dist_run`` calls shared
by the tests (module fixture): take on 2 ranks, take and restore on 4, then
restore on 2 and on 3. The one-process take and restores, and every
``read_object``, run in the test process with no process group.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
import torch
import torch.distributed as dist

import _sharded_workers as W
from ppe_snapshot import CorruptSnapshotError, Snapshot, StateDict, StateMismatchError
from ppe_snapshot.engine._format.manifest import ShardedTensorEntry
from _asserts import assert_same, manifest_doc


def _plain() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


@pytest.fixture(scope="module")
def runs(dist_run, tmp_path_factory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("sharded"))
    model, optim = _plain()
    for _ in range(2):
        model(torch.randn(4, 5)).square().sum().backward()
        optim.step()
        optim.zero_grad()
    Snapshot.take(os.path.join(root, "plain1"), {"model": model, "optim": optim})
    plain1 = W.full_state(model, optim)
    two = dist_run(W.save_on_two, 2, root)
    four = dist_run(W.four_ranks, 4, root, timeout=300)
    on2 = dist_run(W.restore_elsewhere, 2, root)
    on3 = dist_run(W.restore_elsewhere, 3, root)
    return {"root": root, "plain1": plain1, "two": two, "four": four, "on2": on2, "on3": on3}




def manifest(root: str, name: str) -> dict[str, Any]:
    return manifest_doc(os.path.join(root, name))


def spans(doc: dict[str, Any], path: str) -> list[tuple[list[int], list[int]]]:
    return [(s["offsets"], s["sizes"]) for s in doc["sharded"][path]["shards"]]


def test_each_shard_is_written_once_with_global_offsets(runs):
    doc = manifest(runs["root"], "dt4")
    assert spans(doc, "dt/s0") == [([0, 0], [3, 3]), ([3, 0], [3, 3]), ([6, 0], [3, 3]), ([9, 0], [1, 3])]
    assert spans(doc, "dt/s1") == [([0, 0], [3, 2]), ([0, 2], [3, 2]), ([0, 4], [3, 2]), ([0, 6], [3, 1])]
    assert spans(doc, "dt/empty") == [([0, 0], [1, 2]), ([1, 0], [1, 2]), ([2, 0], [1, 2])]  # rank 3 holds none
    assert spans(doc, "dt/rep") == [([0, 0], [4, 5])]  # 4 replicas, one write
    assert spans(doc, "dt/scalar") == [([], [])]
    assert spans(doc, "dt/mesh2") == [([0, 0], [5, 4]), ([5, 0], [5, 4])]  # (Shard(0), Replicate) on 2x2
    assert spans(doc, "dt/mesh2b") == [([0, 0], [6, 3]), ([0, 3], [6, 2])]  # (Replicate, Shard(1)) on 2x2
    assert spans(doc, "dt/st") == [([0, 0], [3, 4]), ([3, 0], [3, 4]), ([6, 0], [3, 4]), ([9, 0], [1, 4])]
    assert {k: (e["shape"], e["dtype"]) for k, e in doc["sharded"].items()} == {
        f"dt/{k}": (list(shape), "int64" if k == "ints" else "float32") for k, shape in W.SHAPES.items()}
    # every byte of data is one shard's, written once; the Shard(0) tensors by the rank that held them
    shard_bytes = sum(c["nbytes"] for e in doc["sharded"].values() for s in e["shards"] for c in s["chunks"])
    assert shard_bytes == sum(W.reference(k).numel() * W.reference(k).element_size() for k in W.SHAPES)
    assert [s["chunks"][0]["file"] for s in doc["sharded"]["dt/s0"]["shards"]] == [
        f"data/rank{r}.bin" for r in range(4)]
    # blocks held by several ranks are written by one of them, chosen per tensor and block: spread out
    writers = [s["chunks"][0]["file"] for k in ("rep", "scalar", "mesh2", "mesh2b")
               for s in doc["sharded"][f"dt/{k}"]["shards"]]
    assert sorted(set(writers)) == [f"data/rank{r}.bin" for r in range(4)]
    chunky = doc["sharded"]["dt/chunky"]["shards"][0]["chunks"]
    assert [c["nbytes"] for c in chunky] == [64, 20]  # CHUNK_BYTES was 64 at take time
    # nothing is per rank: a world of any size sees the whole state
    assert doc["ranks"] == [{}, {}, {}, {}] and doc["world_size"] == 4
    snapshot = Snapshot(os.path.join(runs["root"], "dt4"))
    snapshot.verify()
    entries = snapshot.get_manifest()
    assert isinstance(entries["3/dt/s0"], ShardedTensorEntry) and entries["3/dt/s0"] == entries["0/dt/s0"]


def test_fsdp_snapshot_writes_plain_optimizer_values_once(runs):
    doc = manifest(runs["root"], "fsdp4")
    assert doc["ranks"] == [{}, {}, {}, {}]
    assert spans(doc, "model/2.weight") == [([0, 0], [1, 7]), ([1, 0], [1, 7]), ([2, 0], [1, 7])]
    assert spans(doc, "optim/state/0/exp_avg") == [([0, 0], [2, 5]), ([2, 0], [2, 5]), ([4, 0], [2, 5]),
                                                   ([6, 0], [1, 5])]
    assert doc["replicated"]["optim/state/0/step"]["type"] == "tensor"
    assert "optim/param_groups" in doc["replicated"] and "model" in doc["replicated"]


def test_dtensor_restore_into_other_placements_on_same_world(runs):
    for rank, result in enumerate(runs["four"]):
        assert_same(result["dt4_saved"], {k: W.reference(k) for k in W.SHAPES}, f"rank {rank} saved")
        assert_same(result["dt4_on4"], {k: W.reference(k) for k in W.SHAPES}, f"rank {rank}")
        assert torch.equal(result["dcp2_on4"], W.reference("chunky"))  # written by dcp.save on 2 ranks
    rows = [offsets for result in runs["four"] for offsets, _ in result["st_from_mesh2"]]
    assert rows == [[0, 0], [3, 0], [6, 0], [9, 0]]
    for result in runs["four"]:
        for (start, _), tensor in result["st_from_mesh2"]:
            assert torch.equal(tensor, W.reference("mesh2")[start:start + tensor.shape[0]])


@pytest.mark.parametrize("world", ["on2", "on3"])
def test_restore_on_2_and_3_ranks(runs, world):
    saved = runs["four"][0]["fsdp4_saved"]
    for rank, result in enumerate(runs[world]):
        assert_same(result["dt"], {k: W.reference(k) for k in W.SHAPES}, f"rank {rank} dtensors")
        assert_same(result["fsdp"]["direct"], saved, f"rank {rank} direct")
        assert_same(result["fsdp"]["wrapped"], saved, f"rank {rank} get_state_dict")
        assert_same(result["plain1"], runs["plain1"], f"rank {rank} from one plain process")


def test_restore_fsdp_from_two_ranks_on_four(runs):
    saved = runs["two"][0]
    assert_same(runs["two"][1], saved)  # both ranks gathered the same state
    assert saved["optim"]["state"][0]["step"] == torch.tensor(2.0)
    for rank, result in enumerate(runs["four"]):
        assert_same(result["fsdp2_on4"]["direct"], saved, f"rank {rank} direct")
        assert_same(result["fsdp2_on4"]["wrapped"], saved, f"rank {rank} get_state_dict")


def test_restore_fsdp_in_one_plain_process(runs):
    assert not dist.is_initialized()
    saved = runs["four"][0]["fsdp4_saved"]
    model, optim = _plain()
    Snapshot(os.path.join(runs["root"], "fsdp4")).restore({"model": model, "optim": optim})
    assert_same(W.full_state(model, optim), saved)
    model, optim = _plain()
    Snapshot(os.path.join(runs["root"], "fsdp4w")).restore({"app": W.ModelAndOptim(model, optim)})
    assert_same(W.full_state(model, optim), saved)
    model(torch.ones(2, 5)).sum().backward()
    optim.step()  # the restored state trains on
    assert optim.state_dict()["state"][0]["step"] == torch.tensor(3.0)


def test_read_object_returns_the_full_tensor_without_a_group(runs):
    assert not dist.is_initialized()
    snapshot = Snapshot(os.path.join(runs["root"], "dt4"))
    for key in W.SHAPES:
        expected = W.reference(key)
        assert_same(snapshot.read_object(f"0/dt/{key}"), expected, key)
        out = torch.zeros_like(expected)
        assert snapshot.read_object(f"3/dt/{key}", obj_out=out) is out
        assert torch.equal(out, expected), key
        if expected.dim() == 2:  # non-contiguous: shards stream through a buffer of one row
            strided = torch.zeros(expected.shape[::-1], dtype=expected.dtype).t()
            assert snapshot.read_object(f"dt/{key}", obj_out=strided, memory_budget_bytes=1) is strided
            assert torch.equal(strided, expected), key
    whole = snapshot.read_object("0/dt")
    assert_same(whole, {k: W.reference(k) for k in W.SHAPES})
    assert torch.equal(Snapshot(os.path.join(runs["root"], "dcp2")).read_object("w"), W.reference("chunky"))


def test_damaged_shard_is_detected(runs, tmp_path):
    copy = str(tmp_path / "dt4")
    shutil.copytree(os.path.join(runs["root"], "dt4"), copy)
    chunk = manifest(copy, "")["sharded"]["dt/chunky"]["shards"][1]["chunks"][0]
    with open(os.path.join(copy, chunk["file"]), "r+b") as f:
        f.seek(chunk["offset"] + 5)
        byte = f.read(1)
        f.seek(chunk["offset"] + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    snapshot = Snapshot(copy)
    with pytest.raises(CorruptSnapshotError, match="checksum mismatch"):
        snapshot.read_object("0/dt/chunky")  # shards read whole into the target's rows
    with pytest.raises(CorruptSnapshotError, match="checksum mismatch"):
        snapshot.read_object("0/dt/chunky", obj_out=torch.zeros(7, 10).t(), memory_budget_bytes=1)  # streamed
    assert torch.equal(snapshot.read_object("0/dt/s0"), W.reference("s0"))  # other data is intact


def test_shape_and_dtype_mismatch_name_the_key_and_both(runs):
    snapshot = Snapshot(os.path.join(runs["root"], "dt4"))
    with pytest.raises(StateMismatchError) as e:
        snapshot.restore({"dt": StateDict(s0=torch.zeros(3, 10))})
    assert str(e.value) == ("dt/s0: the snapshot holds a sharded tensor of global shape [10, 3] and dtype float32, "
                            "but the restore target has global shape [3, 10] and dtype float32")
    with pytest.raises(StateMismatchError) as e:  # a meta tensor has no memory to load into: not left empty
        snapshot.restore({"dt": StateDict(s0=torch.zeros(10, 3, device="meta"))})
    assert str(e.value) == ("dt/s0: the snapshot holds a sharded tensor of global shape [10, 3] and dtype float32, "
                            "but the restore target is a meta tensor, which holds no data: a restore loads into the "
                            "target's memory in place; materialize it first (e.g. with Module.to_empty(device=...))")
    for rank, result in enumerate(runs["four"]):
        errors = result["errors"]
        assert errors["shape"] == (
            "StateMismatchError: dt/s0: the snapshot holds a sharded tensor of global shape [10, 3] and dtype "
            "float32, but the restore target has global shape [10, 4] and dtype float32"), rank
        assert errors["dtype"] == (
            "StateMismatchError: dt/s0: the snapshot holds a sharded tensor of global shape [10, 3] and dtype "
            "float32, but the restore target has global shape [10, 3] and dtype float64"), rank


def test_per_rank_state_missing_on_a_larger_world(runs):
    messages = [result["errors"]["per_rank"] for result in runs["four"]]
    assert messages[:2] == ["no error", "no error"]
    for rank in (2, 3):
        assert messages[rank] == (
            f"StateMismatchError: app_state['local'] was saved per rank by ranks [0, 1] of a world of 2; this "
            f"process is rank {rank} and has no state there. Read another rank's state with "
            "read_object('<rank>/local').")
    snapshot = Snapshot(os.path.join(runs["root"], "perrank2"))
    assert torch.equal(snapshot.read_object("1/local/t"), torch.full((2,), 1))


def test_unsupported_or_incomplete_sharded_state_fails_the_take(runs):
    for result in runs["four"]:
        assert result["errors"]["partial"].startswith(
            "UnsupportedValueError: p/w: DTensor placement Partial(sum) is not supported (only Shard(dim) and "
            "Replicate); redistribute it first")
        assert result["errors"]["local"] == (
            "SnapshotError: p/w: the shards written cover 2 of the 8 elements of the sharded tensor; take the "
            "snapshot on every rank of its device mesh (pg=None or a group holding all of them)")


def test_manifest_without_sharded_section_still_reads(tmp_path):
    path = str(tmp_path / "old")
    Snapshot.take(path, {"s": StateDict(x=torch.arange(3))})
    doc = manifest(path, "")
    assert doc.pop("sharded") == {}
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(doc, f)
    assert torch.equal(Snapshot(path).read_object("0/s/x"), torch.arange(3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_read_sharded_into_cuda_targets(runs):
    snapshot = Snapshot(os.path.join(runs["root"], "dt4"))
    for key in ("s0", "s1", "chunky"):
        expected = W.reference(key)
        out = torch.zeros_like(expected, device="cuda")
        assert snapshot.read_object(f"0/dt/{key}", obj_out=out, memory_budget_bytes=64) is out
        assert torch.equal(out.cpu(), expected)
        strided = torch.zeros(expected.shape[::-1], device="cuda").t()
        snapshot.read_object(f"0/dt/{key}", obj_out=strided, memory_budget_bytes=1)
        assert torch.equal(strided.cpu(), expected)
