"""Single-process take -> restore round trips of every kind of value the engine stores.

Every comparison is bit-exact: tensors by dtype, shape and raw bytes (and
``torch.equal`` where torch implements it for the dtype), plain values by type
and value (``-0.0`` by sign, ``nan`` by being ``nan``).
"""
from __future__ import annotations

import collections
import math
import os
import random
import uuid
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from torch import nn

import ppe_snapshot
from ppe_snapshot import RNGState, Snapshot, StateDict
from ppe_snapshot.engine._format.manifest import ContainerEntry, ObjectEntry, TensorEntry
from ppe_snapshot.engine._format.serialization import _TORCH_DTYPES

# torch.equal is not implemented on CPU for these dtypes; their bytes are compared instead.
_NO_TORCH_EQUAL = {torch.complex32} | {d for n, d in _TORCH_DTYPES.items() if n.startswith("float8")}


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of ``t`` in row-major order."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(actual: Any, expected: Any, where: str = "value") -> None:
    """Recursive bit-exact equality, types included."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: shape {actual.shape} != {expected.shape}"
        assert tensor_bytes(actual) == tensor_bytes(expected), f"{where}: bytes differ"
        if expected.dtype not in _NO_TORCH_EQUAL:
            assert torch.equal(actual.detach(), expected.detach()), f"{where}: torch.equal is False"
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert actual.tobytes() == expected.tobytes(), f"{where}: bytes differ"
    elif isinstance(expected, np.generic):
        assert actual.dtype == expected.dtype and actual.tobytes() == expected.tobytes(), where
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for k in expected:
            assert_same(actual[k], expected[k], f"{where}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
    elif isinstance(expected, float):
        if math.isnan(expected):
            assert math.isnan(actual), where
        else:
            assert actual == expected and math.copysign(1, actual) == math.copysign(1, expected), where
    elif isinstance(expected, complex):
        assert_same(actual.real, expected.real, f"{where}.real")
        assert_same(actual.imag, expected.imag, f"{where}.imag")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def clone_state(value: Any) -> Any:
    """A deep copy of a state dict whose tensors are fresh clones."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return type(value)((k, clone_state(v)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(clone_state(v) for v in value)
    return value


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2))


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        optim.zero_grad()
        model(torch.randn(8, 6, generator=gen)).square().mean().backward()
        optim.step()


def _all_dtypes() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    out = {}
    for name, dtype in _TORCH_DTYPES.items():
        if dtype.is_floating_point or dtype.is_complex:
            source = torch.randn(3, 5, generator=gen)
            if name == "float8_e8m0fnu":  # only positive powers of two are representable
                source = source.abs() + 0.5
        else:
            source = torch.randint(0, 100, (3, 5), generator=gen)
        out[name] = source.to(dtype)
    return out


# -- modules, optimizers, schedulers ----------------------------------------------

def test_module_with_buffers_restores_in_place(tmp_path):
    model = _model()
    model.train()
    model(torch.randn(8, 6))  # moves the BatchNorm running stats and num_batches_tracked
    saved = clone_state(model.state_dict())
    assert saved["1.num_batches_tracked"].item() == 1
    Snapshot.take(str(tmp_path / "s"), {"model": model})

    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for t in model.state_dict().values():
            t.add_(3)
    Snapshot(str(tmp_path / "s")).restore({"model": model})

    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == ptrs
    assert_same(model.state_dict(), saved)
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("make_optim", [
    lambda params: torch.optim.Adam(params, lr=0.01, betas=(0.8, 0.95)),
    lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True),
], ids=["adam", "sgd-momentum"])
def test_optimizer_round_trip(tmp_path, make_optim):
    model = _model()
    optim = make_optim(model.parameters())
    _train(model, optim)
    saved_optim = clone_state(optim.state_dict())
    Snapshot.take(str(tmp_path / "s"), {"model": model, "optim": optim})

    fresh_model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2))
    fresh_optim = make_optim(fresh_model.parameters())
    Snapshot(str(tmp_path / "s")).restore({"model": fresh_model, "optim": fresh_optim})

    restored = fresh_optim.state_dict()
    assert_same(restored, saved_optim)
    if isinstance(optim, torch.optim.Adam):
        assert isinstance(restored["state"][0]["step"], torch.Tensor)
        assert restored["state"][0]["step"].item() == 3
    # Both continue identically.
    _train(model, optim, 2)
    _train(fresh_model, fresh_optim, 2)
    assert_same(fresh_model.state_dict(), model.state_dict())


