"""Object stores at network speed: parallel multipart uploads and parallel ranged reads on the moto S3 server.

The fault proxy (tests/_fault_proxy.py) sits in front of the server: it logs every request, injects failures,
and its gates hold requests until several are in flight at once, which proves they were sent in parallel.
"""
from __future__ import annotations

import math

import pytest
import torch

from ppe_snapshot import CorruptSnapshotError, Snapshot, StateDict
from ppe_snapshot.storage import FsspecStorage, LocalStorage, open_storage, split_tuning

from _asserts import assert_ranged_reads_scatter

PART = r"data/rank0\.bin\?partNumber="
DATA = r"/run/snap/data/rank0\.bin"


def _state(seed: int = 7) -> dict[str, torch.Tensor]:
    """26 MiB and change: a 24 MiB tensor, odd-sized small ones, and integers."""
    g = torch.Generator().manual_seed(seed)
    state = {"big": torch.randn(6 << 20, generator=g), "ids": torch.arange(12345, dtype=torch.int64)}
    for i in range(20):
        state[f"small{i}"] = torch.randn(10_000 + 977 * i, generator=g)
    return state


def _restored(path: str, options: dict, expected: dict[str, torch.Tensor]) -> StateDict:
    target = StateDict({k: torch.zeros_like(v) for k, v in expected.items()})
    Snapshot(path, storage_options=options).restore({"s": target})
    return target


def _assert_equal(actual: StateDict, expected: dict[str, torch.Tensor]) -> None:
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


def _data_size(client, path: str) -> int:
    bucket, key = path[len("s3://"):].split("/", 1)
    return client.head_object(Bucket=bucket, Key=f"{key}/data/rank0.bin")["ContentLength"]


@pytest.mark.parametrize("staged", [False, True], ids=["sync", "async"])
def test_multipart_upload_sends_several_parts_at_once(proxied, staged):
    path, options, proxy, client = proxied
    options = {**options, "ppe_part_size": 5 << 20, "ppe_upload_concurrency": 4}
    proxy.hold_until("PUT", PART, 3)  # the first three parts must be in the proxy together
    state = _state()
    if staged:
        Snapshot.async_take(path, {"s": StateDict(state)}, storage_options=options).wait()
    else:
        Snapshot.take(path, {"s": StateDict(state)}, storage_options=options)
    assert proxy.gates_passed == 1
    parts = math.ceil(_data_size(client, path) / (5 << 20))
    assert parts == 6
    for number in range(1, parts + 1):
        assert proxy.requests("PUT", rf"{PART}{number}&") == [200], number
    assert proxy.requests("POST", r"data/rank0\.bin\?uploads") == [200]
    assert proxy.requests("POST", r"data/rank0\.bin\?uploadId=") == [200]  # completed once
    _assert_equal(_restored(path, options, state), state)


def test_a_part_failing_for_a_while_is_retried_alone(proxied):
    path, options, proxy, client = proxied
    options = {**options, "ppe_part_size": 5 << 20, "ppe_upload_concurrency": 3}
    proxy.fail("PUT", rf"{PART}4&", [503, 500])
    Snapshot.take(path, {"s": StateDict(_state())}, storage_options=options)
    assert proxy.requests("PUT", rf"{PART}4&") == [503, 500, 200]
    assert all(proxy.requests("PUT", rf"{PART}{n}&") == [200] for n in (1, 2, 3, 5, 6))
    bucket = path.split("/")[2]
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    _assert_equal(_restored(path, options, _state()), _state())


