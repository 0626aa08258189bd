"""Shared test fixtures.

``dist_run``     real multi-process gloo runs on a reused pool of spawned workers
``s3_endpoint``  a real S3-protocol server (moto) on 127.0.0.1 for the session
``s3_bucket``    a fresh bucket per test, as ``("s3://<bucket>", storage_options)``
``gcs_bucket``   the same on a Google Cloud Storage emulator (``gs://``)
``az_container`` the same on Azurite, Azure's blob storage emulator (``az://``)
``object_store`` each of the three in turn, as an :class:`ObjectStore`

The Process writers' workers of the tests' own process start warm (``_writer_workers_start_warm``).
"""

from __future__ import annotations

import os
import sys
import types
import uuid
from dataclasses import dataclass
from typing import Any

import pytest

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

import _dist  # noqa: E402
import _warm  # noqa: E402

# Two pytest-xdist workers share CI's 2 cores: torch's intra-op threads, in each worker and in the processes its
# tests start, would only crowd them (set before torch is first imported here).
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# gcsfs asks a bucket's type over gRPC at its first use, which an emulator does not answer (60 s per bucket):
# off for the whole session, set before any worker process starts so that every process inherits it.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

_S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


#: The files whose tests start processes for most of their time, slowest first (about 20-50 s each on 2 cores,
#: most of their processes forked warm: ``_warm.py``). ``make test`` runs the suite on two pytest-xdist workers, a
#: file to a worker, in collection order: these go first so that neither worker is left alone with a long file at
#: the end.
_LONG_FILES = ("test_local_tier.py", "test_preemption.py", "test_crash.py", "test_s3_faults.py",
               "test_process_writer_scripts.py", "test_rank_failure.py", "test_object_stores.py",
               "test_distributed_outcome.py", "test_writers.py", "test_demo.py", "test_cli_kinds.py",
               "test_readme_preemption.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return _LONG_FILES.index(name) if name in _LONG_FILES else len(_LONG_FILES)
    items.sort(key=rank)  # stable: each file's tests keep their order


@pytest.fixture(autouse=True)
def _writer_workers_start_warm(request, monkeypatch):
    """The Process writers' workers that the tests' own process starts come from the warm launcher (``_warm.py``):
    each a real process of its own that runs the worker's boot code as ``python -c`` would, without the seconds
    of importing torch (about 40 workers in the suite). A test marked ``fresh_workers`` gets workers started as a
    user's are, from a fresh interpreter, and so do the processes the tests start (scripts, ranks:
    ``test_process_writer_scripts.py`` and others); ``PPE_SNAPSHOT_TESTS_WARM=0`` turns this off with the
    launcher."""
    if request.node.get_closest_marker("fresh_workers") is None:
        from ppe_snapshot.writing import _process

        monkeypatch.setattr(_process, "subprocess", types.SimpleNamespace(Popen=_warm.popen))


@pytest.fixture(scope="session")
def dist_run():
    """``dist_run(fn, world_size, *args, timeout=120) -> list`` (one result per rank).

    Runs module-level ``fn(*args)`` on ``world_size`` (1..4) ranks of a fresh
    gloo process group (its store on a port the kernel picks), on workers from a
    session-wide pool that is started lazily and reused across tests.  Raises
    ``AssertionError`` with every failing rank's traceback if any rank raised;
    on timeout the pool is killed (restarted on next use) and the call fails.
    """
    pool = _dist.get_pool()

    def run(fn, world_size, *args, timeout=120):
        return pool.run(fn, world_size, *args, timeout=timeout)

    yield run
    _dist.shutdown_pool()


@pytest.fixture(scope="session")
def s3_endpoint():
    """Session-wide moto S3 server on 127.0.0.1: yields ``{"endpoint_url": ...}`` (skipped, saying why, where the
    S3 client or the server is not installed)."""
    pytest.importorskip("s3fs", reason="s3fs is not installed (make venv installs it)")
    pytest.importorskip("moto.server", reason="moto[server] is not installed (make venv installs it)")
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in _S3_ENV}
    os.environ.update(_S3_ENV)
    # port=0: the OS picks a free port atomically; read it back after start.
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield {"endpoint_url": f"http://{host}:{port}"}
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _clear_s3fs_cache():
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh, uniquely named bucket: yields ``("s3://<bucket>", storage_options)``.

    ``storage_options`` works with ``fsspec.filesystem("s3", **storage_options)``
    and ``fsspec.open(url, **storage_options)``.  The bucket is emptied and
    deleted afterwards; s3fs's instance cache is cleared before and after.
    """
    import boto3

    endpoint_url = s3_endpoint["endpoint_url"]
    name = f"test-{uuid.uuid4().hex[:20]}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=name)
    storage_options = {
        "client_kwargs": {"endpoint_url": endpoint_url},
        "key": "testing",
        "secret": "testing",
    }
    _clear_s3fs_cache()
    try:
        yield f"s3://{name}", storage_options
    finally:
        _clear_s3fs_cache()
        try:
            paginator = client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=name):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    client.delete_objects(Bucket=name, Delete={"Objects": keys})
            client.delete_bucket(Bucket=name)
        except Exception:  # noqa: BLE001 - cleanup is best-effort
            pass


@pytest.fixture
def proxied(s3_bucket, s3_endpoint, monkeypatch):
    """``(url, storage_options, proxy, client)``: a snapshot path in the test bucket, reached through a fault
    proxy (``_fault_proxy.py``), with the default S3 retry policy in force."""
    import boto3

    from _fault_proxy import FaultProxy

    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    url, options = s3_bucket
    proxy = FaultProxy(s3_endpoint["endpoint_url"])
    client = boto3.client("s3", endpoint_url=s3_endpoint["endpoint_url"], region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    try:
        yield f"{url}/run/snap", {**options, "client_kwargs": {"endpoint_url": proxy.url}}, proxy, client
    finally:
        proxy.close()


@pytest.fixture(scope="session")
def azurite():
    """Azure's blob storage emulator on 127.0.0.1 for the session (skipped, saying why, where not installed)."""
    import _azurite

    pytest.importorskip("adlfs", reason="adlfs is not installed (make venv installs it)")
    executable = _azurite.binary()
    if executable is None:
        pytest.skip("azurite is not installed: make venv installs it with npm (npm was not found, or failed)")
    server = _azurite.Azurite(executable)
    yield server
    server.stop()


