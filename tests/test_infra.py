"""Tests of the shared test infrastructure (tests/_dist.py, tests/conftest.py)."""

import os
import time

import fsspec
import pytest
import torch
import torch.distributed as dist

import _dist


# Functions run by dist_run must be module-level so workers can import them.


def _all_reduce_rank():
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"rank": rank, "world": world, "sum": t.item(), "threads": torch.get_num_threads()}


def _scaled_all_gather(scale):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(out, torch.tensor([rank, rank * scale]))
    return torch.stack(out).tolist()


def _fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    return dist.get_rank()


def _print_and_return_pid():
    print(f"hello from rank {dist.get_rank()}")
    return os.getpid()


def _store_port():
    return dist.distributed_c10d._get_default_store().underlying_store.port


def _sleep(seconds):
    time.sleep(seconds)
    return dist.get_rank()


def _refuse_to_unpickle():
    raise ValueError("this argument does not unpickle")


class _Unpicklable:
    """An argument that pickles here and raises where a worker unpickles it: rank 0 fails before its store."""
    def __reduce__(self):
        return _refuse_to_unpickle, ()


def _s3_write_rank(url_prefix, storage_options):
    rank = dist.get_rank()
    fs = fsspec.filesystem("s3", **storage_options)
    path = f"{url_prefix}/rank{rank}.bin"
    fs.pipe_file(path, bytes([rank]) * 3)
    dist.barrier()
    other = (rank + 1) % dist.get_world_size()
    return fs.cat_file(f"{url_prefix}/rank{other}.bin")


@pytest.mark.parametrize("world_size", [2, 3])
def test_dist_run_all_reduce(dist_run, world_size):
    results = dist_run(_all_reduce_rank, world_size)
    expected_sum = float(sum(range(1, world_size + 1)))
    assert results == [
        {"rank": r, "world": world_size, "sum": expected_sum, "threads": 1} for r in range(world_size)
    ]


def test_dist_run_passes_args(dist_run):
    results = dist_run(_scaled_all_gather, 2, 10)
    assert results == [[[0, 0], [1, 10]]] * 2


def test_dist_run_failing_rank_reports_and_pool_recovers(dist_run):
    with pytest.raises(AssertionError) as excinfo:
        dist_run(_fail_on_rank_1, 2)
    msg = str(excinfo.value)
    assert "rank 1 failed" in msg
    assert "ValueError: boom from rank 1" in msg
    assert "rank 0 failed" not in msg
    # Same workers, group destroyed: the next call works.
    assert dist_run(_all_reduce_rank, 2)[1]["sum"] == 3.0


def test_dist_run_reuses_workers_and_replays_output(dist_run, capsys):
    pids1 = dist_run(_print_and_return_pid, 2)
    pids2 = dist_run(_print_and_return_pid, 2)
    assert pids1 == pids2 and len(set(pids1)) == 2 and os.getpid() not in pids1
    out = capsys.readouterr().out
    assert "[rank 0] hello from rank 0" in out and "[rank 1] hello from rank 1" in out


def test_dist_run_groups_take_their_port_from_the_kernel(dist_run):
    """Not from the tests' port blocks, where another suite's group on the same machine may pick the same port."""
    ports = dist_run(_store_port, 3)
    blocks = range(_dist._FIRST_PORT, _dist._FIRST_PORT + _dist._PORT_BLOCK * _dist._BLOCKS)
    assert len(set(ports)) == 1 and ports[0] not in blocks


def test_dist_run_rank_0_failing_before_its_store_restarts_the_pool(dist_run):
    pids = dist_run(_print_and_return_pid, 2)
    with pytest.raises(AssertionError, match="rank 0 failed before its store listened") as excinfo:
        dist_run(_sleep, 2, _Unpicklable())
    assert "ValueError: this argument does not unpickle" in str(excinfo.value)
    again = dist_run(_print_and_return_pid, 2)
    assert not set(again) & set(pids)  # workers of a new pool


def test_dist_run_timeout_kills_pool_and_restarts(dist_run):
    with pytest.raises(AssertionError, match="timed out"):
        dist_run(_sleep, 2, 30, timeout=1)
    assert dist_run(_sleep, 2, 0) == [0, 1]


def test_s3_bucket_roundtrip(s3_bucket):
    url, storage_options = s3_bucket
    assert url.startswith("s3://")
    fs = fsspec.filesystem("s3", **storage_options)
    fs.pipe_file(f"{url}/dir/blob.bin", b"\x00hello\xff")
    assert fs.cat_file(f"{url}/dir/blob.bin") == b"\x00hello\xff"
    with fsspec.open(f"{url}/dir/blob.bin", "rb", **storage_options) as f:
        assert f.read() == b"\x00hello\xff"
    assert fs.ls(f"{url}/dir", detail=False) == [f"{url[len('s3://'):]}/dir/blob.bin"]


def test_s3_buckets_are_fresh(s3_bucket):
    url, storage_options = s3_bucket
    fs = fsspec.filesystem("s3", **storage_options)
    assert fs.ls(url, detail=False) == []


def test_s3_from_dist_workers(dist_run, s3_bucket):
    url, storage_options = s3_bucket
    assert dist_run(_s3_write_rank, 2, url, storage_options) == [b"\x01" * 3, b"\x00" * 3]
