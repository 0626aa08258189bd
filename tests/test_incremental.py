"""Incremental snapshots: only changed blocks are written, and every snapshot restores on its own.

Real files (and a real S3 server, real gloo ranks; ``kill -9`` of an incremental run: tests/test_crash.py): the
bytes each take writes, restores compared bit for bit, references that go missing or are crafted, retention that
retires a snapshot whose data files others read and removes them once none does.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import _incremental_workers as workers
from _asserts import written_as
from _crafted import read_index, write_index
from ppe_snapshot import CorruptSnapshotError, MissingBaseError, Snapshot, SnapshotExistsError, StateDict, retention
from ppe_snapshot.cli import main as cli_main
from ppe_snapshot.engine import RETIRED_NAME
from ppe_snapshot.writing import ProcessWriter, SimpleWriter, ThreadQueueWriter, ThreadWriter

BLOCK = 4096


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"frozen": torch.randn(256, 1024, generator=g),          # 1 MiB, never changes
            "adapter": torch.randn(64, 16, generator=g),            # 4 KiB, changes every take
            "table": torch.randn(1024, 256, generator=g),           # 1 MiB, rows of 1 KiB
            "array": np.arange(5000, dtype=np.int64), "step": 0}


def restored(path: Path | str, like: dict) -> dict:
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else
              np.zeros_like(v) if isinstance(v, np.ndarray) else -1 for k, v in like.items()}
    holder = StateDict(target)
    Snapshot(str(path)).restore({"m": holder})
    return dict(holder)


def assert_same(got: dict, expected: dict) -> None:
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        elif isinstance(value, np.ndarray):
            assert np.array_equal(got[key], value), key
        else:
            assert got[key] == value, key


def data_size(path: Path, rank: int = 0) -> int:
    return (path / "data" / f"rank{rank}.bin").stat().st_size


def take(path: Path, values: dict, base: Path | None = None) -> None:
    Snapshot.take(str(path), {"m": StateDict(values)}, base=None if base is None else str(base), block_bytes=BLOCK)


def test_only_changed_blocks_are_written_and_each_snapshot_restores(tmp_path):
    values = state()
    take(tmp_path / "s1", values)
    full = data_size(tmp_path / "s1")
    history = [{k: v.clone() if isinstance(v, torch.Tensor) else np.copy(v) if isinstance(v, np.ndarray) else v
                for k, v in values.items()}]
    for i in range(2, 6):
        values["adapter"] += 1
        values["table"][[i, 500 + i]] = float(i)  # two rows: two blocks of 4 KiB
        values["step"] = i
        take(tmp_path / f"s{i}", values, base=tmp_path / f"s{i - 1}")
        history.append({k: v.clone() if isinstance(v, torch.Tensor) else np.copy(v) if isinstance(v, np.ndarray)
                        else v for k, v in values.items()})
        changed = 3 * BLOCK  # the adapter's block and two of the table's, after the plain s1 too (its blocks)
        assert changed <= data_size(tmp_path / f"s{i}") <= changed + 4 * 64, i
        doc = json.loads((tmp_path / f"s{i}" / "manifest.json").read_text())
        assert doc["version"] == 3
        # references never chain: the frozen tensor is read from s1's file, whichever base was given
        assert "s1" in doc["references"] and len(doc["references"]) <= i - 1
    assert full > 2 << 20
    for i, expected in enumerate(history, start=1):
        Snapshot(str(tmp_path / f"s{i}")).verify()
        assert_same(restored(tmp_path / f"s{i}", expected), expected)
    assert torch.equal(Snapshot(str(tmp_path / "s5")).read_object("0/m/frozen"), values["frozen"])
    assert Snapshot(str(tmp_path / "s5")).references == tuple(sorted(doc["references"]))


@pytest.mark.parametrize("how", ["in_place", "data", "numpy_view", "one_element", "dtype"])
def test_every_kind_of_change_is_written(tmp_path, how):
    values = state()
    take(tmp_path / "s1", values)
    frozen = values["frozen"]
    if how == "in_place":
        frozen.mul_(2)
    elif how == "data":
        frozen.data[100:101] = 3.0
    elif how == "numpy_view":
        frozen.numpy()[7, 7] = -1.0
    elif how == "one_element":  # one bit of one element
        frozen.view(torch.int32)[200, 3] ^= 1
    else:  # the same bytes as another dtype: restored as the new dtype, whatever is referenced
        values["frozen"] = frozen.view(torch.int32)
    take(tmp_path / "s2", values, base=tmp_path / "s1")
    assert_same(restored(tmp_path / "s2", values), values)
    Snapshot(str(tmp_path / "s2")).verify()
    if how != "dtype":
        assert data_size(tmp_path / "s2") >= BLOCK


def test_async_take_and_a_full_base_of_large_chunks(tmp_path):
    values = state()
    Snapshot.take(str(tmp_path / "full"), {"m": StateDict(values)})  # not incremental: one chunk per tensor
    values["table"][3] = 5.0
    expected = dict(values, table=values["table"].clone())
    pending = Snapshot.async_take(str(tmp_path / "inc"), {"m": StateDict(values)}, base=str(tmp_path / "full"),
                                  block_bytes=BLOCK)
    values["table"][4] = 6.0  # after the staging copy: not in the snapshot
    pending.wait()
    assert_same(restored(tmp_path / "inc", expected), expected)
    # the changed 1 MiB chunk of the full base is rewritten cut in blocks: the next take writes one block
    written = data_size(tmp_path / "inc")
    assert (1 << 20) <= written < (1 << 20) + BLOCK
    take(tmp_path / "inc2", expected, base=tmp_path / "inc")
    assert data_size(tmp_path / "inc2") == 0


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])  # transposed: written through a host copy
def test_a_plain_take_is_a_base_of_blocks(tmp_path, layout):
    """Issue 32: a take without base= records its blocks, so the first incremental take after it writes about the
    changed block, not the changed tensor (4M floats, one bit flipped: 1 MiB, not 16 MiB)."""
    a = torch.randn(4 << 20) if layout == "contiguous" else torch.randn(1024, 4096).t()
    Snapshot.take(str(tmp_path / "s0"), {"m": StateDict(a=a)})
    assert data_size(tmp_path / "s0") == 16 << 20
    if layout == "contiguous":
        a.view(torch.int32)[3_000_000] ^= 1
    else:
        a[1234, 567] = -a[1234, 567]
    Snapshot.take(str(tmp_path / "s1"), {"m": StateDict(a=a)}, base=str(tmp_path / "s0"))
    assert data_size(tmp_path / "s1") == 1 << 20  # one block of the default PPE_SNAPSHOT_BLOCK_KB
    assert torch.equal(Snapshot(str(tmp_path / "s1")).read_object("0/m/a"), a)


@pytest.mark.parametrize("first,then,written", [(BLOCK, None, BLOCK), (BLOCK, 1 << 20, BLOCK),
                                                (None, BLOCK, 1 << 20)],
                         ids=["plain-take-blocks", "base-blocks-smaller", "base-blocks-larger"])
def test_block_bytes_of_a_plain_take_are_the_blocks_compared(tmp_path, first, then, written):
    """block_bytes= on a take without base= sets its blocks; a take whose base has other blocks compares in the
    base's and writes a changed one in its own: the next take writes its own blocks."""
    table = torch.randn(1024, 256)  # 1 MiB of 1 KiB rows
    Snapshot.take(str(tmp_path / "s0"), {"m": StateDict(table=table)}, block_bytes=first)
    table[700] += 1
    Snapshot.take(str(tmp_path / "s1"), {"m": StateDict(table=table)}, base=str(tmp_path / "s0"), block_bytes=then)
    assert data_size(tmp_path / "s1") == written
    table[701] += 1  # in the same 4 KiB block as row 700
    Snapshot.take(str(tmp_path / "s2"), {"m": StateDict(table=table)}, base=str(tmp_path / "s1"), block_bytes=then)
    assert data_size(tmp_path / "s2") == (then or 1 << 20) if first is None else BLOCK
    assert torch.equal(Snapshot(str(tmp_path / "s2")).read_object("0/m/table"), table)


