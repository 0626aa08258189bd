"""ppe_snapshot.retention: matching names, ordering by training position, pruning."""
from __future__ import annotations

import json
import os
import uuid
import zipfile

import fsspec
import pytest
import torch

from ppe_snapshot import AutoloadSkipWarning, Snapshot, StateDict
from ppe_snapshot.engine._format.names import PARTS_DIR
from ppe_snapshot.retention import Candidate, FilenameFormat, list_snapshots, prune, select_prunable
from ppe_snapshot.run_dir import single_files
from ppe_snapshot.storage import join

FMT = "snapshot_iter_{.iteration}"


def _take(out: str, name: str, iteration: int | None, storage_options=None, **extra) -> str:
    url = join(out, name)
    metadata = {} if iteration is None else {"iteration": iteration, "epoch_detail": iteration / 10, **extra}
    Snapshot.take(url, {"state": StateDict({"w": torch.arange(4.0)})}, storage_options=storage_options,
                  metadata=metadata)
    return url


def _names(candidates: list[Candidate]) -> list[str]:
    return [c.name for c in candidates]


# -- the filename format -------------------------------------------------------------------------------


def test_format_matches_only_names_it_can_produce():
    fmt = FilenameFormat(FMT)
    assert fmt.match("snapshot_iter_10") == {"iteration": "10"}
    for other in ("snapshot_iter_", "snapshot_iter_x", "tmp_snapshot_iter_10", "snapshot_iter_10.bak",
                  "snapshot_iter_10.error-rank1", "a/snapshot_iter_10", "snapshot_iter_1a"):
        assert fmt.match(other) is None, other


def test_format_fields_specs_escapes_and_directories():
    fmt = FilenameFormat("run.{0.epoch:03d}/snap+{.iteration:08d}_{.epoch_detail:.2f}{{x}}_{.name}")
    assert fmt.depth == 2
    assert fmt.match("run.003/snap+00000010_3.25{x}_abc") == {
        "epoch": "003", "iteration": "00000010", "epoch_detail": "3.25", "name": "abc"}
    assert fmt.match("runX003/snap+00000010_3.25{x}_abc") is None  # "." is literal
    assert fmt.match("run.003/snap+00000010_3.25{x}_") is None


@pytest.mark.parametrize("bad, fragment", [("snap_{", "not a valid format string"),
                                           ("a//{.iteration}", "empty path component")])
def test_format_rejects_bad_formats(bad, fragment):
    with pytest.raises(ValueError, match=fragment):
        FilenameFormat(bad)


# -- listing and ordering --------------------------------------------------------------------------------


def test_ordered_by_recorded_position_never_by_name_or_mtime(tmp_path):
    out = str(tmp_path)
    for i, it in enumerate([100, 10, 9]):
        url = _take(out, f"snapshot_iter_{it}", it)
        os.utime(url, (1_000_000 + i, 1_000_000 + i))  # the newest mtime on the oldest position
    # The manifest's position wins over the one in the name.
    _take(out, "snapshot_iter_5", 50)
    for unrelated in ("other", "tmp_snapshot_iter_3", "snapshot_iter_3.error-rank0"):
        os.makedirs(tmp_path / unrelated)
    found = list_snapshots(out, FMT)
    assert _names(found) == ["snapshot_iter_9", "snapshot_iter_10", "snapshot_iter_5", "snapshot_iter_100"]
    assert [c.iteration for c in found] == [9, 10, 50, 100]
    assert all(c.kind == "snapshot" and c.complete for c in found)
    assert found[0].url == join(out, "snapshot_iter_9")


def _record(snapshot, **metadata) -> None:
    """Rewrite fields of the metadata in the manifest of the engine snapshot at ``snapshot`` (a Path)."""
    manifest = snapshot / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["metadata"].update(metadata)
    manifest.write_text(json.dumps(doc))


@pytest.mark.parametrize("field, value, loss", [
    ("iteration", -4, -4.0), ("iteration", True, None), ("iteration", 1.5, 1.5),
    ("epoch_detail", float("nan"), None), ("epoch_detail", float("inf"), None), ("epoch_detail", -1.0, -1.0),
    ("epoch_detail", 10**400, None)], ids=["iteration -4", "iteration true", "iteration 1.5", "epoch detail nan",
                                        "epoch detail inf", "epoch detail -1", "epoch detail beyond floats"])
