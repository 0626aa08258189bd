"""The engine across real processes: gloo process groups from the ``dist_run`` pool.

Covers per-rank and replicated state (glob and inferred DDP), restore on a
different world size, async takes, ``pg=LOCAL``, and ranks that fail.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import _engine_workers as w
from ppe_snapshot import Snapshot, SnapshotNotFoundError, StateDict, StateMismatchError

TENSOR_BYTES = w.MODEL_NUMEL * 4


def _data_files(path: str) -> dict[str, int]:
    """Size of each data file on disk, by its name in the manifest."""
    data = os.path.join(path, "data")
    return {f"data/{name}": os.path.getsize(os.path.join(data, name)) for name in os.listdir(data)}


def _replicated_paths(path: str) -> set[str]:
    """Logical paths of the snapshot's replicated entries (every rank sees them)."""
    manifest = Snapshot(path).get_manifest()
    return {key.split("/", 1)[1] for key, entry in manifest.items() if entry.replicated}


def _assert_state_equal(restored: dict, expected: dict) -> None:
    assert restored.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert restored[key].dtype == value.dtype and torch.equal(restored[key], value), key
        else:
            assert restored[key] == value, key


def _assert_written_once_and_spread(path: str, world_size: int, replicated_paths: list[str],
                                    tensor_bytes: int) -> None:
    """Each replicated tensor is one entry that every rank sees, its bytes are in the data
    files once in total (not once per rank), and every rank wrote a similar share."""
    manifest = Snapshot(path).get_manifest()
    assert {key.split("/", 1)[0] for key in manifest} == {str(r) for r in range(world_size)}
    files = _data_files(path)
    assert set(files) == {f"data/rank{r}.bin" for r in range(world_size)}
    used = dict.fromkeys(files, 0)
    for p in replicated_paths:
        entry = manifest[f"0/{p}"]
        assert entry.replicated and all(manifest[f"{r}/{p}"] == entry for r in range(world_size))
        for chunk in entry.chunks:
            used[chunk.file] += chunk.nbytes
    assert used == files  # the data files hold the replicated tensors once, and nothing else
    sizes = sorted(files.values())
    assert sizes[0] > 0 and sizes[-1] <= 1.5 * sizes[0] + tensor_bytes


@pytest.mark.parametrize("world_size", [2, 3])
def test_per_rank_state_round_trips_on_each_rank(dist_run, tmp_path, world_size):
    path = str(tmp_path / "snap")
    results = dist_run(w.take_and_restore_per_rank, world_size, path)
    for rank, result in enumerate(results):
        _assert_state_equal(result["restored"], w.per_rank_values(rank))
    keys = results[0]["keys"]
    assert all(r["keys"] == keys for r in results)
    assert keys == sorted(f"{rank}/state{leaf}" for rank in range(world_size)
                          for leaf in ("", "/weights", "/ids", "/step", "/name"))
    manifest = Snapshot(path).get_manifest()
    assert not any(entry.replicated for entry in manifest.values())
    shapes = [manifest[f"{r}/state/weights"].shape for r in range(world_size)]
    assert shapes == [[5 + r, 33] for r in range(world_size)]
    assert sorted(_data_files(path)) == [f"data/rank{r}.bin" for r in range(world_size)]
    assert not os.path.exists(os.path.join(path, ".parts")) or os.listdir(os.path.join(path, ".parts")) == []


def test_per_rank_state_on_a_larger_world_names_the_saved_ranks(dist_run, tmp_path):
    path = str(tmp_path / "snap")
    dist_run(w.take_and_restore_per_rank, 2, path)
    results = dist_run(w.restore_per_rank, 3, path)
    for rank in (0, 1):
        assert results[rank]["error"] is None
        _assert_state_equal(results[rank]["restored"], w.per_rank_values(rank))
    name, message = results[2]["error"]
    assert name == "StateMismatchError"
    assert "saved per rank by ranks [0, 1] of a world of 2" in message
    assert "this process is rank 2" in message and "read_object('<rank>/state')" in message