@pytest.mark.parametrize("block_bytes", [100, 0, 128 << 20, 4096.0])
def test_a_bad_block_size_is_refused_with_or_without_a_base(tmp_path, block_bytes):
    with pytest.raises(ValueError, match=r"block_bytes \(PPE_SNAPSHOT_BLOCK_KB in KiB\) must be a multiple of 64"):
        Snapshot.take(str(tmp_path / "s0"), {"m": StateDict(a=torch.ones(4))}, block_bytes=block_bytes)
    assert not (tmp_path / "s0").exists()


def test_extension_first_incremental_save_after_the_plain_one_is_small(tmp_path, monkeypatch):
    """Issue 32: snapshot(incremental=True) with PPE_SNAPSHOT_BLOCK_KB=4 and one embedding row (1 KiB) changed
    per iteration: the second snapshot holds a block, not a copy of the 4 MiB table."""
    import pytorch_pfn_extras as ppe

    import ppe_snapshot
    from ppe_snapshot.settings import SETTINGS

    monkeypatch.setattr(SETTINGS, "block_bytes", 4096)  # what PPE_SNAPSHOT_BLOCK_KB=4 sets
    torch.manual_seed(0)
    model = torch.nn.Embedding(4096, 256)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ppe.training.ExtensionsManager(model, optimizer, 3, iters_per_epoch=1, out_dir=str(tmp_path))
    manager.extend(ppe_snapshot.snapshot(incremental=True, writer=SimpleWriter()), trigger=(1, "iteration"))
    while not manager.stop_trigger:
        with manager.run_iteration():
            with torch.no_grad():
                model.weight[17 * manager.iteration] += 1
    assert data_size(tmp_path / "snapshot_iter_1") > 4 << 20
    for name in ("snapshot_iter_2", "snapshot_iter_3"):
        assert data_size(tmp_path / name) < 64 << 10, name
        assert "snapshot_iter_1" in Snapshot(str(tmp_path / name)).references
    saved = Snapshot(str(tmp_path / "snapshot_iter_3")).read_object("0/state/models/main/weight")
    assert torch.equal(saved, model.weight.detach())


