"""Tuning settings, read once from the environment at import.

A leaf module like :mod:`ppe_snapshot.errors`: it imports nothing of ours, so
every floor (storage included) may read it. The environment variables are
the interface; :data:`SETTINGS` is what the code reads, at the moment it needs
a value (tests may change its attributes).

====================================  =======  ====================================================
variable                              default  meaning
====================================  =======  ====================================================
``PPE_SNAPSHOT_DIRECT_IO``            ``1``    ``0``: local data files are written through the page
                                               cache instead of with O_DIRECT
``PPE_SNAPSHOT_BOUNCE_MB``            ``4``    size in MiB of each page-aligned bounce buffer of an
                                               O_DIRECT writer (for bytes not page-aligned in memory)
``PPE_SNAPSHOT_BOUNCE_N``             ``2``    number of those bounce buffers per writer
``PPE_SNAPSHOT_DRAIN_THREADS``        ``1``    threads writing full bounce buffers out
``PPE_SNAPSHOT_COMMIT_TIMEOUT``       ``1800`` seconds a rank whose own part is done waits for live
                                               ranks that say nothing (rank 0 for the others' parts,
                                               they for its verdict); a rank that dies is known at once
``PPE_SNAPSHOT_ABORT_BLOCK_MB``       ``256``  a rank of a take that failed elsewhere stops writing
                                               within this many MiB of its own data (smaller blocks
                                               cost a staged write throughput: 64 MiB, 7 % here)
``PPE_SNAPSHOT_PART_MB``              ``8``    object stores: size in MiB of each part of a data
                                               file's multipart upload (S3)
``PPE_SNAPSHOT_UPLOAD_CONCURRENCY``   ``16``   object stores: parts of one data file in flight
``PPE_SNAPSHOT_READ_PART_MB``         ``8``    object stores: reads are split into ranged requests
                                               of at most this many MiB
``PPE_SNAPSHOT_READ_WORKERS``         ``32``   object stores: ranged requests in flight per storage
                                               (unset: 32, and 64 on GCS, whose reads hold no memory)
``PPE_SNAPSHOT_FORMAT_VERSION``       ``2``    the format version takes write: ``1`` (one JSON
                                               manifest) or ``2`` (a small manifest and index files);
                                               unset: the engine's ``DEFAULT_VERSION``, which also
                                               checks the value. Incremental takes write ``3``
``PPE_SNAPSHOT_BLOCK_KB``             ``1024`` size in KiB of the checksummed blocks every take
                                               writes its data in, which the next incremental take
                                               compares (a changed byte rewrites its block; smaller
                                               blocks for sparse row updates, e.g. 4 for an
                                               embedding table of 1 KiB rows)
``PPE_SNAPSHOT_NATIVE_HASH``          ``1``    ``0``: the checksums of small chunks are computed in
                                               Python, holding the GIL, even where the compiled
                                               helper is built (``engine/_files/chunk_hashes.py``)
====================================  =======  ====================================================
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping


@dataclass
class Settings:
    """The tuning values in effect (see the module docstring for their variables)."""
    direct_io: bool = True
    bounce_buffer_bytes: int = 4 << 20
    bounce_buffers: int = 2
    drain_threads: int = 1
    commit_timeout: float = 1800.0
    abort_block_bytes: int = 256 << 20
    part_bytes: int = 8 << 20
    upload_concurrency: int = 16
    read_part_bytes: int = 8 << 20
    #: None: the store's default (``storage/tuning.py``).
    read_workers: int | None = None
    #: None: the default (settings import nothing of ours: the engine defines the versions and checks this one).
    format_version: int | None = None
    block_bytes: int = 1 << 20
    native_hash: bool = True

    @classmethod
    def from_environment(cls, env: Mapping[str, str] = os.environ) -> "Settings":
        return cls(
            direct_io=env.get("PPE_SNAPSHOT_DIRECT_IO", "1") != "0",
            bounce_buffer_bytes=int(env.get("PPE_SNAPSHOT_BOUNCE_MB", "4")) << 20,
            bounce_buffers=int(env.get("PPE_SNAPSHOT_BOUNCE_N", "2")),
            drain_threads=int(env.get("PPE_SNAPSHOT_DRAIN_THREADS", "1")),
            commit_timeout=float(env.get("PPE_SNAPSHOT_COMMIT_TIMEOUT", "1800")),
            abort_block_bytes=int(env.get("PPE_SNAPSHOT_ABORT_BLOCK_MB", "256")) << 20,
            part_bytes=int(env.get("PPE_SNAPSHOT_PART_MB", "8")) << 20,
            upload_concurrency=int(env.get("PPE_SNAPSHOT_UPLOAD_CONCURRENCY", "16")),
            read_part_bytes=int(env.get("PPE_SNAPSHOT_READ_PART_MB", "8")) << 20,
            read_workers=int(env["PPE_SNAPSHOT_READ_WORKERS"]) if env.get("PPE_SNAPSHOT_READ_WORKERS") else None,
            format_version=int(env["PPE_SNAPSHOT_FORMAT_VERSION"]) if env.get("PPE_SNAPSHOT_FORMAT_VERSION") else None,
            block_bytes=int(env.get("PPE_SNAPSHOT_BLOCK_KB", "1024")) << 10,
            native_hash=env.get("PPE_SNAPSHOT_NATIVE_HASH", "1") != "0",
        )


#: The settings of this process, read once from the environment.
SETTINGS = Settings.from_environment()