def test_a_part_failing_for_good_aborts_the_upload(proxied):
    path, options, proxy, client = proxied
    options = {**options, "ppe_part_size": 5 << 20, "ppe_upload_concurrency": 4,
               "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 2}}}
    proxy.fail_always("PUT", rf"{PART}3&", 503)
    with pytest.raises(OSError, match="injected by the test proxy"):
        Snapshot.take(path, {"s": StateDict(_state())}, storage_options=options)
    assert proxy.requests("PUT", rf"{PART}3&") == [503, 503]
    assert proxy.requests("DELETE", r"data/rank0\.bin\?uploadId=") == [204]  # the upload was aborted
    assert proxy.requests("POST", r"data/rank0\.bin\?uploadId=") == []  # and never completed
    bucket = path.split("/")[2]
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert client.list_objects_v2(Bucket=bucket).get("Contents", []) == []


def test_reads_are_split_into_ranges_fetched_in_parallel(proxied):
    path, options, proxy, client = proxied
    state = _state(11)
    Snapshot.take(path, {"s": StateDict(state)}, storage_options=options)
    size = _data_size(client, path)
    proxy.clear()
    proxy.log.clear()
    # 100,000-byte ranges: pieces start and end inside tensors and inside the gaps between them
    options = {**options, "ppe_read_part_size": 100_000, "ppe_read_workers": 4}
    proxy.hold_until("GET", rf"{DATA}$", 4)
    _assert_equal(_restored(path, options, state), state)
    assert proxy.gates_passed == 1
    gets = proxy.requests("GET", rf"{DATA}$")
    assert len(gets) >= math.ceil(size / 100_000) and set(gets) == {206}


def test_ranges_are_read_where_response_bodies_have_no_readinto(s3_bucket, monkeypatch):
    """aiobotocore before 2.23 gives a response body ``read`` but no ``readinto`` (its body proxies aiohttp's
    response, which has none): each range is read and copied into place, bit-exact. A newer aiobotocore's
    ``readinto`` is hidden for the test."""
    from aiobotocore import response

    def none_there(body):
        raise AttributeError("readinto")
    url, options = s3_bucket
    path, state = f"{url}/run/snap", _state(14)
    Snapshot.take(path, {"s": StateDict(state)}, storage_options=options)
    for body in (getattr(response, name, None) for name in ("AioStreamingBody", "StreamingBody")):
        if body is not None and "readinto" in vars(body):  # aiobotocore 2.23 and later
            monkeypatch.setattr(body, "readinto", property(none_there))
    _assert_equal(_restored(path, {**options, "ppe_read_part_size": 100_000, "ppe_read_workers": 4}, state), state)


def test_read_object_of_one_large_tensor_uses_ranges(proxied):
    path, options, proxy, _ = proxied
    state = _state(12)
    Snapshot.take(path, {"s": StateDict(state)}, storage_options=options)
    proxy.log.clear()
    options = {**options, "ppe_read_part_size": 1 << 20}
    value = Snapshot(path, storage_options=options).read_object("0/s/big")
    assert torch.equal(value, state["big"])
    assert len(proxy.requests("GET", rf"{DATA}$")) == 24  # 24 MiB in 1 MiB ranges


def test_a_truncated_data_object_fails_the_ranged_read(proxied):
    path, options, _, client = proxied
    state = _state(13)
    Snapshot.take(path, {"s": StateDict(state)}, storage_options=options)
    bucket, key = path[len("s3://"):].split("/", 1)
    data = client.get_object(Bucket=bucket, Key=f"{key}/data/rank0.bin")["Body"].read()
    client.put_object(Bucket=bucket, Key=f"{key}/data/rank0.bin", Body=data[: len(data) // 2])
    target = StateDict({k: torch.zeros_like(v) for k, v in state.items()})
    with pytest.raises(CorruptSnapshotError, match="missing or truncated"):
        Snapshot(path, storage_options={**options, "ppe_read_part_size": 1 << 20}).restore({"s": target})


def test_knobs_are_checked_and_never_reach_fsspec(s3_bucket, tmp_path):
    url, options = s3_bucket
    with pytest.raises(ValueError, match="below S3's minimum part size"):
        open_storage(f"{url}/x", {**options, "ppe_part_size": 1 << 20})
    with pytest.raises(ValueError, match=r"storage_options\['ppe_read_workers'\] = 0: expected a positive"):
        open_storage(f"{url}/x", {**options, "ppe_read_workers": 0})
    storage = open_storage(f"{url}/x", {**options, "ppe_read_workers": "5", "ppe_upload_concurrency": 20})
    assert isinstance(storage, FsspecStorage) and storage.read_workers == 5
    assert not any(key.startswith("ppe_") for key in storage.fs.storage_options)
    assert storage.fs.storage_options["config_kwargs"]["max_pool_connections"] == 20
    # local paths keep the local storage, knobs or not; a plain fsspec file system keeps the generic path
    assert isinstance(open_storage(str(tmp_path), {"ppe_read_workers": 8}), LocalStorage)
    assert open_storage("memory://ppe-snapshot-knobs", {"ppe_read_workers": 8}).read_workers == 2


def test_readers_in_flight_default_per_store(monkeypatch):
    """32 ranged readers, 64 on GCS (its reads hold no memory); the environment or the options set any store's."""
    from ppe_snapshot.settings import SETTINGS

    assert [split_tuning(None, url)[0].read_workers for url in ("s3://b/x", "gs://b/x", "gcs://b/x", "az://c/x")] \
        == [32, 64, 64, 32]
    assert split_tuning({"ppe_read_workers": 8}, "gs://b/x")[0].read_workers == 8
    monkeypatch.setattr(SETTINGS, "read_workers", 16)
    assert split_tuning(None, "gs://b/x")[0].read_workers == 16


def test_the_generic_ranged_path_scatters_cat_file_ranges(s3_bucket):
    """The path of remote stores that do not stream (adlfs, http): ``cat_file`` of each range, copied into
    place. Run here on the real S3 server with s3fs's streaming turned off."""
    url, options = s3_bucket
    assert_ranged_reads_scatter(open_storage(url, options), stream=False)


def test_every_opener_of_a_url_takes_the_knobs_out_and_shares_one_file_system(s3_bucket):
    """The run-directory listing, the replacing writer and the single-file writer open the same s3fs instance as
    the engine, with the retry policy and without the ``ppe_*`` keys."""
    from ppe_snapshot.run_dir.listing import filesystem

    url, options = s3_bucket
    knobs = {**options, "ppe_read_workers": 4, "ppe_part_size": 6 << 20}
    engine_fs = open_storage(f"{url}/run/snap", knobs).fs
    listing_fs, root = filesystem(f"{url}/run", knobs)
    assert listing_fs is engine_fs and root.endswith("/run")
    assert not any(key.startswith("ppe_") for key in listing_fs.storage_options)
    assert listing_fs.storage_options["config_kwargs"]["retries"]["total_max_attempts"] == 5