def test_a_small_unchanged_entry_does_not_keep_a_large_file(tmp_path):
    """Issue 32: what a take keeps of a base file it would reference for less than half the file's bytes is
    copied into its own file, so the base's file is not kept alive by it."""
    values = {"weights": torch.randn(64, 1024), "rng": np.arange(300, dtype=np.int64)}  # 256 KiB, 2.4 KB
    take(tmp_path / "s0", values)
    values["weights"] += 1  # every weight changes, the small entry does not
    take(tmp_path / "s1", values, base=tmp_path / "s0")
    assert Snapshot(str(tmp_path / "s1")).references == ()
    assert data_size(tmp_path / "s1") == data_size(tmp_path / "s0")
    shutil.rmtree(tmp_path / "s0")
    assert_same(restored(tmp_path / "s1", values), values)
    values["weights"][0] += 1  # one block changes: the rest of s1's file is referenced
    take(tmp_path / "s2", values, base=tmp_path / "s1")
    assert Snapshot(str(tmp_path / "s2")).references == ("s1",) and data_size(tmp_path / "s2") == BLOCK


def _fine_tune(out: Path, incremental: bool, iterations: int) -> int:
    """A full fine-tune through the extension (every weight changes at every step, the RNG states do not),
    a save per iteration, n_retains=3: the bytes the output directory holds at its fullest."""
    import pytorch_pfn_extras as ppe

    import ppe_snapshot

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
    optimizer = torch.optim.Adam(model.parameters())
    manager = ppe.training.ExtensionsManager(model, optimizer, iterations, iters_per_epoch=1, out_dir=str(out))
    manager.extend(ppe_snapshot.snapshot(writer=SimpleWriter(), n_retains=3, incremental=incremental),
                   trigger=(1, "iteration"))
    inputs, most = torch.randn(8, 256), 0
    while not manager.stop_trigger:
        with manager.run_iteration():
            loss = model(inputs).square().sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        most = max(most, sum(f.stat().st_size for f in out.rglob("*") if f.is_file()))
    return most


