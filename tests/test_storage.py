"""The storage layer on its own (local disk, ``memory://``, a real S3 server), and the engine on S3."""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import uuid
from typing import Iterator

import fsspec
import numpy as np
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from torch import nn

from ppe_snapshot import Snapshot, SnapshotNotFoundError, StateDict
from ppe_snapshot.storage import AfterRead, FsspecStorage, LocalStorage, Storage, open_storage
from ppe_snapshot.storage import local_reads
from ppe_snapshot.settings import SETTINGS


class NoRmFileFileSystem(MemoryFileSystem):
    """``normfile://``: adlfs before 2026.2 in miniature, a file system with a removal of its own (``rm``) and no
    ``rm_file`` (fsspec's, which raises NotImplementedError), its data in a store of its own."""
    protocol = ("normfile",)
    store: dict = {}
    pseudo_dirs = [""]

    def rm_file(self, path):
        raise NotImplementedError

    def rm(self, path, recursive=False, maxdepth=None):
        for p in self.expand_path(path, recursive=recursive, maxdepth=maxdepth):  # a missing path raises
            self.store.pop(p, None)
            if p in self.pseudo_dirs:
                self.pseudo_dirs.remove(p)


fsspec.register_implementation("normfile", NoRmFileFileSystem, clobber=True)


def _aligned(data: bytes) -> memoryview:
    """``data`` in page-aligned memory (what an O_DIRECT writer may write without a copy)."""
    buf = mmap.mmap(-1, len(data))
    buf[:] = data
    return memoryview(buf)


@pytest.fixture(params=["local-direct", "local-buffered", "memory", "normfile", "s3"])
def storage(request, tmp_path, monkeypatch) -> Iterator[Storage]:
    """An empty snapshot directory on each backend."""
    kind = request.param
    if kind.startswith("local"):
        monkeypatch.setattr(SETTINGS, "direct_io", kind == "local-direct")
        store = open_storage(str(tmp_path / "snap"))
        assert isinstance(store, LocalStorage)
        yield store
        store.close()
    elif kind in ("memory", "normfile"):
        root = f"{kind}://ppe-snapshot-storage-{uuid.uuid4().hex}"
        store = open_storage(f"{root}/snap")
        assert isinstance(store, FsspecStorage)
        yield store
        fs = fsspec.filesystem(kind)
        if fs.exists(root):
            fs.rm(root, recursive=True)
    else:
        url, options = request.getfixturevalue("s3_bucket")
        store = open_storage(f"{url}/run/snap", options)
        assert isinstance(store, FsspecStorage)
        yield store


def _files(storage: Storage) -> list[str]:
    """The relative paths of every file under the storage's root, as the file system lists them."""
    fs = fsspec.filesystem("file") if isinstance(storage, LocalStorage) else storage.fs
    prefix = storage.root.strip("/") + "/"
    try:
        found = fs.find(storage.root)
    except FileNotFoundError:
        return []
    return sorted(p.strip("/")[len(prefix):] for p in found if p.strip("/").startswith(prefix))


def test_writer_gives_a_file_of_the_right_size(storage):
    pieces = [
        _aligned(bytes(range(256)) * 32),  # 8 KiB, page-aligned at offset 0: written directly by O_DIRECT
        memoryview(b"abc"),
        memoryview(b""),
        memoryview(os.urandom((5 << 20) + 123)),  # more than one O_DIRECT bounce buffer, unaligned
        _aligned(b"x" * 4096),  # aligned memory at an unaligned file offset
        memoryview(b"tail"),
    ]
    content = b"".join(bytes(p) for p in pieces)
    writer = storage.open_writer("data/rank0.bin")
    if isinstance(storage, LocalStorage):
        wanted = "_DirectBlobWriter" if SETTINGS.direct_io else "_BufferedBlobWriter"
        assert type(writer).__name__ == wanted
    writer.write(pieces[:3])
    writer.write(pieces[3:])
    assert writer.close() == len(content)
    assert storage.exists("data/rank0.bin")
    assert storage.size("data/rank0.bin") == len(content)
    assert storage.read_bytes("data/rank0.bin") == content

    writer = storage.open_writer("data/rank0.bin")  # a new writer replaces the file
    writer.write([memoryview(b"short")])
    assert writer.close() == 5
    assert storage.read_bytes("data/rank0.bin") == b"short"


