"""Local fsspec file systems for a rank's storage that fails (every write raises ENOSPC, a write kills a process) or
is slow.

Module-level classes: a ProcessWriter's worker unpickles the storage of a save (its fsspec file system, by class)
and so writes through the same file system as the trainer that registered it (``register``).
"""
from __future__ import annotations

import errno
import json
import os
import signal
import time

import fsspec
from fsspec.implementations.local import LocalFileSystem

ENOSPC_TEXT = "No space left on device (every write fails on this rank)"


class FailingFileSystem(LocalFileSystem):
    """Every write raises ``OSError(ENOSPC)``: the rank's storage is full (or gone)."""

    def _open(self, path, mode="rb", **kwargs):
        if "r" not in mode:
            raise OSError(errno.ENOSPC, ENOSPC_TEXT, path)
        return super()._open(path, mode, **kwargs)

    def pipe_file(self, path, value, **kwargs):
        raise OSError(errno.ENOSPC, ENOSPC_TEXT, path)


class KillingFileSystem(LocalFileSystem):
    """The first write to a path containing ``marker`` waits ``delay_s`` (the trainer goes on meanwhile), then
    kills process ``kill_pid`` with SIGKILL, after recording ``{"rank", "time", "how"}`` in ``record``; the write
    itself then fails (in a writer's worker process, which the kill leaves alive until it sees its parent gone)."""

    def __init__(self, *args, kill_pid: int, record: str, rank: int, marker: str, delay_s: float = 0.0,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kill_pid, self.record, self.rank, self.marker, self.delay_s = kill_pid, record, rank, marker, delay_s

    def _open(self, path, mode="rb", **kwargs):
        if "r" not in mode:
            self._kill(path)
        return super()._open(path, mode, **kwargs)

    def pipe_file(self, path, value, **kwargs):
        self._kill(path)
        super().pipe_file(path, value, **kwargs)

    def _kill(self, path: str) -> None:
        if self.marker not in path:
            return
        time.sleep(self.delay_s)
        with open(self.record, "w") as f:
            json.dump({"rank": self.rank, "time": time.time(), "how": "during the write"}, f)
        os.kill(self.kill_pid, signal.SIGKILL)
        raise OSError(errno.EIO, "the trainer was killed")


class SlowFileSystem(LocalFileSystem):
    """Each data file of a snapshot opened for writing first sleeps ``slow_s`` seconds (a slow disk or link)."""

    def __init__(self, *args, slow_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slow_s = slow_s

    def _open(self, path, mode="rb", **kwargs):
        if "r" not in mode and "/data/" in path:
            time.sleep(self.slow_s)
        return super()._open(path, mode, **kwargs)


def register(cls: type) -> None:
    """Make ``cls`` this process's local file system (for paths written with fsspec ``storage_options``)."""
    fsspec.register_implementation("file", cls, clobber=True)
