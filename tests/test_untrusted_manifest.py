"""A crafted or damaged manifest is refused, never misread (issue 10, items 3 and 5).

Each test takes a real snapshot, rewrites its manifest as docs/format.md
describes it (tests/_crafted.py), and reads it back through every reader:
``get_manifest``, ``metadata``, ``read_object``, ``restore``, ``verify``
(deep and quick), the DCP reader and ``ppe-snapshot verify``. Each must raise
``CorruptSnapshotError`` naming the entry, before using a byte of it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from _asserts import written_as
from _crafted import (
    BOTTOM, DATA, TOP, WEIGHT, append_payload, craft, entry, make_sharded, read_doc, take_small, write_deep_manifest,
)
from ppe_snapshot import CorruptSnapshotError, Snapshot, StateDict, StateMismatchError, UnsupportedFormatError
from ppe_snapshot.cli import main
from ppe_snapshot.dcp import SnapshotStorageReader, SnapshotStorageWriter


@pytest.fixture(autouse=True)
def _version_1():
    """These tests craft the one JSON document of format version 1 (version 2's index files:
    test_untrusted_index.py); the reader of version 1 stays, for snapshots written before version 2."""
    with written_as(1):
        yield

TIB4 = 4 << 40

READERS: dict[str, Callable[[str], Any]] = {
    "get_manifest": lambda p: Snapshot(p).get_manifest(),
    "read_object": lambda p: Snapshot(p).read_object("0/m"),
    "restore": lambda p: Snapshot(p).restore({"m": StateDict()}),
    "restore_in_place": lambda p: Snapshot(p).restore({"m": StateDict(w=torch.zeros(3, 4), top=torch.zeros(2, 4))}),
    "verify": lambda p: Snapshot(p).verify(),
    "verify_quick": lambda p: Snapshot(p).verify(deep=False),
    "dcp_read_metadata": lambda p: SnapshotStorageReader(p).read_metadata(),
}


def _refused_everywhere(path: Path, *fragments: str, readers: dict[str, Callable[[str], Any]] = READERS) -> None:
    for name, read in readers.items():
        with pytest.raises(CorruptSnapshotError) as info:
            read(str(path))
        for fragment in fragments:
            assert fragment in str(info.value), (name, str(info.value))


@pytest.fixture
def small(tmp_path) -> Path:
    return take_small(tmp_path / "s")


def test_the_untouched_snapshot_reads_back(small):
    for read in READERS.values():
        read(str(small))
    state = Snapshot(str(small)).read_object("0/m")
    assert torch.equal(state["w"], WEIGHT) and state["step"] == 3


# -- item 3: every entry is checked against its bytes -----------------------------------------------

def _set(field: str, value: Any) -> Callable[[dict], None]:
    return lambda e: e.__setitem__(field, value)


def _chunk(field: str, value: Any) -> Callable[[dict], None]:
    return lambda e: e["chunks"][0].__setitem__(field, value)


SIZE_MISMATCHES = {
    "no chunks": (_set("chunks", []), "chunks hold 0 bytes"),
    "doubled shape": (_set("shape", [6, 4]), "chunks hold 48 bytes, but shape [6, 4] of float32 needs 96"),
    "one more dimension": (_set("shape", [3, 4, 2]), "needs 96"),
    "shape of 4 TiB": (_set("shape", [1 << 40]), f"needs {TIB4}"),
    "half the bytes": (_chunk("nbytes", 24), "chunks hold 24 bytes"),
    "other dtype": (_set("dtype", "float64"), "needs 96"),
    "chunk beyond the file": (_chunk("offset", 1 << 20), "beyond its recorded size"),
    "chunk claiming 4 TiB": (lambda e: (e.__setitem__("shape", [1 << 40]), e["chunks"][0].__setitem__("nbytes", TIB4)),
                             "beyond its recorded size"),
    "chunk of a file not in files": (_chunk("file", "data/rank1.bin"), "not among the manifest's files"),
}


@pytest.mark.parametrize("case", list(SIZE_MISMATCHES))
def test_tensor_whose_chunks_do_not_hold_its_shape(small, case):
    mutate, reason = SIZE_MISMATCHES[case]
    craft(small, lambda doc: mutate(entry(doc, "m/w")))
    _refused_everywhere(small, "'m/w'", reason)


def test_shapes_beyond_the_recorded_sizes_are_refused_before_allocating(small):
    """The manifest also claims a 4 TiB data file: the real file's size refuses the entry before memory is
    allocated for it (an allocation attempt would raise RuntimeError or exhaust memory, not this)."""
    def inflate(doc):
        weight = entry(doc, "m/w")
        weight["shape"], weight["chunks"][0]["nbytes"] = [1 << 40], TIB4
        doc["files"][DATA] = TIB4 + 64
    craft(small, inflate)
    for read in (lambda: Snapshot(str(small)).read_object("0/m/w"), lambda: Snapshot(str(small)).read_object("0/m"),
                 lambda: Snapshot(str(small)).restore({"m": StateDict()})):
        with pytest.raises(CorruptSnapshotError, match="missing or truncated") as info:
            read()
        assert "'m/w'" in str(info.value) and DATA in str(info.value)
    for deep in (True, False):
        with pytest.raises(CorruptSnapshotError, match=f"the manifest says {TIB4 + 64} bytes"):
            Snapshot(str(small)).verify(deep=deep)


def test_ndarray_entries_are_checked_with_their_numpy_dtype(small):
    craft(small, lambda doc: entry(doc, "m/n").__setitem__("shape", [12]))
    _refused_everywhere(small, "'m/n'", "chunks hold 24 bytes, but shape [12] of <i4 needs 48")


@pytest.mark.parametrize("dtype", ["|O8", "O", "i4,O", "not a dtype", 4])
def test_ndarray_of_objects_or_unknown_dtype_is_refused(small, dtype):
    """Raw bytes read into an object array would be taken for pointers."""
    craft(small, lambda doc: entry(doc, "m/n").__setitem__("dtype", dtype))
    _refused_everywhere(small, "'m/n'")


def test_crafted_sharded_entry_restores_exactly(small):
    """The positive control of the sharded cases: a sharded entry written from the format document."""
    craft(small, make_sharded)
    expected = torch.cat([TOP, BOTTOM])
    assert torch.equal(Snapshot(str(small)).read_object("0/m/grid"), expected)
    target = StateDict(grid=torch.zeros(4, 4))
    Snapshot(str(small)).restore({"m": target})
    assert torch.equal(target["grid"], expected)
    Snapshot(str(small)).verify()


def _shard(index: int, field: str, value: Any) -> Callable[[dict], None]:
    return lambda doc: doc["sharded"]["m/grid"]["shards"][index].__setitem__(field, value)


SHARD_DAMAGE = {
    "doubled global shape": (lambda doc: doc["sharded"]["m/grid"].__setitem__("shape", [8, 4]),
                             "shards hold 16 elements, but the global shape [8, 4] has 32"),
    "shard beyond the global shape": (_shard(1, "offsets", [3, 0]), "does not lie within the global shape"),
    "shard sizes doubled": (_shard(0, "sizes", [4, 4]), "shard 0's chunks hold 32 bytes, but its sizes [4, 4]"),
    "shard sizes past the edge": (_shard(1, "sizes", [2, 8]), "does not lie within"),
    "shard without chunks": (_shard(1, "chunks", []), "shard 1's chunks hold 0 bytes"),
    "shard of fewer dimensions": (_shard(0, "offsets", [0]), "does not lie within"),
    "negative offset": (_shard(0, "offsets", [-2, 0]), "not a list of non-negative integers"),
    "a shard missing": (lambda doc: doc["sharded"]["m/grid"]["shards"].pop(), "shards hold 8 elements"),
    "a plain tensor in the sharded section": (
        lambda doc: doc["sharded"].__setitem__("m/grid", entry(doc, "m/w")), "is not 'sharded'"),
}


@pytest.mark.parametrize("case", list(SHARD_DAMAGE))
def test_sharded_entry_whose_shards_do_not_match(small, case):
    mutate, reason = SHARD_DAMAGE[case]
    craft(small, make_sharded)
    craft(small, mutate)
    readers = {name: read for name, read in READERS.items() if name != "restore_in_place"}
    _refused_everywhere(small, "'m/grid'", reason, readers=readers)


def test_pickle_and_bytes_chunks_are_checked_too(small):
    def add(doc):
        chunk = append_payload(small, doc, b"x" * 100)
        chunk["nbytes"] = 10_000
        doc["ranks"][0]["m/step"] = {"type": "bytes", "chunks": [chunk]}
    craft(small, add)
    _refused_everywhere(small, "'m/step'", "beyond its recorded size",
                        readers={n: r for n, r in READERS.items() if n != "restore_in_place"})


# -- item 5: wrong types anywhere are CorruptSnapshotError ----------------------------------------------

DOCUMENT_DAMAGE = {
    "world_size a string": (lambda d: d.__setitem__("world_size", "1"), "world_size '1' is not a positive integer"),
    "world_size a boolean": (lambda d: d.__setitem__("world_size", True), "world_size"),
    "world_size zero": (lambda d: d.__setitem__("world_size", 0), "world_size"),
    "world_size beyond ranks": (lambda d: d.__setitem__("world_size", 2), "ranks is not a list of world_size (2)"),
    "ranks not a list": (lambda d: d.__setitem__("ranks", d["ranks"][0]), "ranks is not a list"),
    "a rank not an object": (lambda d: d.__setitem__("ranks", [[]]), "ranks[0] is not an object"),
    "files a list": (lambda d: d.__setitem__("files", [DATA]), "files is not an object"),
    "file size a string": (lambda d: d["files"].__setitem__(DATA, "384"), "not a non-negative integer"),
    "file size a float": (lambda d: d["files"].__setitem__(DATA, 384.0), "not a non-negative integer"),
    "file size negative": (lambda d: d["files"].__setitem__(DATA, -1), "not a non-negative integer"),
    "metadata a list": (lambda d: d.__setitem__("metadata", [1]), "metadata is not an object"),
    "metadata a string": (lambda d: d.__setitem__("metadata", "x"), "metadata is not an object"),
    "replicated a list": (lambda d: d.__setitem__("replicated", []), "replicated is not an object"),
    "sharded a string": (lambda d: d.__setitem__("sharded", "none"), "sharded is not an object"),
    "take_id a number": (lambda d: d.__setitem__("take_id", 5), "take_id is not a string"),
    "version a string": (lambda d: d.__setitem__("version", "1"), "version '1' is not a positive integer"),
    "files missing": (lambda d: d.pop("files"), "field 'files' is missing"),
    "ranks missing": (lambda d: d.pop("ranks"), "field 'ranks' is missing"),
    "not an object": (lambda d: (d.clear(), d.__setitem__("format", "other")), "is not a ppe-snapshot manifest"),
}


@pytest.mark.parametrize("case", list(DOCUMENT_DAMAGE))
def test_malformed_document(small, case):
    mutate, reason = DOCUMENT_DAMAGE[case]
    craft(small, mutate)
    readers = {**READERS, "metadata": lambda p: Snapshot(p).metadata}
    _refused_everywhere(small, "manifest.json", reason, readers=readers)


def test_a_manifest_that_is_a_json_array(small):
    (small / "manifest.json").write_text("[1, 2]")
    _refused_everywhere(small, "is not a ppe-snapshot manifest")


ENTRY_DAMAGE = {
    "string offset": (_chunk("offset", "0"), "offset '0' or nbytes 48 is not a non-negative integer"),
    "float nbytes": (_chunk("nbytes", 48.0), "nbytes 48.0"),
    "boolean offset": (_chunk("offset", False), "offset False"),
    "negative nbytes": (_chunk("nbytes", -48), "nbytes -48"),
    "checksum a number": (_chunk("checksum", 12), "checksum is not a string"),
    "file a list": (_chunk("file", [DATA]), "wrong type"),
    "chunk missing a field": (lambda e: e["chunks"][0].pop("checksum"), "field 'checksum' is missing"),
    "chunk not an object": (_set("chunks", [[DATA, 0, 48, "x"]]), "wrong type"),
    "chunks an object": (_set("chunks", {"file": DATA}), "chunks is not a list"),
    "string shape": (_set("shape", "[3, 4]"), "is not a list of sizes"),
    "shape of strings": (_set("shape", ["3", "4"]), "is not a list of non-negative integers"),
    "negative dimension": (_set("shape", [-3, -4]), "non-negative"),
    "dtype a number": (_set("dtype", 5), "unknown tensor dtype 5"),
    "dtype unknown": (_set("dtype", "float99"), "unknown tensor dtype 'float99'"),
    "dtype unhashable": (_set("dtype", ["float32"]), "wrong type"),
    "kind unknown": (_set("kind", "matrix"), "kind 'matrix'"),
    "replicated a string": (_set("replicated", "yes"), "replicated is not a boolean"),
    "unknown field": (_set("strides", [4, 1]), "unknown fields ['strides']"),
    "type unknown": (_set("type", "tensor2"), "its type 'tensor2' is not a known entry type"),
    "type missing": (lambda e: e.pop("type"), "its type None"),
    "shape missing": (lambda e: e.pop("shape"), "field 'shape' is missing"),
}


@pytest.mark.parametrize("case", list(ENTRY_DAMAGE))
def test_malformed_tensor_entry(small, case):
    mutate, reason = ENTRY_DAMAGE[case]
    craft(small, lambda doc: mutate(entry(doc, "m/w")))
    _refused_everywhere(small, "'m/w' is malformed", reason)


CONTAINER_DAMAGE = {
    "kind unknown": (_set("kind", "set"), "container kind 'set'"),
    "keys an object": (_set("keys", {"w": 1}), "keys is not a list"),
    "a key a list": (_set("keys", ["w", [1]]), "a key is a list value, which cannot key a dict"),
    "a key a tuple holding a list": (_set("keys", [{"$tuple": [1, [2]]}]), "a key is a tuple value"),
    "a key a dict": (_set("keys", [{"$dict": [["a", 1]]}]), "a key is a dict value"),
    "a key malformed": (_set("keys", [{"$nosuchtag": 1}]), "unknown value tag"),
    "length negative": (_set("length", -1), "length -1"),
    "length a string": (_set("length", "3"), "length '3'"),
    "not an object": (lambda e: e.clear(), "its type None"),
}


@pytest.mark.parametrize("case", list(CONTAINER_DAMAGE))
def test_malformed_container_entry(small, case):
    mutate, reason = CONTAINER_DAMAGE[case]
    craft(small, lambda doc: mutate(entry(doc, "m")))
    _refused_everywhere(small, "'m' is malformed", reason)


@pytest.mark.parametrize("how", ["entry removed", "key renamed"])
def test_a_child_entry_missing_is_refused_by_verify_too(small, how):
    """A container naming a child the manifest has no entry for: the readers that rebuild it refuse it, and so
    does verify (the quick one checks each entry alone, as before), which passed it."""
    if how == "entry removed":
        craft(small, lambda doc: doc["ranks"][0].pop("m/w"))
    else:
        craft(small, lambda doc: entry(doc, "m")["keys"].__setitem__(entry(doc, "m")["keys"].index("w"), "../w"))
    child = "'m/w'" if how == "entry removed" else "'m/..%2Fw'"
    for read in ("read_object", "restore", "verify"):
        with pytest.raises(CorruptSnapshotError, match="lists no entry") as info:
            READERS[read](str(small))
        assert child in str(info.value), (read, str(info.value))


@pytest.mark.parametrize("value, reason", [({"$nosuchtag": 1}, "unknown value tag '$nosuchtag'"),
                                           ({"$tuple": [1], "$list": [2]}, "malformed value")])
def test_a_value_that_does_not_decode_is_refused_by_verify_too(small, value, reason):
    craft(small, lambda doc: entry(doc, "m/step").__setitem__("value", value))
    for read in ("read_object", "verify"):
        with pytest.raises(CorruptSnapshotError, match="'m/step'") as info:
            READERS[read](str(small))
        assert reason in str(info.value), (read, str(info.value))
    Snapshot(str(small)).verify(deep=False)  # (the quick check: each entry's fields, not its value)


def test_a_state_saved_as_another_kind_than_its_target_is_a_mismatch(small):
    """The target's state_dict() is a dict, the snapshot's value under its key a string (a crafted root entry;
    or a state object whose state_dict() was not a dict): named, not dict.update's ValueError."""
    craft(small, lambda doc: doc["ranks"][0].__setitem__("m", {"type": "object", "value": "x"}))
    with pytest.raises(StateMismatchError, match=r"app_state\['m'\]: the snapshot holds a str value there, where "
                                                 r"the state_dict\(\) of the target is a dict"):
        Snapshot(str(small)).restore({"m": StateDict()})