def test_empty_file(storage):
    writer = storage.open_writer("data/empty.bin")
    writer.write([])
    assert writer.close() == 0
    assert storage.exists("data/empty.bin") and storage.size("data/empty.bin") == 0
    storage.read_into("data/empty.bin", 0, memoryview(bytearray(0)))


def test_put_atomic(storage):
    storage.put_atomic("manifest.json", b'{"a": 1}')
    assert storage.read_bytes("manifest.json") == b'{"a": 1}'
    storage.put_atomic("manifest.json", b'{"a": 2, "b": 3}')
    storage.put_atomic(".parts/t.rank1.json", b"part")
    assert storage.read_bytes("manifest.json") == b'{"a": 2, "b": 3}'
    assert _files(storage) == [".parts/t.rank1.json", "manifest.json"]  # no temporary files left over


def test_put_atomic_of_a_large_file(storage):
    """An index file of many tensors is megabytes: written like a data file (O_DIRECT on local disks), its size
    no multiple of a block, it replaces the last one whole and leaves no temporary file."""
    first, second = os.urandom(3 << 20), os.urandom((1 << 20) + 4097)
    storage.put_atomic("index/rank0.idx", first)
    assert storage.read_bytes("index/rank0.idx") == first
    storage.put_atomic("index/rank0.idx", second)
    assert storage.read_bytes("index/rank0.idx") == second
    assert _files(storage) == ["index/rank0.idx"]


def test_read_into(storage):
    content = bytes(range(200))
    writer = storage.open_writer("data/f.bin")
    writer.write([memoryview(content)])
    writer.close()

    out = bytearray(10)
    storage.read_into("data/f.bin", 0, memoryview(out))
    assert out == content[:10]
    storage.read_into("data/f.bin", 123, memoryview(out))
    assert out == content[123:133]
    storage.read_into("data/f.bin", 190, memoryview(out))  # exactly up to the end
    assert out == content[190:]
    whole = bytearray(200)
    storage.read_into("data/f.bin", 0, memoryview(whole)[50:])  # into the middle of a buffer
    assert whole[50:] == content[:150] and whole[:50] == bytes(50)

    with pytest.raises(EOFError):
        storage.read_into("data/f.bin", 195, memoryview(bytearray(10)))
    with pytest.raises(EOFError):
        storage.read_into("data/f.bin", 500, memoryview(bytearray(1)))


def test_read_vectored_into_thousands_of_views(storage):
    """More views than one system call takes (IOV_MAX), some empty: each gets its bytes; one past the end is
    EOFError."""
    content = bytes(i * 7 % 251 for i in range(12000))
    writer = storage.open_writer("data/f.bin")
    writer.write([memoryview(content)])
    writer.close()
    sizes = [i % 7 for i in range(3000)]  # about 9,000 bytes in 3,000 views
    views = [memoryview(bytearray(n)) for n in sizes]
    storage.read_vectored("data/f.bin", 100, views)
    assert b"".join(bytes(v) for v in views) == content[100:100 + sum(sizes)]
    with pytest.raises(EOFError):
        storage.read_vectored("data/f.bin", len(content) - sum(sizes) + 1, [memoryview(bytearray(n)) for n in sizes])


def test_read_scattered_into_memory_named_by_address(storage):
    """``read_scattered``: (address, length) rows, more than one system call takes, some empty, filled in order;
    a read past the end is EOFError (on a local disk after a short read, which it resumes within its piece,
    has filled what the file holds)."""
    content = bytes(i * 7 % 251 for i in range(12000))
    writer = storage.open_writer("data/f.bin")
    writer.write([memoryview(content)])
    writer.close()
    sizes = [i % 7 for i in range(3000)]
    out = np.zeros(sum(sizes) + 3000, dtype=np.uint8)  # each piece one byte after the last
    starts = np.arange(3000) + np.cumsum([0] + sizes[:-1])
    iov = np.stack([out.ctypes.data + starts, sizes], axis=1).astype(np.uint64)
    storage.read_scattered("data/f.bin", 100, iov)
    assert b"".join(out[s:s + n].tobytes() for s, n in zip(starts, sizes)) == content[100:100 + sum(sizes)]
    assert not out[starts[1:] - 1].any()  # nothing between the pieces

    out[:] = 0
    tail = len(content) - sum(sizes) + 5  # the last piece of 6 bytes gets 1, the 5 asked past the end none
    with pytest.raises(EOFError):
        storage.read_scattered("data/f.bin", tail, iov)
    if isinstance(storage, LocalStorage):
        assert b"".join(out[s:s + n].tobytes() for s, n in zip(starts, sizes))[:-5] == content[tail:]