def test_a_recorded_position_no_training_reaches_is_not_trusted(tmp_path, field, value, loss):
    """A damaged manifest's position is not used (the name's iteration is): a recorded -4 ordered the newest
    snapshot before every other, so that autoload resumed from an older one without a word; a NaN leaves
    positions without an order. A number beyond floats, as a position or a metric, made the listing raise
    OverflowError; it is dropped like any value that is no finite number."""
    out = str(tmp_path)
    _take(out, "snapshot_iter_2", 2)
    _take(out, "snapshot_iter_4", 4)
    _record(tmp_path / "snapshot_iter_4", **{field: value, "ppe_snapshot_metrics": {"loss": value, "acc": 0.5}})
    found = list_snapshots(out, FMT)
    assert _names(found) == ["snapshot_iter_2", "snapshot_iter_4"]
    newest = found[-1]
    assert newest.kind == "snapshot" and newest.iteration == 4
    assert newest.epoch_detail == (0.4 if field == "iteration" else None)
    assert dict(newest.metrics) == {"acc": 0.5, **({} if loss is None else {"loss": loss})}


def test_a_snapshot_whose_state_is_not_at_its_recorded_position_is_skipped(tmp_path):
    """snapshot_iter_4 records iteration 100, its state is at 4: trusted, it outranked every snapshot saved after
    it, so that each restart resumed from it again and retention removed each new save (_6, then _8)."""
    from _extension_workers import Run
    out = str(tmp_path)
    Run(out, 4, {}).train()
    _record(tmp_path / "snapshot_iter_4", iteration=100)
    first = Run(out, 6, {"autoload": True, "n_retains": 1})
    with pytest.warns(AutoloadSkipWarning, match=r"snapshot_iter_4: CorruptSnapshotError: it is listed at iteration "
                                                 r"100 \(what it records, or its name\), but the state it holds is at "
                                                 r"iteration 4"):
        first.manager.start_extensions()
    assert first.snapshot.resumed_name == "snapshot_iter_2" and first.manager.iteration == 2
    first.train()
    assert _names(list_snapshots(out, FMT)) == ["snapshot_iter_6"]
    second = Run(out, 8, {"autoload": True, "n_retains": 1})
    second.train()
    assert second.snapshot.resumed_name == "snapshot_iter_6"
    assert _names(list_snapshots(out, FMT)) == ["snapshot_iter_8"]


def test_a_snapshot_passed_over_for_what_it_records_is_named_when_its_name_is_newer(tmp_path):
    """snapshot_iter_4 records iteration 1: ordered by what it records, autoload resumes from snapshot_iter_2,
    and now says so of the snapshot whose name is the newest (it was silent)."""
    from _extension_workers import Run
    out = str(tmp_path)
    Run(out, 4, {}).train()
    _record(tmp_path / "snapshot_iter_4", iteration=1)
    run = Run(out, 6, {"autoload": True})
    with pytest.warns(AutoloadSkipWarning, match=r"snapshot_iter_4: its name says iteration 4, but it records "
                                                 r"iteration 1, before snapshot_iter_2, which autoload resumes from"):
        run.manager.start_extensions()
    assert run.snapshot.resumed_name == "snapshot_iter_2"


