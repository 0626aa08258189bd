"""Retries and failures on Google Cloud Storage and Azure, through a fault-injecting proxy (``_fault_proxy.py``)
in front of each emulator: transient 5xx are absorbed (data, parts, manifest), persistent ones fail the take
within the store's documented bound, and nothing of a failed take is visible. (S3: tests/test_s3_faults.py.)"""
from __future__ import annotations

import math
import types

import fsspec
import pytest
import torch

from ppe_snapshot import Snapshot, SnapshotNotFoundError, StateDict
from ppe_snapshot.storage.stores import azure as azure_store

from _fault_proxy import FaultProxy

#: Parts small enough that a 1 MiB state goes up in 4.
PARTS = {"ppe_part_size": 256 << 10}


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1 << 18, dtype=torch.float32), "b": torch.ones(7)}


def _assert_restores(path: str, options: dict) -> None:
    out = StateDict({k: torch.zeros_like(v) for k, v in _state().items()})
    Snapshot(path, storage_options=options).restore({"s": out})
    assert all(torch.equal(out[k], v) for k, v in _state().items())


def _nothing_at(path: str, options: dict) -> None:
    scheme = path.split("://", 1)[0]
    fs = fsspec.filesystem(scheme, skip_instance_cache=True, **options)
    assert fs.find(path) == []
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(path, storage_options=options).restore({"s": StateDict(_state())})


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    """The waits the stores' retry policies ask for, recorded instead of slept (the requests are real)."""
    gcs_retry = pytest.importorskip("gcsfs.retry", reason="gcsfs is not installed (make venv installs it)")
    azure_policies = pytest.importorskip("azure.storage.blob._shared.policies_async",
                                         reason="adlfs is not installed (make venv installs it)")
    asked: list[float] = []

    async def gcs_wait(seconds: float) -> None:
        asked.append(seconds)

    async def azure_wait(policy, settings, transport) -> None:
        asked.append(policy.get_backoff_time(settings))
    monkeypatch.setattr(gcs_retry, "asyncio", types.SimpleNamespace(sleep=gcs_wait))
    monkeypatch.setattr(azure_policies.AsyncStorageRetryPolicy, "sleep", azure_wait)
    return asked


@pytest.fixture
def gcs(gcs_bucket):
    """``(snapshot url, storage options through the proxy, proxy, options straight to the emulator)``."""
    url, options = gcs_bucket
    proxy = FaultProxy(options["endpoint_url"])
    try:
        yield f"{url}/run/snap", {**options, "endpoint_url": proxy.url}, proxy, options
    finally:
        proxy.close()


@pytest.fixture
def azure(az_container, azurite):
    url, options = az_container
    proxy = FaultProxy(f"http://127.0.0.1:{azurite.port}")
    through = {"connection_string": options["connection_string"].replace(f"127.0.0.1:{azurite.port}",
                                                                          proxy.url.removeprefix("http://"))}
    try:
        yield f"{url}/run/snap", through, proxy, options
    finally:
        proxy.close()


# -- Google Cloud Storage: gcsfs's own policy (6 attempts) ----------------------------------------------------

GCS_UPLOAD = r"/upload/storage/v1/b/[^/]+/o\?uploadType=multipart"  # a whole object: small files, the manifest
GCS_PART_2 = r"uploadType=media&name=[^&]*-00002"


def test_gcs_persistent_errors_fail_within_the_bound_and_leave_nothing(gcs, waits):
    """gcsfs waits 2**(n-1) s plus up to 1 s before retry n."""
    path, options, proxy, direct = gcs
    proxy.fail_always("POST", GCS_PART_2, 500)
    with pytest.raises(Exception, match="500|injected"):
        Snapshot.take(path, {"s": StateDict(_state())}, storage_options={**options, **PARTS})
    assert proxy.requests("POST", GCS_PART_2) == [500] * 6
    assert len(waits) == 5 and all(2 ** n <= wait <= 2 ** n + 1 for n, wait in enumerate(waits))
    _nothing_at(path, direct)  # the other parts' components removed, no manifest


GCS_DATA_READ = r"/download/storage/v1/b/[^/]+/o/[^?]*data%2Frank0\.bin\?alt=media"  # ranged reads, streamed