_PREADV = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64)
_THEN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _stopping_short(limit: int, calls: list[int]):
    """A preadv like the C library's that reads at most ``limit`` bytes per call (Linux reads at most about 2 GiB
    per call, a signal may cut one short), and records the pieces each call was given."""
    real = ctypes.CDLL(None, use_errno=True).preadv
    real.argtypes, real.restype = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64], ctypes.c_ssize_t

    def short(fd: int, address: int, count: int, offset: int) -> int:
        calls.append(count)
        rows = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * count)).from_address(address)).reshape(count, 2).copy()
        keep = int(np.searchsorted(np.cumsum(rows[:, 1]), limit)) + 1
        rows = rows[:keep]
        rows[-1, 1] -= np.uint64(max(0, int(rows[:, 1].sum()) - limit))
        return real(fd, rows.ctypes.data, len(rows), offset)
    return short


@pytest.fixture(params=["native", "python"])
def local_read_path(request, monkeypatch) -> str:
    """Local reads by address through the C helper (``preadv_all.c``) or the Python loop of ``preadv`` calls."""
    if request.param == "native" and local_reads.READ_ALL is None:
        pytest.skip("the C helper is not built")
    if request.param == "python":
        monkeypatch.setattr(local_reads, "READ_ALL", None)
    return request.param


def test_local_read_scattered_goes_on_after_a_short_read(tmp_path, monkeypatch, local_read_path):
    """preadv may stop before the end: the rest is read from where it stopped, within the piece it stopped in.
    Calls here stop after 1,000 bytes; 2,500 pieces take calls of at most 1,024 (IOV_MAX)."""
    calls: list[int] = []
    short = _stopping_short(1000, calls)
    if local_read_path == "native":
        callback = _PREADV(short)
        monkeypatch.setattr(local_reads, "PREADV_ADDRESS", ctypes.cast(callback, ctypes.c_void_p).value)
    else:
        monkeypatch.setattr(local_reads, "_preadv", short)
    content = os.urandom(30000)
    store = open_storage(str(tmp_path / "snap"))
    writer = store.open_writer("data/f.bin")
    writer.write([memoryview(content)])
    writer.close()
    out = np.zeros(29000, dtype=np.uint8)
    iov = np.array([[out.ctypes.data, 333], [out.ctypes.data + 333, 18000], [out.ctypes.data + 18333, 667]]
                   + [[out.ctypes.data + 19000 + i * 4, 4] for i in range(2500)], dtype=np.uint64)
    store.read_scattered("data/f.bin", 7, iov)
    assert out.tobytes() == content[7:29007]
    assert max(calls) == 1024 and len(calls) >= 29
    assert iov[1].tolist() == [out.ctypes.data + 333, 18000]  # (the caller's rows are left as they were)
    store.close()


def test_read_scattered_then_runs_its_function_once_the_bytes_have_landed(storage, monkeypatch):
    """``read_scattered_then``: the function runs once, on the reading thread, after every byte is in place; not
    where the read fails. On local storage the read and the function are one native call (the GIL left once)."""
    content = bytes(i * 11 % 253 for i in range(50000))
    writer = storage.open_writer("data/f.bin")
    writer.write([memoryview(content)])
    writer.close()
    out = np.zeros(3000 * 9, dtype=np.uint8)
    iov = np.stack([out.ctypes.data + np.arange(3000) * 9, np.full(3000, 9)], axis=1).astype(np.uint64)
    events: list[str] = []
    seen: list[bytes] = []

    def then(argument: int) -> None:
        events.append("then")
        seen.append(out.tobytes() if argument == 7 else b"")
    callback = _THEN(then)
    after = AfterRead(ctypes.cast(callback, ctypes.c_void_p).value, 7)
    native = isinstance(storage, LocalStorage) and local_reads.READ_ALL is not None
    if native:
        read_all = local_reads.READ_ALL

        def recorded(*args):
            events.append("enter")
            code = read_all(*args)
            events.append("return")
            return code
        monkeypatch.setattr(local_reads, "READ_ALL", recorded)
    storage.read_scattered_then("data/f.bin", 1000, iov, after)
    assert seen == [content[1000:1000 + 27000]]
    assert events == (["enter", "then", "return"] if native else ["then"])

    events.clear()
    with pytest.raises(EOFError):
        storage.read_scattered_then("data/f.bin", 30000, iov, after)
    assert "then" not in events


