"""What ppe-snapshot does differently on each store, found by URL protocol.

A :class:`StoreProfile` holds everything one store needs: its protocols, the extra that installs its file system,
the storage options it is opened with (retry policy, connection pool), what is set on it once opened, the way it
takes an object in parts (a :class:`~ppe_snapshot.storage.part_stores.PartStore`), its ranged reads streamed into
place, and its default number of readers. S3 (``s3.py``), Google Cloud Storage (``gcs.py``) and Azure
(``azure.py``) each have a file of their own; a store of another package registers with :func:`register_store`,
or through an entry point of group ``ppe_snapshot.stores`` naming its profile (loaded at the first look-up).
A protocol without a profile is any other fsspec file system: written through fsspec's file objects, directories
created as needed, read with plain ranged reads.
"""
from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable

#: The entry point group a package names its :class:`StoreProfile` in (``pyproject.toml``:
#: ``[project.entry-points."ppe_snapshot.stores"] mystore = "mypackage.store:PROFILE"``).
ENTRY_POINT_GROUP = "ppe_snapshot.stores"


@dataclass(frozen=True)
class StoreProfile:
    """One store: the protocols of its URLs and what ppe-snapshot does differently there."""
    #: The store, as messages and documents name it.
    name: str
    #: The URL protocols (fsspec's) it serves.
    protocols: tuple[str, ...]
    #: The extra of ppe-snapshot that installs its file system, and the package that extra installs.
    extra: str | None = None
    package: str | None = None
    #: Keys rather than directories: nothing to create (``makedirs`` could create a missing bucket).
    object_store: bool = True
    #: Across a network: reads are split into ranged requests sent in parallel (``ranged.py``).
    remote: bool = True
    #: What it stores lives in this process only: another process (a ProcessWriter's worker) cannot reach it.
    one_process: bool = False
    #: Readers in parallel where neither the options nor the environment say (None: the common default).
    read_workers: int | None = None
    #: ``options(url, storage_options, tuning)``: the options its file system is opened with.
    options: Callable[[str, dict[str, Any], Any], dict[str, Any]] | None = None
    #: ``opened(fs)``: set up an opened file system (once per cached instance).
    opened: Callable[[Any], None] | None = None
    #: ``part_store(fs)``: the PartStore type that uploads an object of ``fs`` in parts, or None.
    part_store: Callable[[Any], Any] | None = None
    #: ``stream(fs)``: a coroutine function ``(path, start, targets)`` streaming a range into place, or None.
    stream: Callable[[Any], Any] | None = None


_PROFILES: dict[str, StoreProfile] = {}
_LOADED = threading.Lock()
_BUILT_IN = ("s3", "gcs", "azure")
#: Stores of keys that need nothing of their own beyond it (``memory://`` lives in this process).
_PLAIN = (StoreProfile("an object store", ("adl", "oss", "r2", "http", "https")),
          StoreProfile("memory", ("memory",), remote=False, one_process=True))
_loaded = False


def register_store(profile: StoreProfile) -> None:
    """Make ``profile`` the one of each of its protocols (a later registration of a protocol replaces the
    earlier one: a package may bring its own client for a built-in store)."""
    _load()
    for protocol in profile.protocols:
        _PROFILES[protocol] = profile


def _load() -> None:
    global _loaded
    if _loaded:
        return
    with _LOADED:
        if _loaded:
            return
        _loaded = True
        for profile in _PLAIN:
            _PROFILES.update(dict.fromkeys(profile.protocols, profile))
        for name in _BUILT_IN:
            profile = importlib.import_module(f"{__name__}.{name}").PROFILE
            _PROFILES.update(dict.fromkeys(profile.protocols, profile))
        for point in entry_points(group=ENTRY_POINT_GROUP):
            profile = point.load()
            _PROFILES.update(dict.fromkeys(profile.protocols, profile))


def store_profile(protocol: str) -> StoreProfile | None:
    """The profile of URL protocol ``protocol`` (``"s3"``), or None for a file system without one."""
    _load()
    return _PROFILES.get(protocol)


def profile_of_url(url: str) -> StoreProfile | None:
    """The profile of ``url``'s protocol (None for a local path, a chained URL or a file system without one)."""
    return store_profile(url.split("://", 1)[0]) if "://" in url else None


def profile_of(fs: Any) -> StoreProfile | None:
    """The profile of fsspec file system ``fs`` (its first protocol that has one)."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return next((p for p in map(store_profile, protocols) if p is not None), None)


__all__ = ["ENTRY_POINT_GROUP", "StoreProfile", "profile_of", "profile_of_url", "register_store", "store_profile"]