def test_children_without_their_root_entry_are_damage_not_a_missing_key(small):
    craft(small, lambda doc: doc["ranks"][0].pop("m"))
    with pytest.raises(CorruptSnapshotError, match="entries under 'm' are listed, but no entry for 'm' itself"):
        Snapshot(str(small)).restore({"m": StateDict()})
    with pytest.raises(CorruptSnapshotError, match="is listed for rank 0, but not 'm', the container it would be in"):
        Snapshot(str(small)).verify()


def test_entry_that_is_not_an_object(small):
    craft(small, lambda doc: doc["ranks"][0].__setitem__("m/w", [1, 2]))
    _refused_everywhere(small, "'m/w' is malformed", "it is a JSON list")
    craft(small, lambda doc: doc["ranks"][0].__setitem__("m/w", None))
    _refused_everywhere(small, "'m/w' is malformed", "it is a JSON null")


def test_object_entry_without_value(small):
    craft(small, lambda doc: entry(doc, "m/step").pop("value"))
    _refused_everywhere(small, "'m/step' is malformed", "field 'value' is missing",
                        readers={n: r for n, r in READERS.items() if n != "restore_in_place"})


@pytest.mark.parametrize("long_integer", [False, True], ids=["orjson", "json"])
@pytest.mark.parametrize("where", ["metadata", "m/step"])
def test_deep_nesting_is_corrupt_not_recursion_error(small, where, long_integer):
    write_deep_manifest(small, where, 100_000, long_integer)
    _refused_everywhere(small, "nested too deeply", readers={**READERS, "metadata": lambda p: Snapshot(p).metadata})