def test_a_failed_local_read_names_the_error(tmp_path, local_read_path):
    """A system call's error is an OSError with its errno (here EBADF: a closed descriptor)."""
    fd = os.open(tmp_path / "f", os.O_RDONLY | os.O_CREAT)
    os.close(fd)
    out = np.zeros(8, dtype=np.uint8)
    with pytest.raises(OSError) as raised:
        local_reads.read_addresses(fd, 0, np.array([[out.ctypes.data, 8]], dtype=np.uint64), lambda: "f")
    assert raised.value.errno == errno.EBADF and "reading f" in str(raised.value)


def test_the_read_helper_is_built_where_a_compiler_is():
    """CI installs the package with a C compiler at hand: the helper must have been built and loaded there."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine")
    assert local_reads.READ_ALL_LIBRARY.exists(), \
        f"{local_reads.READ_ALL_LIBRARY} is missing: install the package (pip install -e ., or make venv) to build it"
    assert local_reads.READ_ALL is not None


def test_missing_files(storage):
    assert not storage.exists("manifest.json")
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("manifest.json")
    with pytest.raises(FileNotFoundError):
        storage.size("data/rank0.bin")
    assert _files(storage) == []
    storage.remove("nothing-here")


def test_remove(storage):
    for name in ("manifest.json", "data/rank0.bin", "data/rank1.bin", ".parts/x.rank0.json"):
        storage.put_atomic(name, name.encode())
    assert _files(storage) == [".parts/x.rank0.json", "data/rank0.bin", "data/rank1.bin", "manifest.json"]

    storage.remove("data/rank1.bin")
    storage.remove("data/rank1.bin")  # already gone: no error
    assert not storage.exists("data/rank1.bin")
    assert _files(storage) == [".parts/x.rank0.json", "data/rank0.bin", "manifest.json"]


def test_s3_abort_leaves_no_object(s3_bucket):
    url, options = s3_bucket
    store = open_storage(f"{url}/snap", options)
    writer = store.open_writer("data/rank0.bin")
    writer.write([memoryview(b"partial data")])
    writer.abort()
    assert not store.exists("data/rank0.bin")
    assert _files(store) == []


# -- the engine on S3 ------------------------------------------------------------------

def _s3_client(options: dict):
    import boto3
    return boto3.client("s3", endpoint_url=options["client_kwargs"]["endpoint_url"], region_name="us-east-1",
                        aws_access_key_id=options["key"], aws_secret_access_key=options["secret"])


def test_s3_multipart_data_file_round_trips(s3_bucket):
    """A data file larger than one upload part (8 MiB by default) goes up through the multipart API, from the
    live tensors and from a staging buffer, and reads back bit-exact and verified."""
    url, options = s3_bucket
    torch.manual_seed(0)
    state = StateDict(big=torch.randn(5 << 20), small=torch.randn(3, 5))  # 20 MiB: three parts
    client, bucket = _s3_client(options), url.removeprefix("s3://")
    for name, take in [("sync", Snapshot.take), ("async", lambda *a, **k: Snapshot.async_take(*a, **k).wait())]:
        take(f"{url}/{name}", {"s": state}, storage_options=options)
        snap = Snapshot(f"{url}/{name}", storage_options=options)
        snap.verify()
        out = StateDict(big=torch.zeros(5 << 20), small=torch.zeros(3, 5))
        snap.restore({"s": out})
        assert torch.equal(out["big"], state["big"]) and torch.equal(out["small"], state["small"])
        etag = client.head_object(Bucket=bucket, Key=f"{name}/data/rank0.bin")["ETag"]
        assert "-" in etag, etag  # S3's tag of an object that went up through the multipart API
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_s3_abort_after_a_part_was_uploaded(s3_bucket):
    """Giving up on a file whose first part is already stored aborts the upload: no object, no upload left."""
    url, options = s3_bucket
    store = open_storage(f"{url}/snap", options)
    writer = store.open_writer("data/rank0.bin")
    writer.write([memoryview(bytes(70 << 20))])  # past the 64 MiB part size: one part is uploaded
    client, bucket = _s3_client(options), url.removeprefix("s3://")
    assert len(client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])) == 1
    writer.abort()
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert not store.exists("data/rank0.bin")


def test_s3_snapshot_without_manifest(s3_bucket):
    url, options = s3_bucket
    with pytest.raises(SnapshotNotFoundError, match="manifest.json is missing") as info:
        Snapshot(f"{url}/nothing", storage_options=options).restore({"model": nn.Linear(2, 2)})
    assert f"{url}/nothing" in str(info.value)

    # Data without a manifest (a save that never committed) is not a snapshot either.
    fs = fsspec.filesystem("s3", **options)
    fs.pipe_file(f"{url}/partial/data/rank0.bin", b"\0" * 64)
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(f"{url}/partial", storage_options=options).verify()


def test_s3_take_into_missing_bucket_fails_instead_of_creating_it(s3_bucket):
    """A mistyped bucket must be reported, not silently created."""
    url, options = s3_bucket
    missing = url + "-typo"
    with pytest.raises((FileNotFoundError, OSError)):
        Snapshot.take(f"{missing}/snap", {"s": StateDict(x=torch.arange(10.0))}, storage_options=options)
    assert not fsspec.filesystem("s3", **options).exists(missing.removeprefix("s3://"))


@pytest.mark.parametrize("where", ["local", "memory", "normfile"])
def test_a_tree_removes_moves_and_saves_whole(tmp_path, where):
    """The run-directory operations: a file saved whole, a directory moved with its manifest, removed with its
    manifest first, a swap only where the file system can (``normfile``: one without ``rm_file``)."""
    from ppe_snapshot.storage import open_tree
    base = str(tmp_path) if where == "local" else f"{where}://tree-{tmp_path.name}"
    tree = open_tree(base)
    written = tree.save_file(f"{tree.root}/one.bin", lambda f: f.write(b"abc"))
    assert written == 3 and tree.read(f"{tree.root}/one.bin") == b"abc" and tree.size(f"{tree.root}/one.bin") == 3
    assert not tree.exists(f"{tree.root}/tmp_one.bin")
    for name in ("data", "manifest.json"):
        tree.save_file(f"{tree.root}/a/{name}", lambda f: f.write(b"x"))
    tree.move_tree(f"{tree.root}/a", f"{tree.root}/b", last="manifest.json")
    assert not tree.exists(f"{tree.root}/a") and tree.is_dir(f"{tree.root}/b")
    assert sorted(i["name"].rsplit("/", 1)[1] for i in tree.list(f"{tree.root}/b")) == ["data", "manifest.json"]
    tree.save_file(f"{tree.root}/c/data", lambda f: f.write(b"y"))
    assert tree.swap(f"{tree.root}/b", f"{tree.root}/c") == (where == "local")
    tree.remove_tree(f"{tree.root}/b", first=["manifest.json"])
    tree.remove_tree(f"{tree.root}/one.bin", first=["manifest.json"])
    tree.remove_tree(f"{tree.root}/nothing", first=["manifest.json"])
    assert not tree.exists(f"{tree.root}/b") and not tree.exists(f"{tree.root}/one.bin")
    assert tree.list(f"{tree.root}/nothing") == []

    def fail(f):
        f.write(b"half")
        raise OSError(errno.EIO, "the write failed")
    tree.save_file(f"{tree.root}/d/data", lambda f: f.write(b"z"))
    with pytest.raises(OSError, match="the write failed"):
        tree.save_file(f"{tree.root}/d/data", fail)
    assert tree.read(f"{tree.root}/d/data") == b"z" and not tree.exists(f"{tree.root}/d/tmp_data")


def test_a_file_system_without_rm_file_takes_and_prunes_there():
    """adlfs before 2026.2 has no ``rm_file``: a take still clears its parts away, pruning still removes."""
    from ppe_snapshot.cli import main
    url = f"normfile://run-{uuid.uuid4().hex}"
    for iteration in (1, 2, 3):
        Snapshot.take(f"{url}/snapshot_iter_{iteration}", {"s": StateDict(x=torch.ones(4) * iteration)},
                      metadata={"iteration": iteration})
    fs = fsspec.filesystem("normfile")
    stored = [p.removeprefix(f"{url}/") for p in fs.find(url)]
    assert sorted(p for p in stored if p.startswith("snapshot_iter_3/")) == [
        "snapshot_iter_3/data/rank0.bin", "snapshot_iter_3/index/rank0.idx", "snapshot_iter_3/index/shared.idx",
        "snapshot_iter_3/manifest.json"]  # no .parts/ left
    assert main(["prune", url, "--keep-latest", "1"]) == 0
    assert sorted({p.removeprefix(f"{url}/").split("/")[0] for p in fs.find(url)}) == ["snapshot_iter_3"]
    out = StateDict(x=torch.zeros(4))
    Snapshot(f"{url}/snapshot_iter_3").restore({"s": out})
    assert torch.equal(out["x"], torch.full((4,), 3.0))
