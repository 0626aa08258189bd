"""Values stored without pickle (Enum, namedtuple, dataclass, torch.Size, sets), and decoding of crafted values.

A manifest is untrusted input: decoding a value may only construct classes the
process has already imported, of the kind the tag says, and any malformed
value gives ``CorruptSnapshotError``.
"""
from __future__ import annotations

import base64
import json
import collections
import dataclasses
import enum
import os
import sys
from typing import NamedTuple

import numpy as np
import pytest
import torch

from _asserts import manifest_doc
import ppe_snapshot
from ppe_snapshot import CorruptSnapshotError, Snapshot, StateDict, UnsupportedValueError
from ppe_snapshot.engine._format.manifest import ObjectEntry, PickleEntry
from ppe_snapshot.engine._format.serialization import decode_value, encode_value


class Color(enum.Enum):
    RED = "red"
    GREEN = (0, 255, 0)


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Mode(str, enum.Enum):
    TRAIN = "train"


class Perm(enum.Flag):
    R = 4
    W = 2


Pair = collections.namedtuple("Pair", ["first", "second"])


class Span(NamedTuple):
    start: int
    stop: int = -1


@dataclasses.dataclass
class Config:
    lr: float
    name: str
    betas: tuple = (0.9, 0.999)
    level: Level = Level.LOW
    span: Span = Span(0, 10)


@dataclasses.dataclass(frozen=True)
class Frozen:
    shape: torch.Size
    tags: frozenset


@dataclasses.dataclass(slots=True)
class Slotted:
    x: int
    y: list


class Outer:
    @dataclasses.dataclass
    class Inner:
        v: int


def _values() -> dict:
    return {
        "color": Color.GREEN, "level": Level.HIGH, "perm": Perm.W, "mode": Mode.TRAIN,
        "pair": Pair(1, "b"), "span": Span(3), "spans": [Span(1, 2), Span(3, 4)],
        "config": Config(0.1, "adam", level=Level.HIGH), "frozen": Frozen(torch.Size([2, 3]), frozenset({"a", 1})),
        "slotted": Slotted(1, [2, {"k": Color.RED}]), "inner": Outer.Inner(5),
        "size": torch.Size([4, 5]), "set": {1, 2.5, "x", Color.RED}, "frozenset": frozenset({(1, 2)}),
        "keyed": {Color.RED: 1, Level.LOW: Pair(0, 0)},
    }


def _assert_same(actual, expected, where="value"):
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    assert actual == expected, where
    if dataclasses.is_dataclass(expected):
        for f in dataclasses.fields(expected):
            _assert_same(getattr(actual, f.name), getattr(expected, f.name), f"{where}.{f.name}")
    elif isinstance(expected, (tuple, list)):
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_same(a, e, f"{where}[{i}]")
    elif isinstance(expected, dict):
        for key in expected:
            _assert_same(actual[key], expected[key], f"{where}[{key!r}]")


def test_common_types_round_trip_without_pickle(tmp_path):
    path = str(tmp_path / "s")
    Snapshot.take(path, {"s": StateDict(_values())})  # allow_pickle is off: none of them needs pickle
    manifest = Snapshot(path).get_manifest()
    assert not any(isinstance(e, PickleEntry) for e in manifest.values())
    assert isinstance(manifest["0/s/config"], ObjectEntry)
    fresh = StateDict()
    Snapshot(path).restore({"s": fresh})
    for key, value in _values().items():
        _assert_same(fresh[key], value, key)
    assert fresh["color"] is Color.GREEN and fresh["level"] is Level.HIGH  # members, not copies
    assert Snapshot(path).read_object("0/s/span") == Span(3, -1)


@pytest.mark.parametrize("value", [Color.RED, Pair([1], 2), Config(1.0, "x"), Slotted(1, [2]), torch.Size([]),
                                   {Level.LOW}])
def test_encode_decode_inverse(value):
    _assert_same(decode_value(encode_value(value)), value)


def _local_classes():
    @dataclasses.dataclass
    class Local:
        a: int

    LocalTuple = collections.namedtuple("LocalTuple", "a")
    return Local(1), LocalTuple(1)


