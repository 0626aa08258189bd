"""The checksums of many chunks in one call (engine/_files/chunk_hashes.py): the same as the package xxhash's,
native where the C helper is built, and computed without the GIL there."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import shutil
import threading
import time

import numpy as np
import pytest
import torch
import xxhash

import ppe_snapshot as ps
from ppe_snapshot.engine._files import chunk_hashes
from ppe_snapshot.errors import CorruptSnapshotError
from ppe_snapshot.settings import SETTINGS

needs_native = pytest.mark.skipif(chunk_hashes.NATIVE is None, reason="the C helper is not built")


def _chunks(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """A buffer, chunks of it at odd addresses and of sizes across xxh3's code paths (empty ones too), and the
    package's checksum of each."""
    rng = np.random.default_rng(seed)
    buffer = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    sizes = np.concatenate([np.arange(0, 300), rng.integers(0, 70000, 200)]).astype(np.uint64)
    starts = rng.integers(0, buffer.nbytes - 70000, len(sizes)).astype(np.uint64)
    want = [xxhash.xxh3_64_intdigest(buffer[s:s + n]) for s, n in zip(starts.tolist(), sizes.tolist())]
    return buffer, starts + np.uint64(buffer.ctypes.data), sizes, want


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_checksums_equal_the_package_s(native, monkeypatch):
    if native and chunk_hashes.NATIVE is None:
        pytest.skip("the C helper is not built")
    monkeypatch.setattr(SETTINGS, "native_hash", native)
    buffer, addresses, sizes, want = _chunks(seed=1)
    got = chunk_hashes.hash_addresses(addresses, sizes)
    assert got.dtype == np.uint64 and got.tolist() == want
    assert chunk_hashes.hash_addresses([], []).tolist() == []
    with pytest.raises(ValueError, match="2 addresses and 1 lengths"):
        chunk_hashes.hash_addresses(addresses[:2], sizes[:1])
    del buffer


def test_the_helper_is_built_where_a_compiler_is():
    """CI installs the package with a C compiler at hand: the helper must have been built and loaded there (a
    broken build would otherwise go unnoticed, only slower)."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine")
    assert chunk_hashes.LIBRARY.exists(), \
        f"{chunk_hashes.LIBRARY} is missing: install the package (pip install -e ., or make venv) to build it"
    assert chunk_hashes.NATIVE is not None and chunk_hashes.XXH3_64BITS is not None


@needs_native
def test_the_native_call_leaves_the_gil():
    """While a thread is inside the C call, Python code runs on another: the call is made to sleep 0.6 s (libc's
    usleep standing in for the hash function), and the main thread's loop must run through much of it (with the
    GIL held it could run only before the call began: 8 ms here, through ctypes.PyDLL)."""
    usleep = ctypes.cast(ctypes.CDLL(None).usleep, ctypes.c_void_p).value
    inside: list[float] = []
    out = np.empty(1, dtype=np.uint64)
    sleep, zero = np.array([600_000], dtype=np.uint64), np.zeros(1, dtype=np.uint64)

    def call() -> None:
        inside.append(time.perf_counter())
        chunk_hashes.NATIVE(usleep, sleep.ctypes.data, zero.ctypes.data, 1, out.ctypes.data)
        inside.append(time.perf_counter())

    thread = threading.Thread(target=call)
    thread.start()
    ticks = []
    while thread.is_alive():
        ticks.append(time.perf_counter())
    thread.join()
    start, end = inside
    during = [t for t in ticks if start < t < end]
    assert end - start >= 0.59
    assert during and during[-1] - during[0] >= 0.25, "the main thread did not run while the C call slept"


def test_a_helper_that_hashes_otherwise_is_not_used(monkeypatch, caplog):
    """The native hash is checked against the package's before use: a wrong function (XXH32 in the place of
    XXH3_64bits) is refused with a warning, and the checksums are computed in Python."""
    if not chunk_hashes.LIBRARY.exists():
        pytest.skip("the C helper is not built")
    wrong = ctypes.cast(ctypes.CDLL(xxhash._xxhash.__file__).XXH32, ctypes.c_void_p).value
    monkeypatch.setattr(chunk_hashes, "_xxh3_function", lambda: wrong)
    with caplog.at_level(logging.WARNING, logger=chunk_hashes.__name__):
        assert chunk_hashes._load() == (None, None)
    assert "hashes differently from the package xxhash" in caplog.text


def test_the_system_libxxhash_stands_in_for_the_package_s(monkeypatch):
    """Where the package xxhash's extension exports no ``XXH3_64bits`` (here: no extension found at all), the
    system's libxxhash is used, after the same check."""
    if not chunk_hashes.LIBRARY.exists() or not ctypes.util.find_library("xxhash"):
        pytest.skip("the C helper or the system's libxxhash is missing")
    monkeypatch.setattr(xxhash, "_xxhash", None)
    system = ctypes.cast(ctypes.CDLL(ctypes.util.find_library("xxhash")).XXH3_64bits, ctypes.c_void_p).value
    assert chunk_hashes._xxh3_function() == system
    assert chunk_hashes._load()[1] == system


