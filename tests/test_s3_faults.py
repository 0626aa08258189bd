"""S3 request failures: the retry policy of ppe_snapshot.storage.fsspec.S3_RETRIES.

A fault-injecting proxy (tests/_fault_proxy.py) sits between s3fs and the real
S3-protocol test server and answers chosen requests with 500 / 503.
"""
from __future__ import annotations

import pytest
import torch

from ppe_snapshot import Snapshot, SnapshotNotFoundError, StateDict
from ppe_snapshot.storage.stores import s3 as s3_store

MANIFEST_PUT = r"/run/snap/manifest\.json$"
DATA_PUT = r"/run/snap/data/rank0\.bin$"


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(1000, generator=g), "ids": torch.arange(77)}


def _assert_restores(path: str, options: dict, expected: dict[str, torch.Tensor]) -> None:
    target = StateDict({k: torch.zeros_like(v) for k, v in expected.items()})
    Snapshot(path, storage_options=options).restore({"s": target})
    for key, value in expected.items():
        assert torch.equal(target[key], value), key


def _keys(client, url: str) -> list[str]:
    bucket = url.split("/")[2]
    return [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]


def test_two_503s_and_a_500_are_absorbed_on_data_and_manifest(proxied):
    path, options, proxy, _ = proxied
    proxy.fail("PUT", DATA_PUT, [503, 503, 500])
    proxy.fail("PUT", MANIFEST_PUT, [503, 500, 503])
    Snapshot.take(path, {"s": StateDict(_state())}, storage_options=options)
    assert proxy.requests("PUT", DATA_PUT) == [503, 503, 500, 200]
    assert proxy.requests("PUT", MANIFEST_PUT) == [503, 500, 503, 200]
    _assert_restores(path, options, _state())


def test_persistent_500s_fail_after_the_documented_attempts(proxied):
    path, options, proxy, client = proxied
    assert s3_store.S3_RETRIES == {"mode": "standard", "total_max_attempts": 5}
    proxy.fail_always("PUT", MANIFEST_PUT, 500)
    with pytest.raises(OSError, match="injected by the test proxy"):
        Snapshot.take(path, {"s": StateDict(_state())}, storage_options=options)
    assert proxy.requests("PUT", MANIFEST_PUT) == [500] * 5
    assert not any(key.endswith("manifest.json") for key in _keys(client, path))
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(path, storage_options=options).restore({"s": StateDict(_state())})


def test_retry_policy_is_configurable_through_storage_options(proxied):
    path, options, proxy, _ = proxied
    options = {**options, "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 2}}}
    proxy.fail_always("PUT", DATA_PUT, 503)
    with pytest.raises(OSError):
        Snapshot.take(path, {"s": StateDict(_state())}, storage_options=options)
    assert proxy.requests("PUT", DATA_PUT) == [503, 503]
    assert proxy.requests("PUT", MANIFEST_PUT) == []  # the failed data write stops the take before its commit

    proxy.clear()  # more attempts than failures: absorbed
    options["config_kwargs"]["retries"]["total_max_attempts"] = 4
    proxy.fail("PUT", MANIFEST_PUT, [500, 500, 503])
    Snapshot.take(path, {"s": StateDict(_state())}, storage_options=options)
    assert proxy.requests("PUT", MANIFEST_PUT) == [500, 500, 503, 200]
    _assert_restores(path, options, _state())


def _multipart_state() -> dict[str, torch.Tensor]:
    """Three 6 MiB tensors: with 5 MiB parts, the data file goes up as a multipart upload of 3 parts."""
    g = torch.Generator().manual_seed(5)
    return {name: torch.randn(6 << 18, generator=g) for name in ("a", "b", "c")}


def test_multipart_parts_are_retried(proxied):
    path, options, proxy, _ = proxied
    options = {**options, "ppe_part_size": 5 << 20}
    proxy.fail("PUT", r"data/rank0\.bin\?partNumber=2&", [503, 503, 500])
    Snapshot.take(path, {"s": StateDict(_multipart_state())}, storage_options=options)
    assert proxy.requests("PUT", r"data/rank0\.bin\?partNumber=2&") == [503, 503, 500, 200]
    assert proxy.requests("PUT", r"data/rank0\.bin\?partNumber=3&") == [200]
    _assert_restores(path, options, _multipart_state())


def test_failed_multipart_upload_leaves_no_object_and_no_open_upload(proxied):
    path, options, proxy, client = proxied
    options = {**options, "ppe_part_size": 5 << 20}
    proxy.fail_always("PUT", r"data/rank0\.bin\?partNumber=2&", 500)
    with pytest.raises(OSError):
        Snapshot.take(path, {"s": StateDict(_multipart_state())}, storage_options=options)
    assert proxy.requests("PUT", r"data/rank0\.bin\?partNumber=2&") == [500] * 5
    assert proxy.requests("POST", r"data/rank0\.bin\?uploads") == [200]  # it was a multipart upload
    assert proxy.requests("DELETE", r"data/rank0\.bin\?uploadId=") == [204]  # and it was aborted
    bucket = path.split("/")[2]
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert _keys(client, path) == []
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(path, storage_options=options).restore({"s": StateDict(_multipart_state())})