@pytest.mark.parametrize("world_size", [2, 3])
def test_replicated_glob_is_written_once_spread_over_ranks(dist_run, tmp_path, world_size):
    path = str(tmp_path / "snap")
    dist_run(w.take_replicated, world_size, path, "model/**")
    layers = [f"model/layer{i}" for i in range(w.MODEL_TENSORS)]
    _assert_written_once_and_spread(path, world_size, layers, TENSOR_BYTES)
    assert _replicated_paths(path) == {"model", *layers}
    target = w.model_target()
    Snapshot(path).restore({"model": target})  # one process, no process group
    _assert_state_equal(dict(target), w.model_values())


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_module_is_inferred_replicated(dist_run, tmp_path, world_size):
    path = str(tmp_path / "snap")
    results = dist_run(w.take_and_restore_ddp, world_size, path)
    expected = w.net().state_dict()
    for result in results:
        _assert_state_equal(result, dict(expected))
    params = [f"model/module.{name}" for name in expected]
    _assert_written_once_and_spread(path, world_size, params, max(t.nbytes for t in expected.values()))
    plain = w.Wrapped(w.net())
    with torch.no_grad():
        for p in plain.parameters():
            p.zero_()
    Snapshot(path).restore({"model": plain})
    _assert_state_equal(dict(plain.module.state_dict()), dict(expected))


@pytest.mark.parametrize("version", [2, 1])
def test_replicated_state_restores_on_other_world_sizes(dist_run, tmp_path, version):
    path = str(tmp_path / "snap")
    dist_run(w.take_mixed, 3, path, version)
    with open(os.path.join(path, "manifest.json")) as f:
        assert json.load(f)["version"] == version
    assert _replicated_paths(path) == {"model"} | {f"model/layer{i}" for i in range(w.MODEL_TENSORS)}
    keys = Snapshot(path).get_manifest()
    assert "2/only2/x" in keys and "0/only2" not in keys and "1/only2" not in keys

    results = dist_run(w.restore_mixed, 2, path)
    for rank, result in enumerate(results):
        _assert_state_equal(result["model"], w.model_values())
        _assert_state_equal(result["state"], w.per_rank_values(rank))
        name, message = result["only2_error"]
        assert name == "StateMismatchError"
        assert "saved per rank by ranks [2] of a world of 3" in message and "read_object('<rank>/only2')" in message

    snapshot = Snapshot(path)  # one process, no process group: rank 0's view
    target = w.model_target()
    snapshot.restore({"model": target})
    _assert_state_equal(dict(target), w.model_values())
    with pytest.raises(StateMismatchError, match=r"ranks \[2\] of a world of 3.*read_object\('<rank>/only2'\)"):
        snapshot.restore({"only2": StateDict(x=torch.zeros(3, 4))})
    assert torch.equal(snapshot.read_object("2/only2")["x"], torch.arange(12.0).reshape(3, 4))
    other = snapshot.read_object("1/state")
    _assert_state_equal(other, w.per_rank_values(1))
    out = torch.zeros(6, 33)
    assert snapshot.read_object("1/state/weights", obj_out=out) is out
    assert torch.equal(out, w.per_rank_values(1)["weights"])


def test_async_take_snapshots_the_state_at_the_call(dist_run, tmp_path):
    path = str(tmp_path / "snap")
    results = dist_run(w.async_take_then_mutate, 2, path)
    for rank, result in enumerate(results):
        _assert_state_equal(result["model"], w.model_values())
        _assert_state_equal(result["state"], w.per_rank_values(rank))
    assert _replicated_paths(path) == {"model"} | {f"model/layer{i}" for i in range(w.MODEL_TENSORS)}
    Snapshot(path).verify()


