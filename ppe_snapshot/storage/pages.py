"""A local file's bytes as memory, mapped from the page cache rather than copied out of it.

The local tier sends a copy it holds in tmpfs to the rank restoring from it (:mod:`ppe_snapshot.local_tier.peer_reads`):
sent from the mapping, the bytes are not first read into a buffer (256 MiB in tmpfs: 0.06-0.08 s read into a
buffer, 0.03 s mapped and populated, measured here).
"""
from __future__ import annotations

import mmap
import os

from ppe_snapshot.storage.base import Storage
from ppe_snapshot.storage.local import LocalStorage


def mapped(storage: Storage, rel: str) -> memoryview | None:
    """The bytes of file ``rel`` of ``storage`` as memory, mapped shared and populated at once (no page copied);
    None where the storage keeps no local files or the file cannot be mapped. The file is opened as a read is
    (inside the snapshot directory only). It must not shrink while mapped: a read of a page past its new end kills
    the process (SIGBUS), so map only files that nothing else writes (a local tier's complete copy).

    The view is the mapping's (it keeps it alive); it is read-only for Python (a ``memoryview`` of a read-only
    mapping), and a write through a pointer to it faults. (A private writable mapping would do without that, but
    populating it copies every page: twice the time of a read into a buffer, measured here.)"""
    if not isinstance(storage, LocalStorage):
        return None
    try:
        fd = storage._reader_fd(rel)
        size = os.fstat(fd).st_size
        if not size:
            return memoryview(b"")
        memory = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    return memoryview(memory)