def test_a_full_fine_tune_uses_the_disk_of_full_saves(tmp_path):
    """Issue 32: incremental=True on a run where every weight changes keeps no old snapshot's file alive: the
    directory holds the 3 kept snapshots only, about the bytes of the same run without it."""
    incremental = _fine_tune(tmp_path / "incremental", True, 8)
    full = _fine_tune(tmp_path / "full", False, 8)
    assert sorted(os.listdir(tmp_path / "incremental")) == ["snapshot_iter_6", "snapshot_iter_7", "snapshot_iter_8"]
    for name in ("snapshot_iter_6", "snapshot_iter_7", "snapshot_iter_8"):
        assert Snapshot(str(tmp_path / "incremental" / name)).references == ()
    assert incremental <= 1.05 * full


def test_a_snapshot_without_its_base_names_it(tmp_path):
    values = state()
    take(tmp_path / "run" / "s1", values)
    values["adapter"] += 1
    take(tmp_path / "run" / "s2", values, base=tmp_path / "run" / "s1")
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.move(str(tmp_path / "run" / "s2"), str(moved / "s2"))
    for read in (lambda s: s.restore({"m": StateDict(state())}), lambda s: s.read_object("0/m/frozen"),
                 lambda s: s.verify(deep=False), lambda s: s.verify()):
        with pytest.raises(MissingBaseError, match=r"snapshot 's1'.*missing") as info:
            read(Snapshot(str(moved / "s2")))
        assert isinstance(info.value, CorruptSnapshotError)
    # a copy of the whole run directory keeps every snapshot valid
    shutil.move(str(moved / "s2"), str(tmp_path / "run" / "s2"))
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    shutil.rmtree(tmp_path / "run")
    assert_same(restored(tmp_path / "copy" / "s2", values), values)


def test_convert_writes_a_self_contained_copy(tmp_path, capsys):
    values = state()
    take(tmp_path / "s1", values)
    values["adapter"] += 1
    take(tmp_path / "s2", values, base=tmp_path / "s1")
    assert cli_main(["convert", "--to", "snapshot", str(tmp_path / "s2"), str(tmp_path / "copy")]) == 0
    shutil.rmtree(tmp_path / "s1")
    assert Snapshot(str(tmp_path / "copy")).references == ()
    Snapshot(str(tmp_path / "copy")).verify()
    assert_same(restored(tmp_path / "copy", values), values)
    assert cli_main(["verify", str(tmp_path / "s2")]) != 0
    assert "s1" in capsys.readouterr().out


def _referencing_pair(root: Path) -> dict:
    """s1 (plain) holds 1 MiB that never changes and 512 KiB that s2 (incremental) rewrites whole: s2 reads
    1 MiB of s1's 1.5 MiB data file."""
    values = {"frozen": torch.randn(256, 1024), "changing": torch.randn(128, 1024)}
    take(root / "s1", values)
    values["changing"] += 1
    take(root / "s2", values, base=root / "s1")
    assert data_size(root / "s1") == 3 << 19 and data_size(root / "s2") == 1 << 19
    return values


