"""Many small tensors: the gathered writes of a take and the bulk restore of a version-2 snapshot (issue 14)
keep every value bit-exact, every checksum verified and every mismatch named."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import xxhash

from _asserts import assert_same, manifest_doc
from _crafted import RANK0, read_index
from ppe_snapshot import CorruptSnapshotError, Snapshot, StateDict, StateMismatchError
from ppe_snapshot.engine._restore import bulk
from ppe_snapshot.engine._files import packing
from ppe_snapshot.writing import ProcessWriter


def _state() -> dict:
    """100 tensors of every kind a bulk restore meets, and a few it leaves to the usual path."""
    torch.manual_seed(0)
    state = {f"f{i}": torch.randn(i % 7 + 1, 3) for i in range(60)}
    state.update({f"s{i}": torch.tensor(float(i)) for i in range(20)})  # 0-d
    state.update({
        "empty": torch.zeros(0, 5), "bf16": torch.randn(33).to(torch.bfloat16), "flags": torch.rand(17) > 0.5,
        "i64": torch.arange(10, dtype=torch.int64), "param": torch.nn.Parameter(torch.randn(4, 4)),
        "big": torch.randn(packing.GATHER_BYTES // 4 + 3),  # beyond the gathering size: written on its own
        "array": np.arange(12, dtype=np.int16).reshape(3, 4), "step": 7, "name": "run",
        "strided": torch.randn(6, 4).t(),
    })
    state.update({f"u{i}": torch.full((5,), i, dtype=torch.uint8) for i in range(20)})
    return state


def _zeros_like(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[key] = torch.zeros_like(value)
        elif isinstance(value, np.ndarray):
            out[key] = np.zeros_like(value)
        else:
            out[key] = None
    out["strided"] = torch.zeros(6, 4).t()  # a non-contiguous target: the usual path reads through a buffer
    return out


def test_many_small_tensors_round_trip_in_place(tmp_path):
    state = _state()
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(state)})
    got, before = _restored_in_place(state, str(tmp_path / "s"), None)
    for key, value in before.items():
        assert got[key] is value, key  # loaded in place
    assert_same({k: v for k, v in got.items() if isinstance(v, torch.Tensor)},
                {k: v.detach() for k, v in state.items() if isinstance(v, torch.Tensor)})
    assert np.array_equal(got["array"], state["array"]) and got["step"] == 7 and got["name"] == "run"
    chunks = [c for e in manifest_doc(tmp_path / "s")["ranks"][0].values() for c in e.get("chunks", [])]
    assert len(chunks) == 108 and all(c["offset"] % 64 == 0 for c in chunks)


def _restored_in_place(state: dict, path: str, options: dict | None) -> tuple[dict, dict]:
    """The restored state dict, and the target tensors it was restored into."""
    target = _zeros_like(state)
    before = {k: v for k, v in target.items() if isinstance(v, torch.Tensor)}
    restored = StateDict(target)
    Snapshot(path, storage_options=options).restore({"m": restored})
    return restored.state_dict(), before


def test_damaged_byte_of_a_bulk_read_tensor_is_named(tmp_path):
    state = _state()
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(state)})
    chunk = manifest_doc(tmp_path / "s")["ranks"][0]["m/f30"]["chunks"][0]
    data = tmp_path / "s" / chunk["file"]
    raw = bytearray(data.read_bytes())
    raw[chunk["offset"] + 3] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptSnapshotError, match=r"checksum mismatch .*\(m/f30\)"):
        Snapshot(str(tmp_path / "s")).restore({"m": StateDict(_zeros_like(state))})


def test_truncated_data_file_is_refused_in_bulk(tmp_path):
    state = {f"t{i}": torch.full((100,), float(i)) for i in range(50)}
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(state)})
    data = tmp_path / "s" / "data" / "rank0.bin"
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(CorruptSnapshotError, match="missing or truncated"):
        Snapshot(str(tmp_path / "s")).restore({"m": StateDict({k: torch.zeros(100) for k in state})})


def test_bulk_restore_names_a_target_of_another_shape_or_dtype(tmp_path):
    state = {f"t{i}": torch.full((10,), float(i)) for i in range(40)}
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(state)})
    for wrong in (torch.zeros(11), torch.zeros(10, dtype=torch.float64)):
        target = {k: torch.zeros(10) for k in state}
        target["t17"] = wrong
        with pytest.raises(StateMismatchError, match="m/t17"):
            Snapshot(str(tmp_path / "s")).restore({"m": StateDict(target)})


def test_conjugate_and_negative_views_are_stored_as_they_read(tmp_path):
    """A conjugate or negative view's memory holds other values than it shows: neither the gathered writes
    of small tensors nor the direct writes of large ones may copy that memory as it is."""
    torch.manual_seed(1)
    large = packing.GATHER_BYTES // 8 + 5  # complex64: beyond the gathering size
    views = {"small_conj": torch.randn(7, dtype=torch.cfloat).conj(), "small_neg": torch._neg_view(torch.randn(9)),
             "large_conj": torch.randn(large, dtype=torch.cfloat).conj(),
             "large_neg": torch._neg_view(torch.randn(large * 2))}
    state = {**views, **{f"f{i}": torch.randn(3) for i in range(20)}}
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(state)})
    snapshot = Snapshot(str(tmp_path / "s"))
    for key, view in views.items():
        assert torch.equal(snapshot.read_object(f"0/m/{key}"), view.resolve_conj().resolve_neg()), key


@pytest.mark.parametrize("taking", ["take", "async_take"])
def test_rank_index_lists_each_tensor_in_file_order_with_the_hash_of_its_bytes(tmp_path, monkeypatch, taking):
    """The columns a take writes (no entry object per tensor) name, for every tensor and array, the bytes it
    wrote (no two overlapping) and their xxh3: gathered small tensors, a tensor of several chunks, one copied
    through a host buffer, written straight from the tensors or from a staged image."""
    monkeypatch.setattr(packing, "CHUNK_BYTES", 4096)  # "big" and "several" are cut into chunks
    state = {**_state(), "several": torch.randn(3000)}
    path = tmp_path / "s"
    if taking == "take":
        Snapshot.take(str(path), {"m": StateDict(state)})
    else:
        Snapshot.async_take(str(path), {"m": StateDict(state)}).wait()
    header, cols = read_index(path / RANK0)
    data = (path / "data" / "rank0.bin").read_bytes()
    ends = cols["tensor_chunk_end"].tolist()
    starts = [0] + ends[:-1]
    stored = {p.split("/", 1)[1] for p in header["tensors"]}
    assert stored == {k for k, v in state.items() if isinstance(v, (torch.Tensor, np.ndarray))}
    offsets = cols["chunk_offset"].tolist()
    for row, tensor in enumerate(header["tensors"]):
        chunks = range(starts[row], ends[row])
        assert len(chunks) == max(1, -(-state[tensor[2:]].nbytes // 4096)), tensor
        for c in chunks:
            piece = data[offsets[c]:offsets[c] + int(cols["chunk_nbytes"][c])]
            assert xxhash.xxh3_64_intdigest(piece) == int(cols["chunk_checksum"][c]), tensor
    ranges = sorted(zip(offsets, (cols["chunk_offset"] + cols["chunk_nbytes"]).tolist()))
    assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:])) and ranges[-1][1] <= len(data)
    value = state["strided"].contiguous().numpy().tobytes()
    row = header["tensors"].index("m/strided")
    assert data[offsets[starts[row]]:offsets[starts[row]] + len(value)] == value


@pytest.mark.parametrize("taking", ["take", "async_take", "process"])
def test_rank_index_holds_the_shape_of_every_tensor(tmp_path, taking):
    """A take writes shapes as columns (a vector's one dimension from its size in bytes, the others read from
    the tensor): every number of dimensions, empty dimensions and item sizes from 1 to 16 bytes, in one dict of
    plain tensors; staged (the shapes kept once the tensors are let go) and sent to a ProcessWriter's worker."""
    torch.manual_seed(0)
    shapes = [(), (1,), (7,), (0,), (3, 5), (0, 4), (4, 0), (2, 3, 4), (1, 1, 1, 1, 2), (9,)]
    dtypes = [torch.bool, torch.uint8, torch.bfloat16, torch.float32, torch.float64, torch.complex128]
    state = {f"t{i}_{j}": (torch.randn(shape) * 4).to(dtype) for i, shape in enumerate(shapes)
             for j, dtype in enumerate(dtypes)}
    path = tmp_path / "s"
    if taking == "take":
        Snapshot.take(str(path), {"m": StateDict(state)})
    elif taking == "async_take":
        Snapshot.async_take(str(path), {"m": StateDict(state)}).wait()
    else:
        writer = ProcessWriter()
        try:
            writer("s", str(tmp_path), {"m": StateDict(state)})
            writer.wait()
        finally:
            writer.finalize()
    header, cols = read_index(path / RANK0)
    ndims, dims = cols["tensor_ndim"].tolist(), cols["dims"].tolist()
    starts = np.cumsum([0] + ndims).tolist()
    prefix = header["tensors"][0].rsplit("/", 1)[0]  # a writer keeps the app state under a key of its own
    got = {name[len(prefix) + 1:]: tuple(dims[starts[row]:starts[row + 1]])
           for row, name in enumerate(header["tensors"])}
    assert got == {key: tuple(value.shape) for key, value in state.items()}
    assert_same(Snapshot(str(path)).read_object(prefix), state)


