"""Format version 2 as untrusted input: crafted index files and manifests are refused (docs/format.md, sections 8
and 11), and version 1 snapshots written by this code keep reading, and upgrade.

The index files are read and rewritten here from the format document alone (magic, header length, JSON header,
padding, the columns in their documented order, the xxh3_64 of everything before): a crafted file carries a
checksum that matches, as a hostile writer's would.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from _asserts import assert_same, written_as
from _crafted import ARRAY, BIAS, BOTTOM, RANK0, TOP, WEIGHT, craft, craft_index, make_sharded, read_index, take_small
from ppe_snapshot import CorruptSnapshotError, RNGState, Snapshot, StateDict, UnsupportedFormatError
from ppe_snapshot.cli import main
from ppe_snapshot.engine import read_manifest, upgrade_snapshot
from ppe_snapshot.engine.codec import check_structure
from ppe_snapshot.storage import open_storage

def row(header: dict[str, Any], tensor: str) -> int:
    return header["tensors"].index(tensor)


def _first_chunk(header: dict[str, Any], cols: dict[str, np.ndarray], tensor: str) -> int:
    i = row(header, tensor)
    return 0 if i == 0 else int(cols["tensor_chunk_end"][i - 1])


@pytest.fixture
def small(tmp_path) -> Path:
    """The small snapshot of _crafted, written as format version 2."""
    return take_small(tmp_path / "s")


def _reads(path: Path) -> None:
    """What a reader does first: restore the whole state without targets (allocates from the index)."""
    Snapshot(str(path)).read_object("0/m")


def _set(cols, name, index, value):
    cols[name][index] = value


CRAFTED = {
    "a stale index of another take": (lambda h, c: h.__setitem__("take_id", "0123456789abcdef"),
                                      "belongs to take '0123456789abcdef'"),
    "another rank's index": (lambda h, c: h.__setitem__("rank", 1), "rank 1"),
    "a file name leaving the snapshot": (lambda h, c: h["files"][0].__setitem__(0, "../outside.bin"),
                                         "not a normalised relative path"),
    "an absolute file name": (lambda h, c: h["files"][0].__setitem__(0, "/etc/passwd"),
                              "not a normalised relative path"),
    "a file size not a count": (lambda h, c: h["files"][0].__setitem__(1, -1), "files is not a list"),
    "a chunk beyond its file": (lambda h, c: _set(c, "chunk_offset", 0, 1 << 40), "beyond its recorded size"),
    "a negative offset": (lambda h, c: _set(c, "chunk_offset", 0, -64), "negative or out of range"),
    "a chunk naming no listed file": (lambda h, c: _set(c, "chunk_file", 0, 7), "beyond the file table"),
    "a doubled shape": (lambda h, c: _set(c, "dims", 0, 2 * int(c["dims"][0])), "need"),
    "a shape claiming 4 TiB": (lambda h, c: _set(c, "dims", 0, 1 << 40), "need"),
    "a shape overflowing 64 bits": (lambda h, c: c["dims"].__setitem__(slice(0, 2), 1 << 55), "need"),
    "a negative size": (lambda h, c: _set(c, "dims", 0, -3), "negative or out-of-range"),
    "an unknown torch dtype": (lambda h, c: h["dtypes"][0].__setitem__(1, "float99"), "float99"),
    "an object numpy dtype": (lambda h, c: h["dtypes"].__setitem__(
        int(c["tensor_dtype"][row(h, "m/n")]), ["ndarray", "|O8"]), "plain data"),
    "a dtype id beyond the table": (lambda h, c: _set(c, "tensor_dtype", 0, 99), "beyond the dtype table"),
    "chunk ranges out of order": (lambda h, c: _set(c, "tensor_chunk_end", 0, 5), "not consecutive"),
    "a path listed twice": (lambda h, c: h["tensors"].__setitem__(1, h["tensors"][0]), "distinct paths"),
    "a tensor also among the other entries": (lambda h, c: h["entries"].__setitem__(h["tensors"][0],
                                                                                  {"type": "object", "value": 1}),
                                              "other than the tensors'"),
    "ndim not matching the dims": (lambda h, c: _set(c, "tensor_ndim", 0, 3), "do not add up"),
    "a header that is not an object": (lambda h, c: h.clear(), "belongs to take None"),
    "an entry that is JSON null": (lambda h, c: h["entries"].__setitem__("m/step", None),
                                   "entry 'm/step' is malformed: it is a JSON null, not an object"),
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_crafted_rank_index_is_refused(small, name):
    mutate, message = CRAFTED[name]
    craft_index(small, mutate)
    with pytest.raises(CorruptSnapshotError, match=message):
        _reads(small)
    with pytest.raises(CorruptSnapshotError):
        Snapshot(str(small)).verify(deep=False)


@pytest.mark.parametrize("damage", ["checksum", "magic", "truncated", "empty", "column count", "header json"])
def test_damaged_index_file_is_refused(small, damage):
    file = small / RANK0
    data = bytearray(file.read_bytes())
    if damage == "checksum":
        data[40] ^= 0xFF
    elif damage == "magic":
        data[:8] = b"NOTANIDX"
    elif damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    if damage == "column count":
        craft_index(small, lambda h, c: h["columns"].__setitem__("dims", 10_000), fix_counts=False)
    elif damage == "header json":
        head = b"{not json"
        body = struct.pack("<8sQ", b"PPESIDX2", len(head)) + head + bytes((-(16 + len(head))) % 8)
        file.write_bytes(body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)))
    else:
        file.write_bytes(bytes(data))
    with pytest.raises(CorruptSnapshotError, match="index"):
        _reads(small)


def test_missing_index_file_is_refused(small):
    os.remove(small / RANK0)
    with pytest.raises(CorruptSnapshotError, match="index file index/rank0.idx is missing"):
        _reads(small)


@pytest.mark.parametrize("name", [RANK0, "index/shared.idx", "manifest.json"])
def test_metadata_file_that_links_out_of_the_snapshot_is_refused(small, tmp_path, name):
    """An index file or manifest that is a symbolic link to a file outside the snapshot is never read, even a
    copy of the right bytes."""
    outside = tmp_path / "outside-copy"
    shutil.copyfile(small / name, outside)
    os.remove(small / name)
    os.symlink(outside, small / name)
    with pytest.raises(CorruptSnapshotError, match="outside the snapshot directory") as info:
        Snapshot(str(small)).verify(deep=False)  # reads every index
    assert name in str(info.value)


def test_malformed_other_entry_is_refused_when_used(small):
    craft_index(small, lambda h, c: h["entries"]["m/step"].__setitem__("type", "bogus"))
    with pytest.raises(CorruptSnapshotError, match="'m/step' is malformed"):
        _reads(small)
    with pytest.raises(CorruptSnapshotError, match="'m/step' is malformed"):
        Snapshot(str(small)).verify(deep=False)


def test_inflated_file_size_is_checked_against_the_disk_before_allocating(small):
    """Index sizes say 4 TiB; the data file is small: refused before a 4 TiB tensor is allocated."""
    def inflate(h, c):
        h["files"][0][1] = 1 << 42
        c["dims"][row(h, "m/w") * 0:2] = [1 << 20, 1 << 20]  # m/w is the first tensor: [3, 4] -> [2^20, 2^20]
        c["chunk_nbytes"][_first_chunk(h, c, "m/w")] = (1 << 40) * 4
    header, _ = read_index(small / RANK0)
    assert header["tensors"][0] == "m/w"
    craft_index(small, inflate)
    with pytest.raises(CorruptSnapshotError, match="missing or truncated"):
        Snapshot(str(small)).read_object("0/m/w")


@pytest.mark.parametrize("field, value, error", [
    ("take_id", None, CorruptSnapshotError), ("take_id", "", CorruptSnapshotError),
    ("world_size", 0, CorruptSnapshotError), ("world_size", "1", CorruptSnapshotError),
    ("metadata", [1], CorruptSnapshotError), ("version", 4, UnsupportedFormatError),
    ("version", 3, CorruptSnapshotError)])  # version 3 (incremental) needs its references
def test_crafted_top_level_manifest_is_refused(small, field, value, error):
    doc = json.loads((small / "manifest.json").read_text())
    assert doc["version"] == 2 and "ranks" not in doc and "files" not in doc
    doc[field] = value
    (small / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(error):
        _reads(small)


def test_a_container_naming_a_child_without_an_entry_is_refused_by_verify(small):
    craft_index(small, lambda h, c: h["entries"]["m"]["keys"].__setitem__(h["entries"]["m"]["keys"].index("w"),
                                                                          "/etc/passwd"))
    with pytest.raises(CorruptSnapshotError, match=r"'m' refers to 'm/%2Fetc%2Fpasswd', which the manifest lists "
                                                   r"no entry of for rank\(s\) \[0\]; the snapshot is damaged"):
        Snapshot(str(small)).verify()  # (the quick check, verify(deep=False), checks each entry alone)
    with pytest.raises(CorruptSnapshotError, match="lists no entry for 'm/%2Fetc%2Fpasswd'"):
        _reads(small)


def test_a_dict_naming_a_key_twice_is_refused_not_rebuilt_one_child_short(small):
    """The dict 'm' naming 'w' twice and 'b' no more: the readers built it without 'b' (autoload resumed an Adam
    optimizer without one parameter's state so); verify refuses 'm/b', which no container names."""
    craft_index(small, lambda h, c: h["entries"]["m"]["keys"].__setitem__(h["entries"]["m"]["keys"].index("b"), "w"))
    target = {"m": StateDict(w=torch.zeros(3, 4), b=torch.zeros(4, dtype=torch.float64))}
    for read in (lambda: _reads(small), lambda: Snapshot(str(small)).restore(target)):
        with pytest.raises(CorruptSnapshotError, match="the dict at 'm' names a key twice in the manifest"):
            read()
    with pytest.raises(CorruptSnapshotError, match="'m/b' is listed for rank 0, but 'm', the container it lies in, "
                                                   "does not name it as a child"):
        Snapshot(str(small)).verify()


@pytest.mark.parametrize("section", ["rank", "shared"])
def test_an_entry_its_container_does_not_name_is_refused_by_verify(small, section):
    """A key dropped from a container, its entry left: a restore rebuilds the container without it (as a
    consistent snapshot without that entry would be); verify names the entry that no container names."""
    if section == "rank":
        craft_index(small, lambda h, c: h["entries"]["m"]["keys"].remove("b"))
        entry, where = "m/b", "rank 0"
    else:
        with written_as(2):
            Snapshot.take(str(small.parent / "r"), {"m": StateDict(a=torch.ones(2), b=[torch.ones(1), torch.ones(1)])},
                          replicated=["m/**"])
        small = small.parent / "r"
        craft_index(small, lambda h, c: h["entries"]["m/b"].__setitem__("length", 1), name="index/shared.idx")
        entry, where = "m/b/1", "the shared entries"
    with pytest.raises(CorruptSnapshotError, match=f"'{entry}' is listed for {where}, but "):
        Snapshot(str(small)).verify()


def test_a_list_of_a_crafted_length_sizes_nothing(small):
    """A list said to hold 2^22 children, none of them listed: refused as a missing child, without a path made
    for each of the children it claims (on the code before, verify made 4M paths, about 300 MB, first)."""
    craft_index(small, lambda h, c: h["entries"].__setitem__(
        "m/step", {"type": "container", "kind": "list", "keys": [], "length": 1 << 22}))
    tracemalloc.start()
    try:
        with pytest.raises(CorruptSnapshotError, match=r"'m/step' refers to 'm/step/0', which the manifest lists "
                                                       r"no entry of"):
            Snapshot(str(small)).verify()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    with pytest.raises(CorruptSnapshotError, match="lists no entry for 'm/step/0'"):
        _reads(small)


@pytest.mark.parametrize("world_size", [2, 1 << 31])
def test_index_of_a_world_larger_than_written_is_missing(small, world_size):
    """Even a world size that no list could hold: the first missing index is named, nothing sized by it."""
    doc = json.loads((small / "manifest.json").read_text())
    doc["world_size"] = world_size
    (small / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CorruptSnapshotError, match="index/rank1.idx is missing"):
        Snapshot(str(small)).verify(deep=False)


@pytest.mark.parametrize("world_size", [1 << 56, 1 << 63, 1 << 80])
def test_a_world_size_no_length_can_hold_is_refused(small, world_size):
    """From 2^56 up (2^63: more than Python's len() returns) a world size is refused as such, by every reader."""
    doc = json.loads((small / "manifest.json").read_text())
    doc["world_size"] = world_size
    (small / "manifest.json").write_text(json.dumps(doc))
    for read in (lambda: Snapshot(str(small)).get_manifest(), lambda: _reads(small),
                 lambda: Snapshot(str(small)).verify()):
        with pytest.raises(CorruptSnapshotError, match=f"world_size {world_size} is not a positive integer below"):
            read()


def test_the_structure_check_walks_a_crafted_world_one_rank_at_a_time(small):
    """The check of containers' children against the entries (deep verify, the CLI's verify) names the first
    missing index, with no table made for each rank first (on the code before, 2^20 of them: 566 MB traced)."""
    doc = json.loads((small / "manifest.json").read_text())
    doc["world_size"] = 1 << 20
    (small / "manifest.json").write_text(json.dumps(doc))
    manifest = read_manifest(open_storage(str(small)))
    tracemalloc.start()
    try:
        with pytest.raises(CorruptSnapshotError, match="index/rank1.idx is missing"):
            check_structure(manifest)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak


def test_an_incremental_snapshot_of_a_crafted_world_size_sizes_nothing(tmp_path, capsys):
    """What reads an incremental snapshot's references (``inspect``) walks its ranks' indexes one at a time too:
    the first missing one is named, no table made for each rank the manifest claims (on the code before, 2^20
    of them, 488 MB traced, first; 2^31 ran out of memory)."""
    Snapshot.take(str(tmp_path / "a"), {"m": StateDict(w=WEIGHT.clone())})
    Snapshot.take(str(tmp_path / "b"), {"m": StateDict(w=WEIGHT.clone(), step=1)}, base=str(tmp_path / "a"))
    doc = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert doc["version"] == 3
    doc["world_size"] = 1 << 20
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(doc))
    tracemalloc.start()
    try:
        assert main(["inspect", str(tmp_path / "b")]) == 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "index/rank1.idx is missing" in capsys.readouterr().err
    assert peak < 16 << 20, peak