@pytest.mark.parametrize("value", [
    Config(1.0, torch.ones(1)),  # a field holding a tensor
    Pair(collections.Counter("ab"), 1),  # a dict subclass
    Perm.R | Perm.W,  # a combination of flags is no member
], ids=["tensor-field", "counter-in-namedtuple", "flag-combination"])
def test_values_that_still_need_pickle_name_the_path_and_the_opt_in(tmp_path, value):
    path = str(tmp_path / "s")
    with pytest.raises(UnsupportedValueError, match=r"s/extra/v: .*allow_pickle=True"):
        Snapshot.take(path, {"s": StateDict(extra={"v": value})})
    assert not os.path.exists(path)
    Snapshot.take(path, {"s": StateDict(extra={"v": value})}, allow_pickle=True)
    assert isinstance(Snapshot(path).get_manifest()["0/s/extra/v"], PickleEntry)
    fresh = StateDict()
    Snapshot(path, allow_pickle=True).restore({"s": fresh})
    assert fresh["extra"]["v"] == value


@pytest.mark.parametrize("value", _local_classes(), ids=["local-dataclass", "local-namedtuple"])
def test_local_classes_need_pickle_which_cannot_store_them_either(tmp_path, value):
    path = str(tmp_path / "s")
    with pytest.raises(UnsupportedValueError, match=r"s/extra/v: .*allow_pickle=True"):
        Snapshot.take(path, {"s": StateDict(extra={"v": value})})
    with pytest.raises(UnsupportedValueError, match=r"s/extra/v: .*cannot be pickled either"):
        Snapshot.take(path, {"s": StateDict(extra={"v": value})}, allow_pickle=True)
    assert not os.path.exists(path)


# -- tensors that cannot be stored as raw bytes -----------------------------------------

def _unstorable():
    return {
        "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
        "meta": torch.empty(3, device="meta"),
        "sparse": torch.eye(3).to_sparse(),
    }


@pytest.mark.parametrize("kind", ["nested", "meta", "sparse"])
def test_tensor_that_is_not_raw_bytes_is_refused_before_anything_is_written(tmp_path, kind):
    path = tmp_path / "snap"
    state = StateDict(big=torch.ones(1000), inner={"t": _unstorable()[kind]})
    with pytest.raises(UnsupportedValueError, match=r"s/inner/t: the tensor .*cannot be stored as raw bytes"):
        Snapshot.take(str(path), {"s": state})
    assert not path.exists()
    with pytest.raises(UnsupportedValueError, match="s/inner/t"):
        Snapshot.async_take(str(path), {"s": state})
    assert not path.exists()


def test_meta_tensor_is_refused_even_with_pickle(tmp_path):
    with pytest.raises(UnsupportedValueError, match="s/m: the tensor is a meta tensor, which holds no data"):
        Snapshot.take(str(tmp_path / "s"), {"s": StateDict(m=torch.empty(2, device="meta"))}, allow_pickle=True)
    assert not (tmp_path / "s").exists()


_IN_PLACE = "a restore loads into the target's memory in place"


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("size", [3, 1 << 19], ids=["small", "large"])  # loaded in bulk / one by one
@pytest.mark.parametrize("kind, problem", [
    ("meta", f"is a meta tensor, which holds no data: {_IN_PLACE}; materialize it first (e.g. with "
             "Module.to_empty(device=...))"),
    ("nested", f"is a nested tensor: {_IN_PLACE}; pass a dense tensor of that shape and dtype"),
    ("jagged", f"is a nested tensor: {_IN_PLACE}; pass a dense tensor of that shape and dtype"),
    ("sparse", f"has layout torch.sparse_coo: {_IN_PLACE}; pass a dense tensor of that shape and dtype"),
])
def test_a_target_without_plain_memory_is_a_mismatch_that_says_why(tmp_path, size, kind, problem):
    """A restore target with no plain strided memory to load into (a meta tensor of a model built on the meta
    device, a nested or sparse tensor) is named with its problem; a meta one is not left silently empty, a nested
    one (which has no shape) raises no internal error of torch's."""
    path = str(tmp_path / "s")
    saved = {"before": torch.ones(4), "t": torch.arange(size, dtype=torch.float32), "after": torch.ones(4)}
    Snapshot.take(path, {"s": StateDict(saved)})
    target = {
        "meta": lambda: torch.empty(size, device="meta"),
        "nested": lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(size - 2)]),
        "jagged": lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(size - 2)], layout=torch.jagged),
        "sparse": lambda: torch.zeros(size).to_sparse(),
    }[kind]()
    state = {"before": torch.zeros(4), "t": target, "after": torch.zeros(4)}
    with pytest.raises(ppe_snapshot.StateMismatchError) as e:
        Snapshot(path).restore({"s": StateDict(state)})
    assert str(e.value) == (f"s/t: the snapshot holds a tensor of shape [{size}] and dtype float32, but the "
                            f"restore target {problem}")
    assert state["t"] is target