@pytest.mark.parametrize("taking", ["take", "async_take"])
def test_a_dict_of_parameters_round_trips_and_stays_trainable(tmp_path, taking):
    """A dict whose values are all parameters (``dict(model.named_parameters())``), small and past the staging
    copy's size: saved by value, restored in place into parameters that still require grad."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.LayerNorm(300), torch.nn.Linear(300, 4))
    params = dict(model.named_parameters())
    expected = {name: p.detach().clone() for name, p in params.items()}
    path = str(tmp_path / "s")
    if taking == "take":
        Snapshot.take(path, {"p": StateDict(params)})
    else:
        Snapshot.async_take(path, {"p": StateDict(params)}).wait()
    with torch.no_grad():
        for p in params.values():
            p.zero_()
    Snapshot(path).restore({"p": StateDict(params)})
    assert_same({name: p.detach() for name, p in params.items()}, expected)
    assert all(p.requires_grad and p.grad_fn is None for p in params.values())
    assert dict(model.named_parameters()) == params  # the same objects, loaded in place


def _drop_page_cache(root) -> None:
    """Evict the snapshot's data files from the page cache (the take made them durable)."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _mixed_state() -> dict:
    """A dict of tiny tensors (read through a buffer) and one of tensors of 4 bytes to 80 KB (read straight into
    their targets), alignment gaps between them, dtypes of 2, 4 and 8 bytes; a large tensor between the two
    in the file (read on its own), so that their runs stay apart."""
    torch.manual_seed(3)
    dtypes = (torch.float32, torch.float64, torch.int32, torch.bfloat16)
    tiny = {f"t{i}": torch.randn(i % 3 + 1).to(dtypes[i % 4]) for i in range(60)}
    mixed = {f"m{i}": torch.randn((1, 1000, 3, 20000)[i % 4]).to(dtypes[i % 4]) for i in range(60)}
    return {"tiny": tiny, "apart": {"large": torch.randn(bulk.SMALL_BYTES // 4 + 1)}, "mixed": mixed}


def _spy_runs(monkeypatch, rows: list[int] | None = None) -> list[str]:
    """The names of the bulk read paths each run takes, in the order they start; ``rows`` gets the index rows
    each run reads."""
    used: list[str] = []

    def spied(run: bulk._Run, method, name: str) -> None:
        used.append(name)
        if rows is not None:
            rows.extend(run.rows)
        method(run)
    for name in ("read_direct", "read_buffered"):
        method = getattr(bulk._Run, name)
        monkeypatch.setattr(bulk._Run, name, lambda self, _m=method, _n=name: spied(self, _m, _n))
    return used


def test_bulk_restore_is_bit_exact_after_a_cold_start_in_many_hand_offs(tmp_path, monkeypatch):
    """The walk hands its picks to the read pool many times (a small pacing), both read paths run, the page
    cache holds nothing: every target bit-exact and loaded in place."""
    monkeypatch.setattr(bulk, "FLUSH_BYTES", 64 << 10)
    used = _spy_runs(monkeypatch)
    state = _mixed_state()
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(state)})
    _drop_page_cache(tmp_path / "s")
    target = {part: {k: torch.zeros_like(v) for k, v in values.items()} for part, values in state.items()}
    restored = StateDict({part: dict(values) for part, values in target.items()})
    Snapshot(str(tmp_path / "s")).restore({"m": restored})
    got = restored.state_dict()
    assert all(got[part][k] is target[part][k] for part in state for k in state[part])
    assert_same(got, state)
    assert used.count("read_buffered") == 1 and used.count("read_direct") > 3


@pytest.mark.parametrize("part, key, path", [("mixed", "m5", "read_direct"), ("tiny", "t7", "read_buffered")])
def test_damaged_chunk_of_a_direct_or_buffered_run_is_named(tmp_path, monkeypatch, part, key, path):
    used = _spy_runs(monkeypatch)
    state = _mixed_state()
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(state)})
    chunk = manifest_doc(tmp_path / "s")["ranks"][0][f"m/{part}/{key}"]["chunks"][0]
    data = tmp_path / "s" / chunk["file"]
    raw = bytearray(data.read_bytes())
    raw[chunk["offset"] + chunk["nbytes"] - 1] ^= 0x01
    data.write_bytes(bytes(raw))
    target = {p: {k: torch.zeros_like(v) for k, v in values.items()} for p, values in state.items()}
    with pytest.raises(CorruptSnapshotError, match=rf"checksum mismatch .*\(m/{part}/{key}\)"):
        Snapshot(str(tmp_path / "s")).restore({"m": StateDict(target)})
    assert path in used