def _generators() -> tuple:
    return torch.get_rng_state(), np.random.get_state()[1].tobytes(), random.getstate()


@pytest.mark.parametrize("generator, entry, mutate", [
    ("python", "rng/python/1", lambda e: e["value"]["$tuple"].pop()),  # a state vector one word short
    ("numpy", "rng/numpy/2", lambda e: e.__setitem__("value", "not a position")),  # (an integer in the key)
    # (numpy takes these, and its next draw reads past its 624 words: at 2^31 - 1 a segmentation fault)
    *[("numpy", "rng/numpy/2", lambda e, pos=pos: e.__setitem__("value", pos)) for pos in (625, -1, (1 << 31) - 1)]],
    ids=["python one word short", "numpy position a string", "numpy position 625", "numpy position -1",
         "numpy position 2^31-1"])
def test_crafted_rng_state_is_refused_before_any_generator_is_set(tmp_path, generator, entry, mutate):
    """The saved RNG state of one generator is one its generator refuses: damage (CorruptSnapshotError, which
    autoload skips for an older snapshot) naming it, and none of the generators is set (the torch one is set
    first when all are good)."""
    path = tmp_path / "s"
    Snapshot.take(str(path), {"rng": RNGState()})
    craft_index(path, lambda header, cols: mutate(header["entries"][entry]))
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    before = _generators()
    with pytest.raises(CorruptSnapshotError, match=f"RNG state: the {generator} generator refuses the saved state"):
        Snapshot(str(path)).restore({"rng": RNGState()})
    after = _generators()
    assert torch.equal(after[0], before[0]) and after[1:] == before[1:]