def test_ls_and_inspect_show_the_bytes_read_of_referenced_files(tmp_path, capsys):
    """Issue 32: the referenced bytes are those of the chunks a snapshot reads, not the referenced files'."""
    _referencing_pair(tmp_path)
    capsys.readouterr()
    assert cli_main(["inspect", "--json", str(tmp_path / "s2")]) == 0
    assert json.loads(capsys.readouterr().out)["referenced_bytes"] == 1 << 20
    assert cli_main(["inspect", str(tmp_path / "s2")]) == 0
    assert "incremental: reads 1.0 MiB of data files of s1" in capsys.readouterr().out
    assert cli_main(["ls", "--json", str(tmp_path)]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["s2"]["referenced_bytes"] == 1 << 20 and rows["s1"]["referenced_bytes"] == 0


def test_a_self_contained_copy_holds_only_the_referenced_blocks(tmp_path, capsys):
    """Issue 32: convert --to snapshot copies the blocks the snapshot reads of other snapshots' files, not the
    whole files."""
    values = _referencing_pair(tmp_path)
    assert cli_main(["convert", "--to", "snapshot", str(tmp_path / "s2"), str(tmp_path / "copy")]) == 0
    shutil.rmtree(tmp_path / "s1")
    copied = sum(f.stat().st_size for f in (tmp_path / "copy").rglob("*.bin"))
    assert copied == (1 << 19) + (1 << 20)  # its own file, and the 1 MiB it read of s1's
    assert Snapshot(str(tmp_path / "copy")).references == ()
    Snapshot(str(tmp_path / "copy")).verify()
    assert_same(restored(tmp_path / "copy", values), values)


def test_a_self_contained_copy_of_a_snapshot_that_wrote_nothing(tmp_path):
    values = state()
    take(tmp_path / "s1", values)
    take(tmp_path / "s2", values, base=tmp_path / "s1")  # nothing changed: its own data file is empty
    assert data_size(tmp_path / "s2") == 0
    assert cli_main(["convert", "--to", "snapshot", str(tmp_path / "s2"), str(tmp_path / "copy")]) == 0
    shutil.rmtree(tmp_path / "s1")
    assert_same(restored(tmp_path / "copy", values), values)


def test_base_must_be_beside_the_new_snapshot(tmp_path):
    take(tmp_path / "a" / "s1", state())
    with pytest.raises(ValueError, match="same directory"):
        take(tmp_path / "b" / "s2", state(), base=tmp_path / "a" / "s1")
    with pytest.raises(ValueError, match="block_bytes"):
        Snapshot.take(str(tmp_path / "a" / "s3"), {"m": StateDict(state())}, base=str(tmp_path / "a" / "s1"),
                      block_bytes=100)
    assert not (tmp_path / "b" / "s2").exists() and not (tmp_path / "a" / "s3").exists()


def _incremental_pair(tmp_path: Path) -> Path:
    values = state()
    take(tmp_path / "s1", values)
    values["adapter"] += 1
    take(tmp_path / "s2", values, base=tmp_path / "s1")
    return tmp_path / "s2"


@pytest.mark.parametrize("name", ["../../outside/data/rank0.bin", "../s1/../../x/data/rank0.bin", "../s1",
                                  "../other/data/rank0.bin", "../s1//data/rank0.bin", "/abs/data/rank0.bin"])
def test_crafted_reference_is_refused(tmp_path, name):
    path = _incremental_pair(tmp_path)
    (tmp_path / "other" / "data").mkdir(parents=True)
    shutil.copy(tmp_path / "s1" / "data" / "rank0.bin", tmp_path / "other" / "data" / "rank0.bin")
    header, cols = read_index(path / "index" / "rank0.idx")
    position = next(i for i, (file, _) in enumerate(header["files"]) if file.startswith("../s1/"))
    header["files"][position][0] = name
    write_index(path / "index" / "rank0.idx", header, cols)
    for read in (lambda s: s.restore({"m": StateDict(state())}), lambda s: s.verify()):
        with pytest.raises(CorruptSnapshotError, match="data file name"):
            read(Snapshot(str(path)))


@pytest.mark.parametrize("references", [[], ["s1", "s1"], ["../s1"], ["a/b"], [".."], "s1", [1]])
def test_crafted_references_in_the_manifest_are_refused(tmp_path, references):
    path = _incremental_pair(tmp_path)
    doc = json.loads((path / "manifest.json").read_text())
    doc["references"] = references
    (path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CorruptSnapshotError):
        Snapshot(str(path)).restore({"m": StateDict(state())})


@pytest.mark.parametrize("references", [["s1"], [{"not": "a name"}]])
def test_references_in_a_version_2_manifest_count_for_nothing(tmp_path, references):
    """An incremental snapshot relabelled version 2, its references left: version 2 is self-contained, so its
    index files naming another snapshot's data file are refused (references used to be honoured, unchecked)."""
    path = _incremental_pair(tmp_path)
    doc = json.loads((path / "manifest.json").read_text())
    doc["version"], doc["references"] = 2, references
    (path / "manifest.json").write_text(json.dumps(doc))
    for read in (lambda s: s.restore({"m": StateDict(state())}), lambda s: s.verify()):
        with pytest.raises(CorruptSnapshotError, match="data file name '../s1/data/rank0.bin' is not a normalised"):
            read(Snapshot(str(path)))
    assert Snapshot(str(path)).references == ()


def test_retention_retires_referenced_snapshots_and_removes_them_later(tmp_path):
    run = tmp_path / "run"
    values = state()
    take(run / "snap_1", values)
    for i in range(2, 5):
        values["adapter"] = torch.full_like(values["adapter"], float(i))
        values["step"] = i
        Snapshot.take(str(run / f"snap_{i}"), {"m": StateDict(values)}, base=str(run / f"snap_{i - 1}"),
                      block_bytes=BLOCK, metadata={"iteration": i})
    removed = retention.prune(str(run), "snap_{.iteration}", 2)
    assert sorted(os.path.basename(r) for r in removed) == ["snap_1", "snap_2"]
    # snap_1 holds the frozen bytes snap_3 and snap_4 read: retired (no manifest, data kept); snap_2 removed
    assert sorted(os.listdir(run)) == ["snap_1", "snap_3", "snap_4"]
    assert sorted(os.listdir(run / "snap_1")) == ["data", RETIRED_NAME]
    kinds = {c.name: c.kind for c in retention.list_snapshots(str(run), "snap_{.iteration}")}
    assert kinds == {"snap_1": "retired", "snap_3": "snapshot", "snap_4": "snapshot"}
    third = dict(values, adapter=torch.full_like(values["adapter"], 3.0), step=3)
    assert_same(restored(run / "snap_3", third), third)
    assert_same(restored(run / "snap_4", values), values)
    with pytest.raises(SnapshotExistsError, match="still read"):  # a retired name is never written over
        take(run / "snap_1", values)
    # once no kept snapshot reads it, the next prune removes it
    Snapshot.take(str(run / "snap_5"), {"m": StateDict(values)}, metadata={"iteration": 5})  # self-contained
    retention.prune(str(run), "snap_{.iteration}", 1)
    assert sorted(os.listdir(run)) == ["snap_5"]
    assert_same(restored(run / "snap_5", values), values)


@pytest.mark.parametrize("writer_class", [SimpleWriter, ThreadWriter, ProcessWriter,
                                          functools.partial(ThreadQueueWriter, queue_depth=2)],
                         ids=["SimpleWriter", "ThreadWriter", "ProcessWriter", "ThreadQueueWriter-2"])
def test_extension_with_each_writer(tmp_path, writer_class, capsys):
    import pytorch_pfn_extras as ppe

    import ppe_snapshot

    def run(iterations: int) -> tuple[torch.nn.Module, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 2))
        model[0].requires_grad_(False)
        optimizer = torch.optim.Adam(model[1].parameters())
        manager = ppe.training.ExtensionsManager(model, optimizer, iterations, iters_per_epoch=1, out_dir=str(tmp_path))
        ext = ppe_snapshot.snapshot(writer=writer_class(), n_retains=2, incremental=True, autoload=True)
        manager.extend(ext, trigger=(1, "iteration"))
        while not manager.stop_trigger:
            with manager.run_iteration():
                loss = model(torch.randn(4, 256)).square().sum()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        ext.writer.finalize()
        return model, ext

    model, ext = run(4)
    frozen_bytes = 256 * 1024 * 4
    assert ext.writer.last_stats["bytes"] == data_size(tmp_path / "snapshot_iter_4") < frozen_bytes / 4
    assert sorted(os.listdir(tmp_path)) == ["snapshot_iter_1", "snapshot_iter_3", "snapshot_iter_4"]
    assert (tmp_path / "snapshot_iter_1" / RETIRED_NAME).exists()
    for name in ("snapshot_iter_3", "snapshot_iter_4"):
        assert Snapshot(str(tmp_path / name)).references == ("snapshot_iter_1",)
        assert data_size(tmp_path / name) < frozen_bytes / 4
    resumed, ext = run(6)
    assert ext.resumed_name == "snapshot_iter_4"
    saved = Snapshot(str(tmp_path / "snapshot_iter_6")).read_object("0/state/models/main")
    for key, value in resumed.state_dict().items():
        assert torch.equal(saved[key], value), key
    assert sorted(os.listdir(tmp_path)) == ["snapshot_iter_1", "snapshot_iter_5", "snapshot_iter_6"]
    assert cli_main(["ls", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert "retired" in listing and "REFERENCED" in listing


def test_ranks_reference_their_own_blocks(dist_run, tmp_path):
    results = dist_run(workers.incremental_takes, 2, str(tmp_path))
    for rank, result in enumerate(results):
        assert torch.equal(result["frozen"], workers.FROZEN)
        assert torch.equal(result["own"], workers.own_values(rank, 3)) and result["step"] == 3
        assert result["written"] == [workers.BLOCK] * 2  # the changed block of "own", after the plain take too
    snapshot = Snapshot(str(tmp_path / "s3"))
    assert snapshot.references == ("s1",)  # the block s2 wrote changed again
    assert torch.equal(snapshot.read_object("0/m/frozen"), workers.FROZEN)  # resharded: one process reads it all
    snapshot.verify()


def test_dcp_saves_of_several_ranks_write_only_their_changed_blocks(dist_run, tmp_path):
    results = dist_run(workers.dcp_incremental_saves, 2, str(tmp_path))
    adapter = torch.zeros(2 * 4096)
    adapter[:16] = adapter[4096:4096 + 16] = 3
    for result in results:
        assert torch.equal(result["frozen"], workers.FROZEN) and torch.equal(result["adapter"], adapter)
        assert result["written"] == workers.BLOCK  # the changed block of its shard of the adapter, nothing else
    snapshot = Snapshot(str(tmp_path / "d3"))
    assert snapshot.references == ("d1", "d2") and snapshot.metadata["dcp"]
    snapshot.verify()


def test_s3_incremental_take_and_retention(s3_bucket):
    url, options = s3_bucket
    values = state()
    Snapshot.take(f"{url}/run/snap_1", {"m": StateDict(values)}, storage_options=options, block_bytes=BLOCK,
                  metadata={"iteration": 1})
    for i in (2, 3):
        values["adapter"] += 1
        Snapshot.take(f"{url}/run/snap_{i}", {"m": StateDict(values)}, storage_options=options,
                      base=f"{url}/run/snap_{i - 1}", block_bytes=BLOCK, metadata={"iteration": i})
    snapshot = Snapshot(f"{url}/run/snap_3", storage_options=options)
    assert snapshot.references == ("snap_1",)
    target = state(seed=9)
    snapshot.restore({"m": StateDict(target)})
    assert_same(target, values)
    snapshot.verify()
    retention.prune(f"{url}/run", "snap_{.iteration}", 1, options)
    kinds = {c.name: c.kind for c in retention.list_snapshots(f"{url}/run", "snap_{.iteration}", options)}
    assert kinds == {"snap_1": "retired", "snap_3": "snapshot"}
    target = state(seed=9)
    Snapshot(f"{url}/run/snap_3", storage_options=options).restore({"m": StateDict(target)})
    assert_same(target, values)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_load_follows_references(tmp_path):
    import torch.distributed.checkpoint as dcp

    from ppe_snapshot.dcp import SnapshotStorageReader

    values = {k: v for k, v in state().items() if isinstance(v, torch.Tensor)}
    take(tmp_path / "s1", values)
    values["adapter"] += 1
    take(tmp_path / "s2", values, base=tmp_path / "s1")
    take(tmp_path / "s3", values, base=tmp_path / "s2")
    assert Snapshot(str(tmp_path / "s3")).references == ("s1", "s2")
    target = {"m": {k: torch.zeros_like(v) for k, v in values.items()}}
    dcp.load(target, storage_reader=SnapshotStorageReader(str(tmp_path / "s3")))
    for key, value in values.items():
        assert torch.equal(target["m"][key], value), key


def test_a_referenced_file_linked_out_of_its_snapshot_is_refused(tmp_path):
    path = _incremental_pair(tmp_path / "run")
    outside = tmp_path / "outside.bin"
    shutil.move(str(tmp_path / "run" / "s1" / "data" / "rank0.bin"), outside)
    os.symlink(outside, tmp_path / "run" / "s1" / "data" / "rank0.bin")
    for read in (lambda s: s.restore({"m": StateDict(state())}), lambda s: s.verify()):
        with pytest.raises(CorruptSnapshotError, match="outside"):
            read(Snapshot(str(path)))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_incremental_take_needs_index_files(tmp_path):
    """Format version 1 (one JSON manifest) cannot reference a base: the engine's take and the DCP writer refuse
    before writing anything."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ppe_snapshot.dcp import SnapshotStorageWriter

    Snapshot.take(str(tmp_path / "s1"), {"m": StateDict(w=torch.ones(4))})
    refused = "needs format version 2 or newer; PPE_SNAPSHOT_FORMAT_VERSION asks for 1"
    with written_as(1):
        with pytest.raises(ValueError, match=refused):
            Snapshot.take(str(tmp_path / "s2"), {"m": StateDict(w=torch.ones(4))}, base=str(tmp_path / "s1"))
        with pytest.raises(CheckpointException) as info:
            dcp.save({"w": torch.ones(4)}, storage_writer=SnapshotStorageWriter(str(tmp_path / "d2"),
                                                                                base=str(tmp_path / "s1")))
    error = next(iter(info.value.failures.values()))
    error = error[0] if isinstance(error, tuple) else error
    assert isinstance(error, ValueError) and refused in str(error)
    assert not (tmp_path / "s2" / "manifest.json").exists() and not (tmp_path / "d2" / "manifest.json").exists()


def test_a_missing_base_writes_nothing(tmp_path):
    with pytest.raises(FileNotFoundError, match="s0"):
        take(tmp_path / "s1", state(), base=tmp_path / "s0")
    assert not (tmp_path / "s1").exists()


def test_a_referenced_snapshot_linked_out_of_the_run_directory_is_refused(tmp_path):
    path = _incremental_pair(tmp_path / "run")
    shutil.move(str(tmp_path / "run" / "s1"), tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / "run" / "s1")
    with pytest.raises(CorruptSnapshotError, match="outside the run directory"):
        Snapshot(str(path)).restore({"m": StateDict(state())})


def test_verify_names_every_snapshot_a_damaged_base_block_damages(tmp_path, capsys):
    run = tmp_path / "run"
    values = state()
    take(run / "snap_1", values)
    for i in (2, 3):
        values["adapter"] += 1
        Snapshot.take(str(run / f"snap_{i}"), {"m": StateDict(values)}, base=str(run / f"snap_{i - 1}"),
                      block_bytes=BLOCK, metadata={"iteration": i})
    retention.prune(str(run), "snap_{.iteration}", 2)  # snap_1 retired: snap_2 and snap_3 read its frozen bytes
    with open(run / "snap_1" / "data" / "rank0.bin", "r+b") as f:  # one byte of the frozen tensor
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    paths = [str(run / name) for name in ("snap_1", "snap_2", "snap_3")]
    assert cli_main(["verify", *paths]) == 1
    out = capsys.readouterr().out
    assert f"RETIRED {paths[0]}" in out
    assert f"DAMAGED {paths[1]}: m/frozen" in out and f"DAMAGED {paths[2]}: m/frozen" in out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_save_with_a_base_writes_only_what_changed(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ppe_snapshot.dcp import SnapshotStorageReader, SnapshotStorageWriter

    values = {"m": {k: v for k, v in state().items() if isinstance(v, torch.Tensor)}, "step": 1}
    dcp.save(values, storage_writer=SnapshotStorageWriter(str(tmp_path / "d1")))
    for i in (2, 3):
        values["m"]["adapter"] += 1
        values["step"] = i
        dcp.save(values, storage_writer=SnapshotStorageWriter(str(tmp_path / f"d{i}"), base=str(tmp_path / f"d{i - 1}"),
                                                              block_bytes=BLOCK))
    snapshot = Snapshot(str(tmp_path / "d3"))
    assert "d1" in snapshot.references and snapshot.metadata["dcp"]
    assert data_size(tmp_path / "d3") <= BLOCK + 2048  # the adapter's block, and "step" (a torch.save stream)
    snapshot.verify()
    target = {"m": {k: torch.zeros_like(v) for k, v in values["m"].items()}, "step": 0}
    dcp.load(target, storage_reader=SnapshotStorageReader(str(tmp_path / "d3")))
    assert target["step"] == 3
    for key, value in values["m"].items():
        assert torch.equal(target["m"][key], value), key
    with pytest.raises(CheckpointException) as info:  # DCP gathers each rank's error
        dcp.save(values, storage_writer=SnapshotStorageWriter(str(tmp_path / "other" / "d4"),
                                                              base=str(tmp_path / "d3")))
    error = next(iter(info.value.failures.values()))
    error = error[0] if isinstance(error, tuple) else error
    assert isinstance(error, ValueError) and "same directory" in str(error)
    assert not (tmp_path / "other" / "d4" / "manifest.json").exists()