def test_gcs_reads_absorb_transient_errors_and_bodies_cut_off(gcs, waits):
    """A ranged read streamed into place follows gcsfs's policy too: 5xx retried, and a response whose body
    breaks off halfway is read again from its start (the restore is bit-exact)."""
    path, options, proxy, direct = gcs
    Snapshot.take(path, {"s": StateDict(_state())}, storage_options=direct)
    proxy.fail("GET", GCS_DATA_READ, [503, 500])
    _assert_restores(path, options)
    first = proxy.requests("GET", GCS_DATA_READ)  # the data file is read in two ranges, in parallel
    assert sorted(first) == [206, 206, 500, 503]
    proxy.cut_off("GET", GCS_DATA_READ, 2)
    _assert_restores(path, options)
    assert sorted(proxy.requests("GET", GCS_DATA_READ)[len(first):]) == [0, 0, 206, 206]
    assert len(waits) == 4


def test_gcs_a_read_that_keeps_failing_fails_after_six_attempts(gcs, waits):
    path, options, proxy, direct = gcs
    Snapshot.take(path, {"s": StateDict(_state())}, storage_options=direct)
    proxy.fail_always("GET", GCS_DATA_READ, 503)
    with pytest.raises(Exception, match="503|injected"):
        _assert_restores(path, options)
    assert proxy.requests("GET", GCS_DATA_READ) == [503] * 12  # two ranges, 6 attempts each
    # each range waits 2**(n-1) s plus up to 1 s before its retry n
    assert sorted(math.floor(math.log2(wait)) for wait in waits) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


# -- Azure: AZURE_RETRIES on adlfs's client --------------------------------------------------------------------

AZ_MANIFEST = r"/run/snap/manifest\.json(\?|$)"
AZ_BLOCK_2 = r"comp=block&blockid=cHBlLTAwMDAwMDAy"  # base64 of "ppe-00000002"
AZ_BLOCK_LIST = r"comp=blocklist"


def test_azure_persistent_errors_fail_after_the_documented_attempts(azure, waits):
    assert azure_store.AZURE_RETRIES == {"attempts": 5, "initial_backoff": 0.25, "increment_base": 1.5,
                                            "jitter": 0.5}
    path, options, proxy, direct = azure
    proxy.fail_always("PUT", AZ_BLOCK_LIST, 503)
    with pytest.raises(Exception, match="503|injected|Unavailable"):
        Snapshot.take(path, {"s": StateDict(_state())}, storage_options={**options, **PARTS})
    assert proxy.requests("PUT", AZ_BLOCK_LIST) == [503] * 5
    # 0.25 + 1.5**n s, +-0.5 s, before retry n: about 13 s in all, at most 15
    assert len(waits) == 4 and all(abs(wait - (0.25 + 1.5 ** n)) <= 0.5 for n, wait in enumerate(waits, 1))
    assert sum(waits) <= 15
    _nothing_at(path, direct)  # the staged blocks were never committed: no blob, no manifest


# -- both ----------------------------------------------------------------------------------------------------

#: Per store: (method, path pattern, statuses injected, status of the attempt that then succeeds).
TRANSIENT = {
    "gcs": [("POST", GCS_UPLOAD, [503, 500], 200), ("POST", GCS_PART_2, [503, 502], 200)],
    "azure": [("PUT", AZ_BLOCK_2, [503, 500], 201), ("PUT", AZ_MANIFEST, [503, 503], 201)],
}


@pytest.mark.parametrize("store", ["gcs", "azure"])
def test_transient_errors_are_absorbed_on_parts_and_whole_objects(store, request, waits):
    path, options, proxy, _ = request.getfixturevalue(store)
    for method, pattern, statuses, _ in TRANSIENT[store]:
        proxy.fail(method, pattern, statuses)
    Snapshot.take(path, {"s": StateDict(_state())}, storage_options={**options, **PARTS})
    for method, pattern, statuses, ok in TRANSIENT[store]:
        assert proxy.requests(method, pattern)[:len(statuses) + 1] == [*statuses, ok]
    _assert_restores(path, options)