def test_classifies_incomplete_busy_damaged_and_ppe_files(tmp_path):
    out = str(tmp_path)
    _take(out, "snapshot_iter_1", 1)
    (tmp_path / "snapshot_iter_2" / "data").mkdir(parents=True)  # crashed before the commit
    parts = tmp_path / "snapshot_iter_3" / PARTS_DIR
    parts.mkdir(parents=True)
    (parts / "abc.rank1.json").write_text("{}")  # a multi-rank take in progress
    aborted = tmp_path / "snapshot_iter_4" / PARTS_DIR
    aborted.mkdir(parents=True)
    (aborted / "def.rank1.json").write_text("{}")
    (aborted / "def.abort").write_text("rank 1 failed")
    truncated = _take(out, "snapshot_iter_5", 5)
    with open(os.path.join(truncated, "data", "rank0.bin"), "r+b") as f:
        f.truncate(3)
    garbled = _take(out, "snapshot_iter_6", 6)
    with open(os.path.join(garbled, "manifest.json"), "w") as f:
        f.write("{not json")
    # ppe's own format: a torch.save'd manager state; the position is read from inside it.
    torch.save({"_start_iteration": 70, "models": {"main": {"w": torch.ones(2)}}}, tmp_path / "snapshot_iter_7")
    torch.save({"w": torch.ones(2)}, tmp_path / "snapshot_iter_8")  # not a manager: the name tells

    found = {c.name: c for c in list_snapshots(out, FMT)}
    assert {n: c.kind for n, c in found.items()} == {
        "snapshot_iter_1": "snapshot", "snapshot_iter_2": "incomplete", "snapshot_iter_3": "incomplete",
        "snapshot_iter_4": "incomplete", "snapshot_iter_5": "damaged", "snapshot_iter_6": "damaged",
        "snapshot_iter_7": "file", "snapshot_iter_8": "file"}
    assert [n for n, c in found.items() if c.busy] == ["snapshot_iter_3"]
    assert "manifest.json" in found["snapshot_iter_2"].problem
    assert "rank0.bin is 3 bytes" in found["snapshot_iter_5"].problem
    assert "not valid JSON" in found["snapshot_iter_6"].problem
    assert found["snapshot_iter_7"].iteration == 70
    assert found["snapshot_iter_8"].iteration == 8


def _rank_files(out: str, name: str, iteration: int, ranks: int = 2, mark: bool = True, storage_options=None):
    """ppe's SHARDED layout with a savefun: a torch.save'd manager state per rank, then the mark."""
    fs, root = fsspec.core.url_to_fs(join(out, name), **(storage_options or {}))
    fs.makedirs(root, exist_ok=True)
    for rank in range(ranks):
        with fs.open(f"{root}/{rank}", "wb") as f:
            torch.save({"_start_iteration": iteration, "models": {"main": {"w": torch.full((2,), rank)}}}, f)
    if mark:
        with fs.open(f"{root}/complete", "wb") as f:
            torch.save({}, f)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_ppes_per_rank_files_are_listed_whole_when_marked_and_pruned_whole(tmp_path, where):
    out = str(tmp_path) if where == "local" else f"memory://rank-files-{uuid.uuid4().hex}/run"
    for i in (2, 4, 6):
        _rank_files(out, f"snapshot_iter_{i}", i)
    _rank_files(out, "snapshot_iter_1", 1, mark=False)  # a save cut short before the mark
    _rank_files(out, "snapshot_iter_3", 3, ranks=0)  # a mark and no file
    _rank_files(out, "snapshot_iter_5", 5, ranks=3)
    fs, root = fsspec.core.url_to_fs(out)
    fs.rm(f"{root}/snapshot_iter_5/1")  # ranks 0 and 2
    _rank_files(out, "snapshot_iter_8", 8, mark=False)  # being written
    _rank_files(out, "snapshot_iter_0", 0)
    fs.touch(f"{root}/snapshot_iter_0/{'9' * 250}")  # a crafted rank
    found = {c.name: c for c in list_snapshots(out, FMT)}
    assert {n: (c.kind, c.ranks) for n, c in found.items()} == {
        "snapshot_iter_1": ("incomplete", 0), "snapshot_iter_2": ("rank files", 2), "snapshot_iter_3": ("damaged", 0),
        "snapshot_iter_4": ("rank files", 2), "snapshot_iter_5": ("damaged", 0), "snapshot_iter_6": ("rank files", 2),
        "snapshot_iter_8": ("incomplete", 0), "snapshot_iter_0": ("damaged", 0)}
    assert "mark 'complete' of ppe's per-rank files but no file of rank 0" in found["snapshot_iter_3"].problem
    assert "its per-rank files are not those of ranks 0 to 0 alone" in found["snapshot_iter_5"].problem
    removed = prune(out, FMT, 2)
    assert "not those of ranks 0 to 1 alone: ['99999" in found["snapshot_iter_0"].problem
    assert sorted(removed) == sorted(join(out, f"snapshot_iter_{i}") for i in (0, 1, 2, 3, 5))
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(root, detail=False)) == [
        "snapshot_iter_4", "snapshot_iter_6", "snapshot_iter_8"]