def test_lr_scheduler_round_trip(tmp_path):
    model = nn.Linear(2, 2)
    optim = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    for _ in range(5):
        optim.step()
        sched.step()
    Snapshot.take(str(tmp_path / "s"), {"optim": optim, "sched": sched})

    optim2 = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.StepLR(optim2, step_size=2, gamma=0.5)
    Snapshot(str(tmp_path / "s")).restore({"optim": optim2, "sched": sched2})
    assert_same(sched2.state_dict(), sched.state_dict())
    assert sched2.get_last_lr() == sched.get_last_lr() == [0.25]
    assert optim2.param_groups[0]["lr"] == 0.25


# -- tensors --------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_every_dtype_round_trips(tmp_path):
    tensors = _all_dtypes()
    assert {"float8_e4m3fn", "float8_e5m2"} <= set(tensors)  # float8 is present in the torch we test on
    Snapshot.take(str(tmp_path / "s"), {"t": StateDict(tensors)})

    fresh = StateDict()  # no targets: new tensors
    Snapshot(str(tmp_path / "s")).restore({"t": fresh})
    assert_same(dict(fresh), tensors)

    zeros = StateDict({k: torch.zeros_like(v) for k, v in tensors.items()})  # targets: loaded in place
    ptrs = {k: v.data_ptr() for k, v in zeros.items()}
    Snapshot(str(tmp_path / "s")).restore({"t": zeros})
    assert_same(dict(zeros), tensors)
    assert {k: v.data_ptr() for k, v in zeros.items()} == ptrs


def test_special_tensors(tmp_path):
    base = torch.arange(24, dtype=torch.float32)
    shared = torch.arange(10, dtype=torch.int64)
    matrix = torch.randn(4, 6)
    leaf = torch.randn(3, requires_grad=True)
    state = StateDict(
        complex=torch.randn(4, dtype=torch.complex64),
        complex128=torch.randn(2, 2, dtype=torch.complex128),
        bool=torch.tensor([True, False, True]),
        empty=torch.empty(0, 3),
        empty_int=torch.empty(2, 0, dtype=torch.int16),
        scalar=torch.tensor(3.5),
        scalar_int=torch.tensor(-7, dtype=torch.int64),
        transposed=matrix.t(),
        stepped=base[1::3],
        columns=matrix[:, ::2],
        shared_a=shared[:6],
        shared_b=shared[4:],
        leaf=leaf,
        nonleaf=leaf * 2,
    )
    assert not state["transposed"].is_contiguous() and not state["columns"].is_contiguous()
    expected = {k: v.detach().clone() for k, v in state.items()}
    Snapshot.take(str(tmp_path / "s"), {"s": state})

    fresh = StateDict()
    Snapshot(str(tmp_path / "s")).restore({"s": fresh})
    assert_same({k: v for k, v in fresh.items()}, expected)
    # Shared storage is restored as values: the two tensors are independent now.
    fresh["shared_a"][5] = 100
    assert fresh["shared_b"][1].item() == 5

    # In place into the original objects, non-contiguous views and grad leaves included.
    with torch.no_grad():
        for v in state.values():
            if v.numel() and v.dtype != torch.bool:
                v.add_(1)
    Snapshot(str(tmp_path / "s")).restore({"s": state})
    assert_same({k: v.detach() for k, v in state.items()}, expected)
    assert state["leaf"] is leaf and leaf.requires_grad
    assert torch.equal(matrix.t(), expected["transposed"])  # the view was written through to its base


# -- containers and plain values ---------------------------------------------------

class Custom:
    """A value with no pickle-free encoding (a plain class: dataclasses of plain values need no pickle)."""

    def __init__(self, a: int, b: str) -> None:
        self.a, self.b = a, b

    def __eq__(self, other: object) -> bool:
        return type(other) is Custom and (self.a, self.b) == (other.a, other.b)