def test_an_optimizer_state_of_small_dicts_is_restored_in_bulk(tmp_path, monkeypatch):
    """An optimizer's state is a small dict per parameter: the picks of all the dicts are read together, in a
    few runs (not one or more per dict, nor one tensor at a time the usual way), in place and bit-exact."""
    used = _spy_runs(monkeypatch)
    torch.manual_seed(4)
    state = {"state": {i: {"step": torch.tensor(float(i)), "exp_avg": torch.randn(i % 5 + 1, 3),
                           "exp_avg_sq": torch.rand(7).double()} for i in range(500)},
             "param_groups": [{"lr": 0.1, "params": list(range(500))}]}
    Snapshot.take(str(tmp_path / "s"), {"optim": StateDict(state)})
    target = {"state": {i: {k: torch.zeros_like(v) for k, v in s.items()} for i, s in state["state"].items()},
              "param_groups": [{"lr": 0.0, "params": []}]}
    owned = [t for s in target["state"].values() for t in s.values()]
    restored = StateDict(target)
    Snapshot(str(tmp_path / "s")).restore({"optim": restored})
    got = restored.state_dict()
    loaded = [t for s in got["state"].values() for t in s.values()]
    assert len(loaded) == len(owned) and all(a is b for a, b in zip(loaded, owned))  # loaded in place
    assert_same(got["state"], state["state"]) and got["param_groups"] == state["param_groups"]
    assert 1 <= len(used) <= 3, used