def _record_call(path: str) -> None:  # what a malicious pickle would run
    os.makedirs(path)


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return _record_call, (self.path,)


def test_reading_a_ppe_file_position_runs_no_code_from_it(tmp_path):
    witness = tmp_path / "code-ran"
    torch.save({"_start_iteration": 12, "evil": _Evil(str(witness))}, tmp_path / "snapshot_iter_1")
    (found,) = list_snapshots(str(tmp_path), FMT)
    assert found.iteration == 12
    assert not witness.exists()


def _rezip(path, compress_type: int) -> None:
    """Rewrite the zip archive at ``path`` with every member stored with ``compress_type``."""
    with zipfile.ZipFile(path) as archive:
        members = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w", compression=compress_type) as archive:
        for name, data in members:
            archive.writestr(name, data)


def test_a_ppe_file_position_is_read_from_a_stored_record_only(tmp_path, monkeypatch):
    """A compressed pickle record (torch.save never writes one) could unpack to any size from a few bytes on disk:
    not read, so the position comes from the file's name; nor is a record larger than the bound."""
    torch.save({"_start_iteration": 12}, tmp_path / "snapshot_iter_1")
    (found,) = list_snapshots(str(tmp_path), FMT)
    assert found.iteration == 12
    _rezip(tmp_path / "snapshot_iter_1", zipfile.ZIP_STORED)  # the rewrite alone keeps it readable
    assert list_snapshots(str(tmp_path), FMT)[0].iteration == 12
    monkeypatch.setattr(single_files, "MAX_PEEKED_RECORD", 8)
    assert list_snapshots(str(tmp_path), FMT)[0].iteration == 1
    monkeypatch.undo()
    _rezip(tmp_path / "snapshot_iter_1", zipfile.ZIP_DEFLATED)
    assert list_snapshots(str(tmp_path), FMT)[0].iteration == 1


def test_missing_out_dir_lists_nothing(tmp_path):
    assert list_snapshots(str(tmp_path / "nope"), FMT) == []
    assert prune(str(tmp_path / "nope"), FMT, 1) == []


def test_nested_format_lists_across_directories(tmp_path):
    out = str(tmp_path)
    fmt = "epoch_{.epoch}/iter_{.iteration}"
    _take(out, "epoch_0/iter_5", 5)
    _take(out, "epoch_1/iter_12", 12)
    (tmp_path / "epoch_1" / "stray").mkdir()
    (tmp_path / "epoch_2").write_text("a file where a directory is expected")
    assert _names(list_snapshots(out, fmt)) == ["epoch_0/iter_5", "epoch_1/iter_12"]
    assert prune(out, fmt, 1) == [join(out, "epoch_0/iter_5")]
    assert not (tmp_path / "epoch_0" / "iter_5").exists()


# -- pruning -----------------------------------------------------------------------------------------------


def _c(name: str, kind: str, iteration: int | None, busy: bool = False) -> Candidate:
    return Candidate(name, name, kind, iteration, None, busy=busy)


def test_select_prunable_rules():
    cands = [_c("d5", "damaged", 5), _c("s10", "snapshot", 10), _c("i15", "incomplete", 15),
             _c("b17", "incomplete", 17, busy=True), _c("f20", "file", 20), _c("s30", "snapshot", 30),
             _c("u", "incomplete", None), _c("i40", "incomplete", 40), _c("d50", "damaged", 50)]
    assert _names(select_prunable(cands, 2)) == ["d5", "s10", "i15"]
    assert _names(select_prunable(cands, 1)) == ["d5", "s10", "i15", "f20"]
    assert _names(select_prunable(cands, 5)) == ["d5", "i15"]
    assert select_prunable(cands, 0) == [] and select_prunable(cands, -1) == []
    assert select_prunable([_c("i1", "incomplete", 1), _c("d2", "damaged", 2)], 1) == []



