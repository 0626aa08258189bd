"""The object-store knobs: multipart part size, parts in flight, ranged-read size and readers in flight.

Each is read from ``storage_options`` (the key is removed before the options reach fsspec), else from
:data:`ppe_snapshot.settings.SETTINGS` (environment variables). Local paths never use them.

``ppe_part_size`` (``PPE_SNAPSHOT_PART_MB``, in MiB; default 8 MiB)
    bytes per part of a data file's multipart upload. S3 wants at least 5 MiB. For a file of known size the
    part shrinks (down to 5 MiB) where that gives every connection a part, and grows where the file would
    need more than S3's 10,000 parts.
``ppe_upload_concurrency`` (``PPE_SNAPSHOT_UPLOAD_CONCURRENCY``; default 16)
    parts of one data file in flight.
``ppe_read_part_size`` (``PPE_SNAPSHOT_READ_PART_MB``, in MiB; default 8 MiB)
    a read is split into ranged requests of at most this many bytes (of less, down to 1 MiB, where that gives
    every reader a request).
``ppe_read_workers`` (``PPE_SNAPSHOT_READ_WORKERS``; default 32, on GCS 64)
    ranged requests in flight (one thread pool per value, shared by the storages of a process), and runs the
    engine reads at once. GCS gets more: its responses stream into place, so a reader holds no memory, and
    64 restored 512 MiB 5-15 % faster than 32 through the benchmarks' shaped proxy (where on S3 they restored
    8 x 64 MiB 20 % slower).

Memory: a writer holds at most ``ppe_upload_concurrency x ppe_part_size`` bytes of parts beyond the
state. Reads land in their destination.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ppe_snapshot.settings import SETTINGS
from ppe_snapshot.storage.stores import profile_of_url

PART_SIZE = "ppe_part_size"
UPLOAD_CONCURRENCY = "ppe_upload_concurrency"
READ_PART_SIZE = "ppe_read_part_size"
READ_WORKERS = "ppe_read_workers"
KEYS = (PART_SIZE, UPLOAD_CONCURRENCY, READ_PART_SIZE, READ_WORKERS)


@dataclass(frozen=True)
class Tuning:
    """How a storage on an object store splits its transfers (see the module docstring)."""
    part_size: int
    upload_concurrency: int
    read_part_size: int
    read_workers: int

    @property
    def connections(self) -> int:
        """HTTP connections one storage may use at once."""
        return max(self.upload_concurrency, self.read_workers)


def _positive(key: str, value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if isinstance(value, bool) or number < 1 or (isinstance(value, float) and value != number):
        raise ValueError(f"storage_options[{key!r}] = {value!r}: expected a positive whole number")
    return number


#: ``ppe_read_workers`` where neither the options nor the environment nor the URL's store profile set it.
READ_WORKERS_DEFAULT = 32


def split_tuning(storage_options: dict[str, Any] | None, url: str = "") -> tuple[Tuning, dict[str, Any]]:
    """The knobs in effect at ``url``, and ``storage_options`` without them (what goes to fsspec)."""
    profile = profile_of_url(url)
    options = dict(storage_options or {})
    given = {key: _positive(key, options.pop(key)) for key in KEYS if key in options}
    tuning = Tuning(part_size=given.get(PART_SIZE, SETTINGS.part_bytes),
                    upload_concurrency=given.get(UPLOAD_CONCURRENCY, SETTINGS.upload_concurrency),
                    read_part_size=given.get(READ_PART_SIZE, SETTINGS.read_part_bytes),
                    read_workers=given.get(READ_WORKERS) or SETTINGS.read_workers
                    or (profile is not None and profile.read_workers) or READ_WORKERS_DEFAULT)
    return tuning, options