def test_local_group_snapshot_of_one_rank(dist_run, tmp_path):
    path = str(tmp_path / "snap")
    results = dist_run(w.local_take_on_rank1, 2, path)
    for result in results:
        _assert_state_equal(result, w.per_rank_values(1))
    assert {key.split("/", 1)[0] for key in Snapshot(path).get_manifest()} == {"0"}  # a world of one
    assert list(_data_files(path)) == ["data/rank0.bin"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_failing_before_writing_fails_every_rank(dist_run, tmp_path, world_size):
    path = str(tmp_path / "snap")
    errors = dist_run(w.take_reporting_error, world_size, path, 1, timeout=60)
    name, message = errors[1]
    assert name == "UnsupportedValueError" and "state/handle" in message
    for rank in set(range(world_size)) - {1}:
        name, message = errors[rank]
        assert name == "SnapshotAbortedError"  # a RuntimeError, as torchsnapshot's failed takes are
        assert "not taken" in message and "rank 1: UnsupportedValueError('state/handle" in message
    assert not os.path.exists(os.path.join(path, "manifest.json"))
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(path).restore({"state": w.per_rank_target(0)})


def test_rank_failing_while_writing_fails_every_rank(dist_run, tmp_path):
    path = tmp_path / "snap"
    (path / "data" / "rank1.bin").mkdir(parents=True)  # rank 1 cannot create its data file
    errors = dist_run(w.take_reporting_error, 2, str(path), None, timeout=60)
    assert errors[1][0] == "IsADirectoryError" and "rank1.bin" in errors[1][1]
    name, message = errors[0]
    assert name == "SnapshotAbortedError"
    assert "was not committed" in message and "rank 1: IsADirectoryError" in message
    assert not (path / "manifest.json").exists()
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(str(path)).restore({"state": w.per_rank_target(0)})
    # the failed take left no manifest behind: the same path can be taken again
    (path / "data" / "rank1.bin").rmdir()
    results = dist_run(w.take_and_restore_per_rank, 2, str(path))
    _assert_state_equal(results[1]["restored"], w.per_rank_values(1))


# -- replicated globs that differ between ranks ----------------------------------------

@pytest.mark.parametrize("globs", [[["model/*", "extra/*"], ["model/*"]], [["model/*"], []]],
                         ids=["one-glob-on-rank0-only", "no-glob-on-rank1"])
def test_only_globs_given_by_every_rank_count(dist_run, tmp_path, globs):
    path = str(tmp_path / "snap")
    results = dist_run(w.take_with_rank_globs, 2, path, globs)
    for rank, result in enumerate(results):
        _assert_state_equal(result["model"], w.model_values())
        _assert_state_equal(result["extra"], w.per_rank_values(rank))
    common = set(globs[0]) & set(globs[1])
    expected = {"model", *(f"model/layer{i}" for i in range(w.MODEL_TENSORS))} if common else set()
    assert _replicated_paths(path) == expected
    Snapshot(path).verify()


def test_replicated_glob_matching_different_entries_is_never_committed(dist_run, tmp_path):
    path = tmp_path / "snap"
    errors = dist_run(w.take_uneven_replicated, 2, str(path), timeout=60)
    name, message = errors[0]
    assert name == "SnapshotError" and "would not restore" in message and "'x/b'" in message
    name, message = errors[1]
    assert name == "SnapshotAbortedError" and "was not committed" in message and "would not restore" in message
    assert not (path / "manifest.json").exists()
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(str(path)).get_manifest()


# -- async takes failing on one rank ------------------------------------------------------

_OWN_ERRORS = {"open": ("IsADirectoryError", "rank{bad}.bin"), "stage": ("MemoryError", "cannot stage"),
               "write": ("OSError", "No space left on device (injected)"),
               "late": ("OSError", "No space left on device (injected)")}


@pytest.mark.parametrize("world", [3, 4])  # 4 ranks on this 2-core machine: the rounds run under load
def test_async_take_failing_on_one_rank_fails_every_wait_every_time(dist_run, tmp_path, world):
    rounds = world * len(w.FAILURE_MOMENTS)  # every rank fails once at every moment
    errors = dist_run(w.async_take_failing_rounds, world, str(tmp_path), rounds, timeout=600)
    for i in range(rounds):
        bad, moment = w.failure_of_round(i, world)
        name, fragment = _OWN_ERRORS[moment]
        own = errors[bad][i]
        assert own is not None and own[0] == name and fragment.format(bad=bad) in own[1], (i, own)
        for rank in set(range(world)) - {bad}:
            other = errors[rank][i]
            assert other is not None and other[0] == "SnapshotAbortedError", (i, rank, other)
            assert "was not committed" in other[1] and f"rank {bad}: {name}" in other[1], (i, rank, other)
        assert not (tmp_path / f"round{i}" / "manifest.json").exists(), i