def test_no_helper_library_means_python_checksums(monkeypatch, tmp_path):
    monkeypatch.setattr(chunk_hashes, "LIBRARY", tmp_path / "libhash_many.so")
    assert chunk_hashes._load() == (None, None)
    monkeypatch.setattr(chunk_hashes, "NATIVE", None)
    buffer, addresses, sizes, want = _chunks(seed=2)
    assert chunk_hashes.hash_addresses(addresses, sizes).tolist() == want
    del buffer


@pytest.mark.parametrize("size", [40, 1500], ids=["buffered-runs", "direct-runs"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_small_tensors_round_trip_and_a_damaged_one_is_named(native, size, monkeypatch, tmp_path):
    """Both hashings write and check the same snapshot: a take staged by a writer (``write_staged``'s checksums)
    restored bit-exact through the bulk path (runs of tiny chunks read through a buffer, and runs read straight
    into the targets), and one flipped byte named by its path."""
    if native and chunk_hashes.NATIVE is None:
        pytest.skip("the C helper is not built")
    monkeypatch.setattr(SETTINGS, "native_hash", native)
    state = {f"t{i}": torch.randn(size + i % 7) for i in range(500)}
    path = str(tmp_path / "s")
    ps.Snapshot.async_take(path, {"m": ps.StateDict(state)}).wait()
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    ps.Snapshot(path).restore({"m": ps.StateDict(back)})
    assert all(torch.equal(back[k], state[k]) for k in state)

    chunk = ps.Snapshot(path).get_manifest()["0/m/t123"].chunks[0]
    with open(tmp_path / "s" / chunk.file, "r+b") as f:
        f.seek(chunk.offset + 5)
        byte = f.read(1)
        f.seek(chunk.offset + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptSnapshotError, match="m/t123"):
        ps.Snapshot(path).restore({"m": ps.StateDict(back)})


@needs_native
@pytest.mark.parametrize("size", [40, 1500], ids=["buffered-runs", "direct-runs"])
def test_a_local_bulk_restore_hashes_inside_its_reads(size, monkeypatch, tmp_path):
    """With both C helpers, each run of a bulk restore is hashed by its read's own native call (the read thread
    leaves the GIL once per run): no checksum is computed after a read."""
    from ppe_snapshot.storage import local_reads
    if local_reads.READ_ALL is None or chunk_hashes.HASH_JOB is None:
        pytest.skip("the C helpers are not built")
    state = {f"t{i}": torch.randn(size) for i in range(2000)}
    path = str(tmp_path / "s")
    ps.Snapshot.take(path, {"m": ps.StateDict(state)})
    read_all, reads_then = local_reads.READ_ALL, []

    def recorded(*args):
        reads_then.append(args[5] == chunk_hashes.HASH_JOB)
        return read_all(*args)
    monkeypatch.setattr(local_reads, "READ_ALL", recorded)
    monkeypatch.setattr(chunk_hashes, "hash_addresses", lambda *a: pytest.fail("hashed after a read"))
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    ps.Snapshot(path).restore({"m": ps.StateDict(back)})
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert reads_then and all(reads_then)