def _fresh_bucket(scheme: str, options: dict[str, Any]):
    """Yields ``("<scheme>://<new bucket>", options)``; the bucket and what it holds are removed afterwards."""
    import fsspec

    name = f"b{uuid.uuid4().hex[:20]}"
    fs = fsspec.filesystem(scheme, skip_instance_cache=True, **options)
    fs.mkdir(name)
    try:
        yield f"{scheme}://{name}", options
    finally:
        fs.rm(name, recursive=True)


@pytest.fixture
def az_container(azurite):
    """A fresh container on the emulator: yields ``("az://<container>", storage_options)``."""
    yield from _fresh_bucket("az", azurite.storage_options)


@pytest.fixture(scope="session")
def gcs_emulator():
    """A Google Cloud Storage emulator on 127.0.0.1 for the session (skipped, saying why, where not installed)."""
    pytest.importorskip("gcsfs", reason="gcsfs is not installed (make venv installs it)")
    pytest.importorskip("gcp_storage_emulator", reason="gcp-storage-emulator is not installed (make venv installs it)")
    import _gcs_emulator

    server = _gcs_emulator.GcsEmulator()
    yield server
    server.stop()


@pytest.fixture
def gcs_bucket(gcs_emulator):
    """A fresh bucket on the emulator: yields ``("gs://<bucket>", storage_options)``."""
    yield from _fresh_bucket("gs", gcs_emulator.storage_options)


@dataclass
class ObjectStore:
    """A fresh bucket (or container) of one object store: its URL, the storage options that reach it, and the
    same options as the command line's ``--storage-option`` flags."""
    kind: str
    url: str
    options: dict[str, Any]

    @property
    def cli_flags(self) -> list[str]:
        def flat(options: dict[str, Any], prefix: str = "") -> list[str]:
            flags = []
            for key, value in options.items():
                if isinstance(value, dict):
                    flags += flat(value, f"{prefix}{key}.")
                else:
                    flags.append(f"--storage-option={prefix}{key}={value}")
            return flags
        return flat(self.options)

    def fs(self) -> Any:
        """A new client of the store (no listing cache shared with the code under test)."""
        import fsspec

        return fsspec.filesystem(self.url.split("://", 1)[0], skip_instance_cache=True, **self.options)


@pytest.fixture(params=["s3", "gcs", "azure"])
def object_store(request) -> ObjectStore:
    """Each object store in turn, on its emulator on 127.0.0.1: S3 (moto), GCS, Azure (Azurite)."""
    fixture = {"s3": "s3_bucket", "gcs": "gcs_bucket", "azure": "az_container"}[request.param]
    url, options = request.getfixturevalue(fixture)
    return ObjectStore(request.param, url, options)
