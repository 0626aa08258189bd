"""Storage on any fsspec file system (``s3://``, ``gs://``, ``memory://``, ...)."""
from __future__ import annotations

import os
import uuid
from typing import Any, Callable, Sequence, TypeVar

import fsspec

from ppe_snapshot.storage.base import BlobWriter, Storage, check_stored_size, naming_missing_base, split_reference
from ppe_snapshot.storage.multipart import MultipartWriter, byte_view, check_part_size, supports_multipart
from ppe_snapshot.storage.ranged import RangedReader, read_range
from ppe_snapshot.storage.tuning import Tuning, split_tuning

#: File systems of keys rather than directories: nothing to create, and there ``makedirs`` would create a
#: missing bucket, hiding a mistyped name. Every other file system gets a file's parent directories created
#: when opening the file fails for want of them (SFTP, HDFS, ``LocalFileSystem(auto_mkdir=False)``, ...).
_OBJECT_STORE_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "gcsfs", "az", "abfs", "abfss", "adl", "oss", "r2", "memory",
                           "http", "https"}
#: Stores across a network: reads there are split into ranged requests in parallel (``storage/ranged.py``).
_REMOTE_PROTOCOLS = _OBJECT_STORE_PROTOCOLS - {"memory"}

T = TypeVar("T")


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


# File systems without S3's multipart protocol stream through fsspec's file object, in blocks of this size.
_BLOCK_SIZE = 64 << 20


class _FsspecBlobWriter(BlobWriter):
    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        self._fs = fs
        self._path = path
        self._file = fs.open(path, "wb", block_size=_BLOCK_SIZE)
        self._size = 0

    def write(self, buffers: Sequence[memoryview]) -> None:
        for b in buffers:
            if b.nbytes:
                self._file.write(b)
                self._size += b.nbytes

    def close(self) -> int:
        self._file.close()
        return check_stored_size(self._fs, self._path, self._size)

    def abort(self) -> None:
        discard = getattr(self._file, "discard", None)
        try:
            if discard is not None:
                discard()  # object stores: never complete the upload
                self._file.closed = True  # else close(), or __del__, flushes into the discarded buffer
            else:
                self._file.close()
        except Exception:  # giving up anyway; the missing manifest keeps it invisible
            pass


class FsspecStorage(Storage):
    """A snapshot directory (a key prefix on object stores) on an fsspec file system."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str, tuning: Tuning | None = None) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.tuning = tuning or split_tuning(None)[0]
        self._multipart = supports_multipart(fs)
        self._ranged = RangedReader(fs, self.tuning) if set(_protocols(fs)) & _REMOTE_PROTOCOLS else None
        if self._ranged is not None:
            self.read_workers = self.tuning.read_workers

    def _abs(self, rel: str) -> str:
        reference = split_reference(rel)
        if reference is not None:  # a key of a sibling snapshot (incremental snapshots read only)
            return f"{self.root.rpartition('/')[0]}/{reference[0]}/{reference[1]}"
        return f"{self.root}/{rel}" if rel else self.root

    def _is_object_store(self) -> bool:
        return bool(set(_protocols(self.fs)) & _OBJECT_STORE_PROTOCOLS)

    def _with_parent(self, path: str, create: Callable[[], T]) -> T:
        """``create()``; where it fails for a missing parent directory, make the directories and retry."""
        try:
            return create()
        except FileNotFoundError:
            if self._is_object_store():
                raise
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        return create()

    def open_writer(self, rel: str, size: int | None = None) -> BlobWriter:
        path = self._abs(rel)
        if self._multipart:  # object stores: parts in parallel
            return MultipartWriter(self.fs, path, self.tuning, size)
        return self._with_parent(path, lambda: _FsspecBlobWriter(self.fs, path))

    def put_atomic(self, rel: str, data: bytes) -> None:
        # One PUT on object stores: the object appears whole or not at all. Elsewhere a file is
        # visible, empty, as soon as it is created: write it beside, then rename it into place.
        path = self._abs(rel)
        if self._is_object_store():
            self._with_parent(path, lambda: self.fs.pipe_file(path, data))
        else:
            temporary = f"{rel}.tmp-{uuid.uuid4().hex[:12]}"
            self._with_parent(self._abs(temporary), lambda: self.fs.pipe_file(self._abs(temporary), data))
            try:
                self.fs.mv(self._abs(temporary), path)
            except BaseException:
                self.remove(temporary)
                raise
        self.fs.invalidate_cache(path)

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self._abs(rel))

    def read_into(self, rel: str, offset: int, out: memoryview) -> None:
        self.read_vectored(rel, offset, [out])

    def read_vectored(self, rel: str, offset: int, views: Sequence[memoryview]) -> None:
        with naming_missing_base(self.url, rel):
            if self._ranged is not None:  # ranged requests in parallel, into the views
                self._ranged.read(self._abs(rel), offset, views)
            else:
                read_range(self.fs, self._abs(rel), offset, [byte_view(v) for v in views])

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self._abs(rel))

    def is_file(self, rel: str) -> bool:
        # An object store's key does not stand in the way of keys under it: no requests to ask (a take's first).
        return not self._is_object_store() and self.fs.isfile(self._abs(rel))

    def size(self, rel: str) -> int:
        with naming_missing_base(self.url, rel):
            return self.fs.size(self._abs(rel))

    def remove(self, rel: str) -> None:
        try:
            self.fs.rm_file(self._abs(rel))
        except FileNotFoundError:
            pass


#: The retry policy of every S3 request (data PUTs, each multipart part, the manifest PUT, reads), as botocore's
#: ``retries`` config: up to 5 attempts per request, retrying throttling, timeouts, connection errors and HTTP
#: 500 / 502 / 503 / 504, waiting a random 0..2**n s (at most 20 s) before retry n. A request that keeps
#: failing thus gives up after 5 attempts and at most 1 + 2 + 4 + 8 = 15 s of waiting (plus the requests' own
#: timeouts). Override it with ``storage_options={"config_kwargs": {"retries": {...}}}`` (botocore's keys:
#: ``mode``, ``total_max_attempts`` / ``max_attempts``), or with botocore's ``AWS_RETRY_MODE`` /
#: ``AWS_MAX_ATTEMPTS`` environment variables, which this default then leaves alone.
S3_RETRIES: dict[str, Any] = {"mode": "standard", "total_max_attempts": 5}


#: The retry policy of every Azure request (adlfs's client: data blocks, their commit, the manifest, reads and
#: listings), set on the client's retry policy of the Azure SDK (whose default waits 15 s before the first retry):
#: up to 5 attempts per request, retrying timeouts, connection errors and HTTP 408 / 500 / 502 / 503 / 504, waiting
#: 0.25 + 1.5**n s (+-0.5 s) before retry n, so that a request that keeps failing gives up after at most about
#: 15 s of waiting in all, as on S3.
AZURE_RETRIES: dict[str, float] = {"attempts": 5, "initial_backoff": 0.25, "increment_base": 1.5, "jitter": 0.5}


def use_azure_retries(fs: Any) -> None:
    """Set :data:`AZURE_RETRIES` on an adlfs file system's client (its retry policy is shared by every client
    made from it), once per cached instance."""
    client = getattr(fs, "service_client", None)
    policy = getattr(getattr(client, "_config", None), "retry_policy", None)
    if policy is None or getattr(policy, "ppe_snapshot_policy", False):
        return
    retries = int(AZURE_RETRIES["attempts"]) - 1
    policy.total_retries = policy.connect_retries = policy.read_retries = policy.status_retries = retries
    policy.initial_backoff = AZURE_RETRIES["initial_backoff"]
    policy.increment_base = AZURE_RETRIES["increment_base"]
    policy.random_jitter_range = AZURE_RETRIES["jitter"]
    policy.ppe_snapshot_policy = True


def with_retry_policy(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` with :data:`S3_RETRIES` for ``s3://`` URLs unless the caller chose a policy."""
    options = dict(storage_options or {})
    if url.split("://", 1)[0] not in ("s3", "s3a") or "AWS_RETRY_MODE" in os.environ \
            or "AWS_MAX_ATTEMPTS" in os.environ:
        return options
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", dict(S3_RETRIES))
    options["config_kwargs"] = config
    return options