# -- sharded tensors in version 2 ---------------------------------------------------------------------

@pytest.fixture
def sharded(tmp_path) -> Path:
    """A version-2 snapshot whose rank 0 index holds the two shards of ``m/grid`` (_crafted.make_sharded,
    written as version 1 and upgraded)."""
    with written_as(1):
        old = craft(take_small(tmp_path / "v1"), make_sharded)
    upgrade_snapshot(open_storage(str(old)), open_storage(str(tmp_path / "v2")))
    return tmp_path / "v2"


def test_sharded_tensor_round_trips_through_the_upgrade(sharded):
    assert torch.equal(Snapshot(str(sharded)).read_object("0/m/grid"), torch.cat([TOP, BOTTOM]))
    header, cols = read_index(sharded / RANK0)
    assert [s[0] for s in header["sharded"]] == ["m/grid"] and len(cols["shard_tensor"]) == 2


@pytest.mark.parametrize("name, mutate, message", [
    ("a shard beyond the global shape", lambda h, c: _set(c, "shard_box", 0, 3), "does not lie within"),
    ("a shard of another size", lambda h, c: _set(c, "shard_box", 2, 1), "do not hold"),
    ("a shard of an unknown tensor", lambda h, c: _set(c, "shard_tensor", 0, 5), "beyond the table"),
    ("boxes left over", lambda h, c: c.__setitem__("shard_box", np.append(c["shard_box"], [0, 0])), "more than"),
    ("a sharded tensor listed twice", lambda h, c: h["sharded"].append(h["sharded"][0]), "listed twice"),
])
def test_crafted_shards_are_refused(sharded, name, mutate, message):
    craft_index(sharded, mutate)
    with pytest.raises(CorruptSnapshotError, match=message):
        Snapshot(str(sharded)).read_object("0/m/grid")