def test_the_newest_of_a_runs_own_saves_stays_among_an_earlier_runs_later_ones():
    # A run started without autoload where an earlier run went further: the earlier run's snapshots outrank it.
    cands = [_c("s2", "snapshot", 2), _c("s4", "snapshot", 4), _c("s8", "snapshot", 8), _c("s10", "snapshot", 10)]
    assert _names(select_prunable(cands, 2)) == ["s2", "s4"]
    assert _names(select_prunable(cands, 2, own={"s2", "s4", "s6"})) == ["s2"]  # s6: saved, not listed complete
    assert _names(select_prunable(cands, 2, own={"s8", "s10"})) == ["s2", "s4"]  # its newest is kept anyway

def _prune_scenario(out: str, storage_options, exists):
    for it in (10, 20, 30):
        _take(out, f"snapshot_iter_{it}", it, storage_options)
    fs, root = fsspec.core.url_to_fs(out, **(storage_options or {}))
    for rel, data in [("snapshot_iter_15/data/rank0.bin", b"partial"),  # crashed save, older
                      (f"snapshot_iter_25/{PARTS_DIR}/t.rank1.json", b"{}"),  # a take in progress
                      ("snapshot_iter_40/data/rank0.bin", b"partial")]:  # being written, newer
        fs.makedirs(f"{root}/{rel}".rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(f"{root}/{rel}", data)
    removed = prune(out, FMT, 2, storage_options)
    assert sorted(removed) == [join(out, "snapshot_iter_10"), join(out, "snapshot_iter_15")]
    left = {it for it in (10, 15, 20, 25, 30, 40) if exists(fs, f"{root}/snapshot_iter_{it}")}
    assert left == {20, 25, 30, 40}
    assert _names(list_snapshots(out, FMT, storage_options)) == [
        "snapshot_iter_20", "snapshot_iter_25", "snapshot_iter_30", "snapshot_iter_40"]
    assert prune(out, FMT, 1, storage_options) == [join(out, "snapshot_iter_20")]
    snap = Snapshot(join(out, "snapshot_iter_30"), storage_options=storage_options)
    snap.verify()  # the newest complete one is intact


def _exists(fs, path):
    return bool(fs.exists(path)) and bool(fs.find(path))


def test_prune_local(tmp_path):
    _prune_scenario(str(tmp_path / "out"), None, _exists)


def test_prune_memory_url():
    _prune_scenario(f"memory://retention-{uuid.uuid4().hex}/run", None, _exists)


def test_prune_s3(s3_bucket):
    url, storage_options = s3_bucket
    _prune_scenario(f"{url}/run", storage_options, _exists)


# -- retention never deletes the newest valid snapshot -------------------------------------------------------


def test_rejected_names_are_never_kept():
    cands = [_c("s2", "snapshot", 2), _c("s3", "snapshot", 3), _c("s4", "snapshot", 4)]
    # s4 passes the quick check but autoload could not restore it: s3 is the newest kept, s4 is newer: left alone.
    assert _names(select_prunable(cands, 1, rejected={"s4"})) == ["s2"]
    # a rejected one older than the newest kept one is a damaged leftover: removed.
    assert _names(select_prunable(cands, 1, rejected={"s3"})) == ["s2", "s3"]
    # nothing kept but rejected ones: nothing is removed.
    assert select_prunable(cands, 1, rejected={"s2", "s3", "s4"}) == []


@pytest.mark.parametrize("content", [b"", b"not a torch.save file"])
def test_a_file_that_is_not_a_torch_save_file_is_damaged(tmp_path, content):
    out = str(tmp_path)
    _take(out, "snapshot_iter_2", 2)
    (tmp_path / "snapshot_iter_4").write_bytes(content)
    torch.save({"_start_iteration": 6}, tmp_path / "snapshot_iter_6")
    found = {c.name: c for c in list_snapshots(out, FMT)}
    assert found["snapshot_iter_4"].kind == "damaged" and not found["snapshot_iter_4"].complete
    assert found["snapshot_iter_6"].kind == "file" and found["snapshot_iter_6"].iteration == 6
    assert prune(out, FMT, 1) == [join(out, "snapshot_iter_2"), join(out, "snapshot_iter_4")]


def test_metadata_that_is_not_an_object_is_damaged(tmp_path):
    out = str(tmp_path)
    _take(out, "snapshot_iter_2", 2)
    manifest = tmp_path / "snapshot_iter_2" / "manifest.json"
    manifest.write_text(_with_metadata(manifest.read_text(), [1, 2]))
    (c,) = list_snapshots(out, FMT)
    assert c.kind == "damaged" and "metadata is not an object" in c.problem


def _with_metadata(text: str, metadata) -> str:
    import json
    data = json.loads(text)
    data["metadata"] = metadata
    return json.dumps(data)


def test_a_fixed_name_is_listed_with_the_snapshot_replacing_it(tmp_path):
    from ppe_snapshot.stored_snapshot import SIDE_SUFFIX
    out = str(tmp_path)
    _take(out, "latest", 3)
    _take(out, "latest" + SIDE_SUFFIX, 4)
    _take(out, "other" + SIDE_SUFFIX, 5)
    assert FilenameFormat("latest").fixed and not FilenameFormat(FMT).fixed
    assert _names(list_snapshots(out, "latest")) == ["latest", "latest" + SIDE_SUFFIX]  # by position
    _take(out, "snapshot_iter_7" + SIDE_SUFFIX, 7)
    assert _names(list_snapshots(out, FMT)) == []  # only a format without fields looks beside the name


@pytest.mark.parametrize("damage", ["flipped byte", "empty files", "empty file for the directory"])
def test_resume_then_prune_keeps_the_newest_valid_snapshot(tmp_path, damage):
    """snapshot_iter_3 and _4 damaged, _2 valid, n_retains=1: autoload resumes from 2; the saves after it
    must never leave the directory without a valid snapshot, nor keep a damaged one as the newest."""
    from _extension_workers import Run, flip_byte
    out = str(tmp_path)
    Run(out, 4, {}, trigger=(1, "iteration")).train()
    for it in (3, 4):
        snap = tmp_path / f"snapshot_iter_{it}"
        if damage == "flipped byte":  # the quick check (sizes) passes; the checksums do not
            flip_byte(str(snap / "data" / "rank0.bin"))
        elif damage == "empty files":
            for path in (snap / "data").iterdir():
                path.write_bytes(b"")
        else:
            import shutil
            shutil.rmtree(snap)
            snap.write_bytes(b"")

    def valid() -> list[int]:
        kept = []
        for c in list_snapshots(out, FMT):
            try:
                Snapshot(c.url).verify(deep=True)
            except Exception:  # noqa: BLE001 - not valid
                continue
            kept.append(c.iteration)
        return kept

    resumed = Run(out, 3, {"autoload": True, "n_retains": 1}, trigger=(1, "iteration"), seed=1)
    with pytest.warns(UserWarning) as warned:
        resumed.manager.start_extensions()
    skipped = [str(w.message).split("skipping snapshot ")[1].split(":")[0] for w in warned]
    assert skipped == [join(out, "snapshot_iter_4"), join(out, "snapshot_iter_3")]
    assert resumed.snapshot.resumed_name == "snapshot_iter_2"
    resumed.train()  # saves 3, then prunes
    assert valid() == [3]
    assert not (tmp_path / "snapshot_iter_2").exists()  # an older complete one: pruned
    assert (tmp_path / "snapshot_iter_4").exists()  # damaged but newer than the newest valid one: left

    again = Run(out, 5, {"autoload": True, "n_retains": 1}, trigger=(1, "iteration"), seed=2)
    with pytest.warns(UserWarning, match="snapshot_iter_4"):
        again.manager.start_extensions()
    assert again.snapshot.resumed_name == "snapshot_iter_3" and again.manager.iteration == 3
    again.train()  # saves 4 (replacing the damaged one) and 5
    assert valid() == [5]
    assert [c.name for c in list_snapshots(out, FMT)] == ["snapshot_iter_5"]