def _nested_state() -> dict[str, Any]:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    return {
        "nested": {"list": [t, {"inner": (t + 1, 3, "x")}, 4.5], "tuple": (t * 2, [t.int()])},
        7: t + 10,
        (1, "a"): t + 11,
        2.5: "float key",
        None: "none key",
        "a/b": t + 12,
        "a%2Fb": t + 13,
        "100%": t + 14,
        "ordered": collections.OrderedDict([("z", t + 15), ("a", 1)]),
        "empty_dict": {},
        "empty_list": [],
        "empty_tuple": (),
        "mixed_list": [1, "two", None, t + 16],
    }


def test_nested_containers_and_keys(tmp_path):
    state = _nested_state()
    Snapshot.take(str(tmp_path / "s"), {"s": StateDict(state)})
    fresh = StateDict()
    Snapshot(str(tmp_path / "s")).restore({"s": fresh})
    assert_same(dict(fresh), state)

    keys = set(Snapshot(str(tmp_path / "s")).get_manifest())
    assert {"0/s/a%2Fb", "0/s/a%252Fb", "0/s/100%25", "0/s/7", "0/s/nested/list/1/inner/0"} <= keys


def test_colliding_keys_are_rejected(tmp_path):
    with pytest.raises(ppe_snapshot.UnsupportedValueError, match="same path"):
        Snapshot.take(str(tmp_path / "s"), {"s": StateDict({1: torch.ones(1), "1": torch.zeros(1)})})
    assert not os.path.exists(tmp_path / "s" / "manifest.json")


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_a_key_no_tag_stores_is_refused_naming_its_dict(tmp_path, allow_pickle):
    class Key:
        pass
    state = {"s": StateDict(opt={"groups": {0: torch.ones(1), Key(): torch.zeros(1)}})}
    with pytest.raises(ppe_snapshot.UnsupportedValueError,
                       match=r"^s/opt/groups: a key of type test_engine_values\..*Key cannot be stored: dict keys .* "
                             r"never pickled, even with allow_pickle=True"):
        Snapshot.take(str(tmp_path / "s"), state, allow_pickle=allow_pickle)
    assert not os.path.exists(tmp_path / "s")


def test_numpy_values(tmp_path):
    rng = np.random.default_rng(3)
    arrays = {
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "f64": rng.standard_normal(5),
        "f16": rng.standard_normal(7).astype(np.float16),
        "i16": rng.integers(-1000, 1000, (2, 3), dtype=np.int16),
        "u64": np.array([0, 2**64 - 1], dtype=np.uint64),
        "bool": np.array([True, False]),
        "c64": (rng.standard_normal(3) + 1j * rng.standard_normal(3)).astype(np.complex64),
        "big_endian": np.arange(6, dtype=">i4").reshape(2, 3),
        "zero_d": np.array(2.5),
        "empty": np.zeros((0, 4), dtype=np.int32),
        "strided": np.arange(20, dtype=np.int64)[::3],
        "fortran": np.asfortranarray(rng.standard_normal((3, 2))),
    }
    scalars = {
        "sf32": np.float32(1.25), "sf64": np.float64(-0.0), "si8": np.int8(-5), "su32": np.uint32(7),
        "sbool": np.bool_(True), "sc128": np.complex128(1 - 2j),
    }
    state = StateDict({**arrays, **scalars})
    Snapshot.take(str(tmp_path / "s"), {"s": state})

    fresh = StateDict()
    Snapshot(str(tmp_path / "s")).restore({"s": fresh})
    assert_same(dict(fresh), {**arrays, **scalars})
    assert fresh["big_endian"].dtype == np.dtype(">i4")

    target = np.zeros((3, 4), dtype=np.float32)  # a fitting array target is filled in place
    into = StateDict(f32=target)
    Snapshot(str(tmp_path / "s")).restore({"s": into})
    assert into["f32"] is target and target.tobytes() == arrays["f32"].tobytes()