def with_connections(url: str, options: dict[str, Any], tuning: Tuning) -> dict[str, Any]:
    """``options`` with a connection pool for ``s3://`` as large as the parts and reads in flight (botocore
    keeps 10 by default), unless the caller chose ``config_kwargs["max_pool_connections"]``."""
    if url.split("://", 1)[0] not in ("s3", "s3a"):
        return options
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("max_pool_connections", tuning.connections)
    return {**options, "config_kwargs": config}


#: The extra of ppe-snapshot that installs the file system of a URL scheme, and the package it installs.
EXTRAS = {"s3": ("s3", "s3fs"), "s3a": ("s3", "s3fs"), "gs": ("gcs", "gcsfs"), "gcs": ("gcs", "gcsfs"),
          "az": ("azure", "adlfs"), "abfs": ("azure", "adlfs"), "abfss": ("azure", "adlfs")}


def url_to_fs(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec file system of ``url`` and the path there, as every part of ppe-snapshot opens it: the knobs of
    ``storage/tuning.py`` taken out of ``storage_options``, the retry policy (:data:`S3_RETRIES`) and connection
    pool of ``s3://`` added (so every user of one URL shares fsspec's cached file system instance).

    A URL whose file system is not installed raises an ``ImportError`` naming the extra that installs it.
    """
    tuning, options = split_tuning(storage_options, str(url))
    try:
        fs, path = fsspec.core.url_to_fs(str(url), **with_connections(str(url), with_retry_policy(str(url), options),
                                                                      tuning))
    except ImportError as e:
        scheme = str(url).split("://", 1)[0]
        if scheme not in EXTRAS:
            raise
        extra, package = EXTRAS[scheme]
        raise ImportError(f"{url}: {scheme}:// needs {package}, which is not installed: "
                          f"pip install 'ppe-snapshot[{extra}]'") from e
    use_azure_retries(fs)
    return fs, path


def open_url(url: str, mode: str, storage_options: dict[str, Any] | None = None) -> Any:
    """The file at ``url`` opened in ``mode`` (a file object of the URL's file system, see :func:`url_to_fs`)."""
    fs, path = url_to_fs(url, storage_options)
    return fs.open(path, mode)


def fsspec_storage(url: str, storage_options: dict[str, Any] | None) -> FsspecStorage:
    """The snapshot directory at ``url`` (see :func:`url_to_fs`)."""
    tuning = split_tuning(storage_options, url)[0]
    fs, root = url_to_fs(url, storage_options)
    check_part_size(fs, tuning.part_size)
    return FsspecStorage(fs, root, url, tuning)