def test_data_file_cut_inside_a_direct_run_is_refused(tmp_path):
    state = {f"t{i}": torch.full((5000,), float(i)) for i in range(40)}  # 20 KB each: read straight in
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(state)})
    data = tmp_path / "s" / "data" / "rank0.bin"
    data.write_bytes(data.read_bytes()[:len(data.read_bytes()) - 5000])
    with pytest.raises(CorruptSnapshotError, match="missing or truncated"):
        Snapshot(str(tmp_path / "s")).restore({"m": StateDict({k: torch.zeros(5000) for k in state})})


@pytest.mark.parametrize("detached", [False, True], ids=["views", "detached"])
def test_negative_and_conjugate_targets_receive_the_values_not_the_bytes(tmp_path, detached):
    """A tensor with the negative or conjugate bit shows other values than its memory holds; a view made so
    keeps the bit when detached (and is then no view): restored in bulk, each shows the saved values."""
    torch.manual_seed(2)
    state = {f"f{i}": torch.randn(5) for i in range(20)}
    state.update(neg=torch.randn(9), conj=torch.randn(7, dtype=torch.cfloat),
                 both=torch.randn(3, dtype=torch.cfloat), imag=torch.tensor(2.5))
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(state)})
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    target.update(neg=torch._neg_view(torch.zeros(9)), conj=torch.zeros(7, dtype=torch.cfloat).conj(),
                  both=torch._neg_view(torch.zeros(3, dtype=torch.cfloat).conj()),
                  imag=torch.zeros((), dtype=torch.cfloat).conj().imag)  # a 0-d negative view: contiguous
    if detached:
        target = {k: v.detach() for k, v in target.items()}
        assert not target["neg"]._is_view() and target["neg"].is_neg() and target["conj"].is_conj()
    Snapshot(str(tmp_path / "s")).restore({"m": StateDict(target)})
    for key in ("neg", "conj", "both", "imag"):
        assert torch.equal(target[key], state[key]), key
    assert all(torch.equal(target[f"f{i}"], state[f"f{i}"]) for i in range(20))