def test_plain_values(tmp_path):
    values = {
        "huge": 2**70 + 1, "huge_neg": -(2**80), "int": 42, "zero": 0,
        "float": 0.1, "nan": float("nan"), "inf": float("inf"), "ninf": float("-inf"), "negzero": -0.0,
        "str": "héllo / wörld ✓", "empty_str": "", "bytes": b"\x00\xff\x10", "none": None,
        "true": True, "false": False, "complex": complex(1.5, -2.0),
        "dtype": torch.bfloat16, "dtype8": torch.float8_e4m3fn, "device": torch.device("cpu"),
        "cuda_device": torch.device("cuda", 1), "size": torch.Size([2, 3]), "set": {1, "a", (2, 3)},
        "frozenset": frozenset({4, 5}), "tuple": (1, (2.0, "b"), None), "list": [1, [2, [3]]],
    }
    Snapshot.take(str(tmp_path / "s"), {"s": StateDict(values)})
    fresh = StateDict()
    Snapshot(str(tmp_path / "s")).restore({"s": fresh})
    assert_same(dict(fresh), values)


def test_rng_state(tmp_path):
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's state
    random.gauss(0, 1)  # and in Python's
    Snapshot.take(str(tmp_path / "s"), {"rng": RNGState()})
    expected = (torch.rand(4), np.random.rand(3), np.random.standard_normal(), random.random(), random.gauss(0, 1))

    torch.rand(100), np.random.rand(100), random.random()  # move every generator on
    Snapshot(str(tmp_path / "s")).restore({"rng": RNGState()})
    actual = (torch.rand(4), np.random.rand(3), np.random.standard_normal(), random.random(), random.gauss(0, 1))
    assert torch.equal(actual[0], expected[0])
    assert actual[1].tobytes() == expected[1].tobytes()
    assert actual[2:] == expected[2:]


# -- partial restore, read_object, manifest ----------------------------------------

def _model_and_adam(tmp_path) -> tuple[nn.Module, torch.optim.Optimizer, str]:
    model = nn.Linear(4, 3)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    _train_linear(model, optim)
    path = str(tmp_path / "s")
    Snapshot.take(path, {"model": model, "optim": optim})
    return model, optim, path


def _train_linear(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    for _ in range(2):
        optim.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        optim.step()


def test_subset_restore(tmp_path):
    model, _, path = _model_and_adam(tmp_path)
    fresh = nn.Linear(4, 3)
    Snapshot(path).restore({"model": fresh})
    assert_same(fresh.state_dict(), model.state_dict())


def test_get_manifest_keys(tmp_path):
    _, _, path = _model_and_adam(tmp_path)
    manifest = Snapshot(path).get_manifest()
    assert {"0/model", "0/model/weight", "0/model/bias", "0/optim", "0/optim/state/0/exp_avg",
            "0/optim/param_groups/0/lr"} <= set(manifest)
    weight = manifest["0/model/weight"]
    assert isinstance(weight, TensorEntry) and weight.dtype == "float32" and weight.shape == [3, 4]
    assert isinstance(manifest["0/optim/param_groups"], ContainerEntry)
    assert manifest["0/optim/param_groups/0/lr"] == ObjectEntry(0.01)
    assert all(k.startswith("0/") for k in manifest)


def test_read_object(tmp_path):
    model, optim, path = _model_and_adam(tmp_path)
    snap = Snapshot(path)

    assert_same(snap.read_object("0/model/weight"), model.weight.detach())
    assert_same(snap.read_object("model/bias"), model.bias.detach())  # the rank prefix is optional
    assert_same(snap.read_object("0/optim/state"), clone_state(optim.state_dict()["state"]))
    assert_same(snap.read_object("0/model"), clone_state(model.state_dict()))
    assert snap.read_object("0/optim/param_groups/0/lr") == 0.01
    assert snap.read_object("0/optim/param_groups/0/betas") == (0.9, 0.999)

    out = torch.empty(3, 4)
    ptr = out.data_ptr()
    result = snap.read_object("0/model/weight", obj_out=out)
    assert result is out and out.data_ptr() == ptr
    assert torch.equal(out, model.weight.detach())

    with pytest.raises(KeyError, match="get_manifest"):
        snap.read_object("0/model/nope")


# -- pickle opt-in ------------------------------------------------------------------

def test_value_needing_pickle_is_refused(tmp_path):
    path = str(tmp_path / "s")
    state = StateDict(w=torch.ones(2), extra={"obj": Custom(1, "x")})
    with pytest.raises(ppe_snapshot.UnsupportedValueError) as info:
        Snapshot.take(path, {"s": state})
    assert isinstance(info.value, TypeError)
    assert "s/extra/obj" in str(info.value) and "allow_pickle=True" in str(info.value)
    assert not os.path.exists(os.path.join(path, "manifest.json"))
    with pytest.raises(ppe_snapshot.SnapshotNotFoundError):
        Snapshot(path).restore({"s": StateDict()})

    Snapshot.take(path, {"s": state}, allow_pickle=True)
    fresh = StateDict()
    Snapshot(path, allow_pickle=True).restore({"s": fresh})
    assert fresh["extra"]["obj"] == Custom(1, "x")
    assert torch.equal(fresh["w"], torch.ones(2))


def test_pickled_entry_is_read_only_with_opt_in_on_the_read_side(tmp_path):
    path = str(tmp_path / "s")
    Snapshot.take(path, {"s": StateDict(w=torch.ones(2), obj=Custom(1, "x"))}, allow_pickle=True)
    for read in (lambda: Snapshot(path).restore({"s": StateDict()}),
                 lambda: Snapshot(path).read_object("0/s/obj"),
                 lambda: Snapshot(path, allow_pickle=True).read_object("0/s/obj", allow_pickle=False)):
        with pytest.raises(ppe_snapshot.UnsupportedValueError, match=r"'s/obj'.*allow_pickle=True"):
            read()
    assert Snapshot(path).read_object("0/s/obj", allow_pickle=True) == Custom(1, "x")
    fresh = StateDict()
    Snapshot(path).restore({"s": fresh}, allow_pickle=True)
    assert fresh["obj"] == Custom(1, "x")


# -- URLs and metadata --------------------------------------------------------------

def _round_trip_on(url: str) -> None:
    model = _model()
    Snapshot.take(url, {"model": model, "s": StateDict(x=torch.arange(5), note="hi")}, metadata={"step": 3})
    fresh = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2))
    into = StateDict()
    Snapshot(url).restore({"model": fresh, "s": into})
    assert_same(fresh.state_dict(), model.state_dict())
    assert_same(dict(into), {"x": torch.arange(5), "note": "hi"})
    assert Snapshot(url).metadata == {"step": 3}
    assert torch.equal(Snapshot(url).read_object("0/model/0.weight"), model[0].weight.detach())