def test_nesting_within_the_parser_limits_is_corrupt_when_rebuilt(small):
    """Containers nested 900 deep parse, but rebuilding them would overflow the stack: refused all the same."""
    def deepen(doc):
        ranks = doc["ranks"][0]
        path = "m/step"
        ranks["m/step"] = {"type": "container", "kind": "list", "keys": [], "length": 1}
        for _ in range(900):
            path += "/0"
            ranks[path] = {"type": "container", "kind": "list", "keys": [], "length": 1}
        ranks[path + "/0"] = {"type": "object", "value": 1}
    craft(small, deepen)
    for read in (lambda: Snapshot(str(small)).read_object("0/m"),
                 lambda: Snapshot(str(small)).restore({"m": StateDict()})):
        with pytest.raises(CorruptSnapshotError, match="nested too deeply"):
            read()


@pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable)")
def test_values_nested_within_the_parser_limits(small, capsys):
    """1,000 levels parse (orjson stops at 1,024) but are too deep to decode: refused, and inspect shows them."""
    write_deep_manifest(small, "m/step", 1000, long_integer=False)
    for read in (lambda: Snapshot(str(small)).read_object("0/m"),
                 lambda: Snapshot(str(small)).restore({"m": StateDict()})):
        with pytest.raises(CorruptSnapshotError, match="nested too deeply"):
            read()
    with pytest.raises(CheckpointException) as info:
        dcp.load({"m": {"step": 0}}, storage_reader=SnapshotStorageReader(str(small)))
    ((error, _trace),) = info.value.failures.values()
    assert isinstance(error, CorruptSnapshotError) and "'m/step'" in str(error) and "nested too deeply" in str(error)
    other = take_small(small.parent / "other")
    write_deep_manifest(other, "metadata", 1000, long_integer=False)
    assert main(["inspect", str(other)]) == 0
    assert "metadata <nested too deeply to show>" in capsys.readouterr().out