@pytest.mark.parametrize("size", [3, 1 << 19], ids=["small", "large"])
@pytest.mark.parametrize("view", ["expand", "as_strided"])
def test_a_target_whose_elements_share_memory_is_a_mismatch_naming_it(tmp_path, size, view):
    """A view that writes one element in several places (``expand``, a zero stride) cannot hold a saved tensor:
    named by its path before anything is read into it, not torch's RuntimeError of the copy."""
    path = str(tmp_path / "s")
    Snapshot.take(path, {"s": StateDict(before=torch.ones(4), t=torch.arange(size, dtype=torch.float32))})
    base = torch.zeros(size)
    target = base[:1].expand(size) if view == "expand" else base.as_strided((size,), (0,))
    state = {"before": torch.zeros(4), "t": target}
    with pytest.raises(ppe_snapshot.StateMismatchError, match=r"^s/t: the restore target's elements share memory "
                       r"\(a view made by expand\(\), or with a zero stride\): a restore loads into the target's "
                       r"memory in place; pass a tensor of its own \(e\.g\. its clone\(\)\)$"):
        Snapshot(path).restore({"s": StateDict(state)})
    assert torch.equal(base, torch.zeros(size))


# -- crafted values: only already-imported classes of the tagged kind -----------------------

def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize("encoded", [
    {"$enum": ["os", "system", "x"]},
    {"$namedtuple": ["os", "system", []]},
    {"$dataclass": ["os", "system", []]},
    {"$dataclass": ["builtins", "eval", [["source", "1"]]]},
    {"$namedtuple": ["subprocess", "Popen", [["ls"]]]},
    {"$dataclass": ["os", "path.join", []]},
    {"$enum": ["collections", "OrderedDict.__class__", "x"]},
    {"$enum": ["enum", "Enum", "x"]},  # an Enum class, but no such member
    {"$enum": [__name__, "Color", "BLUE"]},
    {"$enum": [__name__, "Color", "__class__"]},
    {"$namedtuple": [__name__, "Color", ["red"]]},  # of another kind than the tag says
    {"$dataclass": [__name__, "Pair", [["first", 1]]]},
    {"$namedtuple": [__name__, "Pair", [1, 2, 3]]},  # wrong length
    {"$dataclass": [__name__, "Config", [["lr", 1.0]]]},  # missing field
    {"$dataclass": [__name__, "Slotted", [["x", 1], ["y", []], ["x", 2]]]},  # a field twice
    {"$dataclass": [__name__, "Config", [["lr", 1.0], ["name", "x"], ["betas", []], ["level", 1],
                                         ["span", []], ["evil", 1]]]},
    {"$enum": [__name__, "<locals>.X", "A"]},
    {"$enum": [5, "Color", "RED"]},
    {"$enum": [__name__, "Color"]},
])
def test_crafted_class_tags_are_refused(encoded):
    with pytest.raises(CorruptSnapshotError):
        decode_value(encoded)


def test_a_module_the_process_has_not_imported_is_never_imported():
    for module in ("this", "antigravity", "ppe_snapshot_no_such_module"):
        assert module not in sys.modules
        for tag in ("$enum", "$namedtuple", "$dataclass"):
            with pytest.raises(CorruptSnapshotError, match=rf"'{module}'.*not imported"):
                decode_value({tag: [module, "Anything", []]})
        assert module not in sys.modules


def test_crafted_manifest_entry_naming_os_system_is_refused_on_restore(tmp_path):
    path = tmp_path / "s"
    Snapshot.take(str(path), {"s": StateDict(v=Color.RED)})
    manifest = json.dumps(manifest_doc(path))  # the version-1 layout, written back as such
    assert f'"$enum":["{__name__}","Color","RED"]' in manifest.replace(" ", "")
    crafted = manifest.replace(f'"{__name__}"', '"os"').replace('"Color"', '"system"')
    (path / "manifest.json").write_text(crafted)
    with pytest.raises(CorruptSnapshotError, match="os.system"):
        Snapshot(str(path)).restore({"s": StateDict()})


# -- malformed values: CorruptSnapshotError, nothing else ------------------------------------

def _deep(levels: int, wrap) -> object:
    value: object = 1
    for _ in range(levels):
        value = wrap(value)
    return value