def test_memory_url():
    url = f"memory://ppe-snapshot-test-{uuid.uuid4().hex}/snap"
    fs = fsspec.filesystem("memory")
    try:
        _round_trip_on(url)
        assert fs.exists(f"{url}/manifest.json") and fs.exists(f"{url}/data/rank0.bin")
    finally:
        fs.rm(url.rsplit("/", 1)[0], recursive=True)


def test_file_url(tmp_path):
    _round_trip_on(f"file://{tmp_path}/snap")
    assert os.path.isfile(tmp_path / "snap" / "manifest.json")
    assert os.path.isfile(tmp_path / "snap" / "data" / "rank0.bin")


def test_metadata(tmp_path):
    metadata = {"iteration": 1200, "epoch": 3, "tags": ["a", "b"], "nested": {"loss": 0.25, "ok": True}}
    Snapshot.take(str(tmp_path / "s"), {"s": StateDict(x=1)}, metadata=metadata)
    assert Snapshot(str(tmp_path / "s")).metadata == metadata
    Snapshot.take(str(tmp_path / "t"), {"s": StateDict(x=1)})
    assert Snapshot(str(tmp_path / "t")).metadata == {}


def test_metadata_that_only_the_standard_json_writes(tmp_path):
    """Non-finite floats, integers beyond 64 bits and non-string keys read back as Python's json gives them,
    whichever JSON library wrote the manifest; a long run of digits in a key is no integer."""
    metadata = {"loss": float("nan"), "best": float("inf"), "seed": 2**70 + 1, "by_step": {10: "a"},
                "key_12345678901234567890": "v", "text": "é ✓"}
    Snapshot.take(str(tmp_path / "s"), {"s": StateDict(x=1, big=-(2**80))}, metadata=metadata)
    snap = Snapshot(str(tmp_path / "s"))
    got = snap.metadata
    assert math.isnan(got.pop("loss")) and got.pop("best") == float("inf")
    assert got == {"seed": 2**70 + 1, "by_step": {"10": "a"}, "key_12345678901234567890": "v", "text": "é ✓"}
    out = StateDict(x=0, big=0)
    snap.restore({"s": out})
    assert out["big"] == -(2**80) and type(out["big"]) is int