def test_shards_not_covering_the_tensor_are_refused(sharded):
    def drop_second(h, c):
        c["shard_tensor"], c["shard_box"] = c["shard_tensor"][:1], c["shard_box"][:4]
        c["shard_chunk_end"] = c["shard_chunk_end"][:1]
        for name in ("chunk_file", "chunk_offset", "chunk_nbytes", "chunk_checksum"):
            c[name] = c[name][: int(c["shard_chunk_end"][0])]
    craft_index(sharded, drop_second)
    with pytest.raises(CorruptSnapshotError, match="hold 8 of its 16 elements"):
        Snapshot(str(sharded)).read_object("0/m/grid")


# -- version 1 stays readable -------------------------------------------------------------------------

def test_version_1_snapshot_restores_verifies_and_upgrades(tmp_path):
    with written_as(1):
        old = take_small(tmp_path / "v1")
    doc = json.loads((old / "manifest.json").read_text())
    assert doc["version"] == 1 and "ranks" in doc and not (old / "index").exists()
    expected = {"w": WEIGHT, "b": BIAS, "n": ARRAY, "top": TOP, "bottom": BOTTOM, "step": 3}
    for path in (old, tmp_path / "v2"):
        if path != old:
            upgrade_snapshot(open_storage(str(old)), open_storage(str(path)))
            assert json.loads((path / "manifest.json").read_text())["version"] == 2
            assert (path / "data" / "rank0.bin").read_bytes() == (old / "data" / "rank0.bin").read_bytes()
        snap = Snapshot(str(path))
        snap.verify()
        got = snap.read_object("0/m")
        assert set(got) == set(expected) and got["step"] == 3 and np.array_equal(got["n"], ARRAY)
        assert_same({k: got[k] for k in ("w", "b", "top", "bottom")},
                    {k: expected[k] for k in ("w", "b", "top", "bottom")})
        target = StateDict(w=torch.zeros(3, 4), b=torch.zeros(4, dtype=torch.float64), n=None,
                           top=torch.zeros(2, 4), bottom=torch.zeros(2, 4), step=0)
        snap.restore({"m": target})
        assert torch.equal(target["w"], WEIGHT) and target["step"] == 3
        assert sorted(snap.get_manifest()) == ["0/m", "0/m/b", "0/m/bottom", "0/m/n", "0/m/step", "0/m/top",
                                               "0/m/w"]
    with pytest.raises(ValueError, match="already a self-contained version-2 snapshot"):
        upgrade_snapshot(open_storage(str(tmp_path / "v2")), open_storage(str(tmp_path / "v3")))
    shutil.rmtree(old)