@pytest.mark.parametrize("encoded", [
    {"$dtype": "nn"}, {"$dtype": "manual_seed"}, {"$dtype": 5}, {"$dtype": "Tensor"},
    {"$device": "nowhere"}, {"$device": 3},
    {"$float": "1e400x"}, {"$float": 1.5}, {"$float": "0.1"},
    {"$tuple": 5}, {"$tuple": "abc"}, {"$size": ["a"]}, {"$size": [-1]}, {"$size": 3},
    {"$dict": [[1]]}, {"$dict": [[[1], 2]]}, {"$dict": 5}, {"$odict": [1, 2]},
    {"$set": [[1]]}, {"$frozenset": 7},
    {"$bytes": "!!notbase64"}, {"$bytes": 12}, {"$bytes": "QUJ"},
    {"$complex": [1.0]}, {"$complex": ["a", "b"]}, {"$complex": 3},
    {"$npscalar": ["<f8", _b64(b"abc")]}, {"$npscalar": ["|O", _b64(bytes(8))]}, {"$npscalar": ["nope", ""]},
    {"$npscalar": "x"},
    {"$ndarray": ["|O", [1], _b64(bytes(8))]}, {"$ndarray": ["<f4", [3], _b64(bytes(4))]},
    {"$ndarray": ["<f4", [2, "x"], _b64(bytes(8))]}, {"$ndarray": ["<f4", 2, _b64(bytes(8))]},
    {"$ndarray": ["<f4", [2**62, 2**62], ""]}, {"$ndarray": [1, [1], ""]}, {"$ndarray": ["<f4", [1]]},
    {"$unknown": 1}, {"a": 1, "b": 2}, {},
], ids=repr)
def test_malformed_values_raise_corrupt_snapshot_error(encoded):
    with pytest.raises(CorruptSnapshotError):
        decode_value(encoded)


@pytest.mark.parametrize("wrap", [lambda v: [v], lambda v: {"$tuple": [v]}, lambda v: {"$dict": [[1, v]]},
                                  lambda v: {"$set": [{"$frozenset": [v]}]}], ids=["list", "tuple", "dict", "set"])
def test_deep_nesting_is_corrupt_not_a_recursion_error(wrap):
    with pytest.raises(CorruptSnapshotError, match="nested too deeply"):
        decode_value(_deep(100_000, wrap))


def test_non_json_types_are_refused():
    for value in ({1, 2}, b"x", object()):
        with pytest.raises(CorruptSnapshotError):
            decode_value(value)


def test_valid_tags_still_decode():
    assert decode_value({"$dtype": "float32"}) is torch.float32
    assert decode_value({"$dtype": "qint8"}) is torch.qint8  # every torch dtype, not only raw-storable ones
    assert decode_value({"$float": "-inf"}) == float("-inf")
    array = np.arange(6, dtype=">i2").reshape(2, 3)
    decoded = decode_value(encode_value(array))
    assert decoded.dtype == array.dtype and decoded.tobytes() == array.tobytes() and decoded.shape == (2, 3)
    assert ppe_snapshot.engine._format.serialization.MAX_DEPTH >= 100
    nested = _deep(50, lambda v: [v])
    assert decode_value(nested) == nested


def test_deeply_nested_containers_in_a_manifest_are_corrupt(tmp_path):
    """A crafted manifest whose containers chain 5,000 levels deep (deeper than Python's stack)."""
    import json

    path = tmp_path / "s"
    Snapshot.take(str(path), {"s": StateDict(x=[[1, torch.ones(1)]])})
    doc = manifest_doc(path)  # the version-1 layout, written back as such
    entries = doc["ranks"][0]
    entries["s"] = {"type": "container", "kind": "dict", "keys": ["x"], "length": 0}
    chain = "s/x"
    for _ in range(5_000):
        entries[chain] = {"type": "container", "kind": "list", "keys": [], "length": 1}
        chain += "/0"
    entries[chain] = {"type": "object", "value": 1}
    (path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CorruptSnapshotError, match="nested too deeply"):
        Snapshot(str(path)).restore({"s": StateDict()})
    with pytest.raises(CorruptSnapshotError, match="nested too deeply"):
        Snapshot(str(path)).read_object("0/s/x")


@pytest.mark.parametrize("wrap", [lambda v: [v], lambda v: (v,), lambda v: {"k": v}, lambda v: Pair(v, 0)],
                         ids=["list", "tuple", "dict", "namedtuple"])
def test_what_a_reader_would_refuse_as_too_deep_is_not_written(tmp_path, wrap):
    from ppe_snapshot.engine._format.serialization import MAX_DEPTH

    fits = _deep(MAX_DEPTH - 1, wrap)
    assert decode_value(encode_value(fits)) == fits
    path = tmp_path / "s"
    with pytest.raises(UnsupportedValueError, match=rf"s/v: .*deeper than {MAX_DEPTH} levels"):
        Snapshot.take(str(path), {"s": StateDict(v=Config(1.0, "x", betas=_deep(MAX_DEPTH + 5, wrap)))})
    assert not path.exists()