def _dcp_list(path: Path) -> Path:
    """A snapshot written through DCP of a list of two tensors (items ``a.0`` and ``a.1``)."""
    dcp.save({"a": [torch.ones(2), torch.zeros(2)]}, storage_writer=SnapshotStorageWriter(str(path)))
    return path


def _move_item(doc: dict[str, Any], old: str, new: str, obj_path: list) -> None:
    """Rename DCP item ``old`` to ``new`` and map it to ``obj_path`` in the planner data (tagged JSON)."""
    for section in (doc["ranks"][0], doc["replicated"]):
        if old in section:
            section[new] = section.pop(old)
    pairs = doc["metadata"]["dcp"]["planner_data"]["$dict"]
    doc["metadata"]["dcp"]["planner_data"]["$dict"] = [
        [new, {"$tuple": obj_path}] if key == old else [key, value] for key, value in pairs]


@pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable)")
@pytest.mark.parametrize("new, obj_path, message", [
    ("a.1", ["a", 10 ** 9], "maps 'a.1' to ('a', 1000000000), not to the object path"),
    ("a.1000000000", ["a", 10 ** 9], "in lists of 1000000001 slots in all"),
    ("a.x", ["a", "x"], "do not make one state"),  # (a list at "a" given a key)
])
def test_convert_rebuilds_no_state_from_crafted_dcp_object_paths(tmp_path, capsys, new, obj_path, message):
    """The command line rebuilds a DCP checkpoint's state by the object paths in its planner data; crafted ones
    are refused before the rebuild pads a list to a crafted position (on the code before: 8 GB of None)."""
    path = craft(_dcp_list(tmp_path / "s"), lambda doc: _move_item(doc, "a.1", new, obj_path))
    assert main(["convert", str(path), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert "CorruptSnapshotError" in err and message in err, err
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable)")
def test_convert_of_a_dcp_dict_keyed_by_large_integers(tmp_path):
    """A dict keyed by integers (steps) is rebuilt as a list as long as its highest key: within the bound, read
    (its keys as strings: what plain DCP keeps of them)."""
    dcp.save({"loss": {5000: torch.ones(1), 90_000: torch.zeros(1)}},
             storage_writer=SnapshotStorageWriter(str(tmp_path / "s")))
    assert main(["convert", str(tmp_path / "s"), str(tmp_path / "out.pt")]) == 0
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    assert sorted(loaded["loss"], key=int) == ["5000", "90000"] and torch.equal(loaded["loss"]["90000"], torch.zeros(1))


def test_newer_version_stays_unsupported_format(small):
    craft(small, lambda doc: doc.__setitem__("version", 4))
    with pytest.raises(UnsupportedFormatError, match="upgrade"):
        Snapshot(str(small)).get_manifest()


def test_cli_verify_reports_each_malformed_snapshot_and_goes_on(tmp_path, capsys):
    good = take_small(tmp_path / "good")
    bad_type = craft(take_small(tmp_path / "bad_type"), lambda doc: doc.__setitem__("metadata", "x"))
    bad_entry = craft(take_small(tmp_path / "bad_entry"), lambda doc: entry(doc, "m/w").__setitem__("shape", [6, 4]))
    deep = take_small(tmp_path / "deep")
    write_deep_manifest(deep, "metadata", 100_000, long_integer=True)
    for quick in ([], ["--quick"]):
        assert main(["verify", *quick, str(bad_type), str(good), str(bad_entry), str(deep)]) == 1
        out = capsys.readouterr().out
        assert f"DAMAGED {bad_type}: {bad_type}/manifest.json is malformed: metadata is not an object" in out
        assert f"OK      {good}" in out
        assert f"DAMAGED {bad_entry}: " in out and "'m/w' is malformed" in out
        assert f"DAMAGED {deep}: " in out and "nested too deeply" in out
        assert "Traceback" not in out


def test_ndarray_entry_reads_back_as_saved(small):
    """An ndarray entry restores as saved (the checks do not change what a valid snapshot gives back)."""
    state = Snapshot(str(small)).read_object("0/m")
    assert state["n"].dtype == np.int32 and state["n"].tolist() == list(range(6))
    assert read_doc(small)["files"][DATA] % 64 == 0