def test_bulk_restore_reads_rank_and_replicated_tensors_of_one_dict(tmp_path):
    """Children of one dict in the rank's index and in the replicated one: both loaded in bulk, in place."""
    torch.manual_seed(4)
    state = {f"{kind}{i}": torch.randn(i + 1) for kind in "rs" for i in range(30)}
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(state)}, replicated=["m/r*"])
    doc = manifest_doc(tmp_path / "s")
    assert "m/r3" in doc["replicated"] and "m/s3" in doc["ranks"][0]
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    restored = StateDict(dict(target))
    Snapshot(str(tmp_path / "s")).restore({"m": restored})
    got = restored.state_dict()
    assert all(got[k] is target[k] for k in state)
    assert_same(got, state)


@pytest.mark.parametrize("shapes", [[(3,), (1,), (7,)], [(2, 3), (4, 1)], [(), (), ()], [(2,), (), (1, 3), (4,)]],
                         ids=["flat", "two-dims", "scalars", "mixed"])
def test_bulk_restore_of_one_dict_per_kind_of_shapes(tmp_path, monkeypatch, shapes):
    """Tensors of one number of dimensions (the index's shapes read back in one pass) and of several: every one
    matched to its target and read in bulk, bit-exact."""
    state = {f"t{i}": torch.arange(float(np.prod(shape))).reshape(shape) + i for i, shape in enumerate(shapes * 40)}
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(state)})
    read_in_bulk: list[int] = []
    _spy_runs(monkeypatch, read_in_bulk)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    restored = StateDict(dict(target))
    Snapshot(str(tmp_path / "s")).restore({"m": restored})
    assert len(read_in_bulk) == len(state)
    assert all(restored.state_dict()[k] is target[k] for k in state)
    assert_same(restored.state_dict(), state)


def test_dicts_loaded_whole_in_bulk_keep_their_kind_and_key_order(tmp_path):
    """A dict or OrderedDict whose children all load in bulk comes back as the same kind, keys in saved order, its
    tensors restored in place; one with a child loaded the usual way (a large tensor, a number) alike."""
    import collections
    torch.manual_seed(1)
    keys = [f"k{i}" for i in (5, 2, 9, 0, 7, 1)]  # not sorted: the saved order must survive
    saved = {
        "plain": {key: torch.randn(3) for key in keys},
        "ordered": collections.OrderedDict((key, torch.randn(2, 2)) for key in keys),
        "mixed": collections.OrderedDict([("a", torch.randn(4)), ("n", 3), ("big", torch.randn(bulk.SMALL_BYTES)),
                                          ("b", torch.randn(4))]),
    }
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(saved)})
    target = {name: type(d)((k, torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in d.items())
              for name, d in saved.items()}
    tensors = {(name, k): v for name, d in target.items() for k, v in d.items() if isinstance(v, torch.Tensor)}
    restored = StateDict(target)
    Snapshot(str(tmp_path / "s")).restore({"m": restored})
    got = restored.state_dict()
    for name, d in saved.items():
        assert type(got[name]) is type(d) and list(got[name]) == list(d), name
        for key, value in d.items():
            if isinstance(value, torch.Tensor):
                assert got[name][key] is tensors[(name, key)], (name, key)
                assert torch.equal(got[name][key], value), (name, key)
            else:
                assert got[name][key] == value
