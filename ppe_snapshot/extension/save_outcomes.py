"""DISTRIBUTED mode: the saver rank tells every other rank how each of its saves ended.

The saver writes alone, and a background writer (thread or process) ends the write after the ranks met for the
save: the meeting carries only what the saver knew then. So for each save the ranks met for, the saver sends every
other rank one document once the save ended, ``{"reason": None}`` (committed) or ``{"reason": why}``, point to
point on the side group of the takes, with a tag every rank allots at that meeting. The saver sends from a thread
per save as soon as the save ends (its writer's ``last_save``); every other rank receives in a thread per save,
and never waits for the write at a save: at ``finalize()`` it waits for every outcome and raises the first failure.
A receive from a saver whose process died fails as soon as its connections close, so nothing waits for a dead
saver; a live saver whose write never ends is waited for up to ``PPE_SNAPSHOT_COMMIT_TIMEOUT``.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from ppe_snapshot.engine import side_group
from ppe_snapshot.errors import SnapshotAbortedError
from ppe_snapshot.settings import SETTINGS
from ppe_snapshot.writing import BackgroundAbortError


def summary(error: BaseException) -> str:
    """``error`` in one line for another rank: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


class SaveOutcomes:
    """The outcomes of one DISTRIBUTED extension's saves, seen from rank ``rank`` (the saver or another)."""

    def __init__(self, rank: int, saver: int, world_size: int) -> None:
        self._rank, self._saver, self._size = rank, saver, world_size
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._dead: set[int] = set()  # the saver: ranks found dead, told nothing more
        self._expected = self._received = 0  # another rank: outcomes expected and received
        self._failures: list[str] = []  # another rank: why saves did not commit, not raised yet

    def met(self, name: str, ended: Future[None] | None) -> None:
        """Every rank, once the ranks met for save ``name`` and none failed; the saver gives the save's end
        (None: it ended when the writer's call returned)."""
        if self._size == 1:
            return
        side = side_group(None)
        tag = side.next_tag()  # every rank allots it at the same meeting
        if self._rank == self._saver:
            # Not a daemon: at interpreter exit the other ranks still hear how the last save ended.
            thread = threading.Thread(target=self._send, args=(side, tag, ended), name="ppe-snapshot-outcome")
        else:
            with self._cond:
                self._expected += 1
            thread = threading.Thread(target=self._receive, args=(side, tag, name), daemon=True,
                                      name="ppe-snapshot-outcome")
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _send(self, side: Any, tag: int, ended: Future[None] | None) -> None:
        error = None if ended is None else ended.exception()  # waits for the save's end
        doc = {"reason": None if error is None else summary(error)}
        for peer in range(self._size):
            if peer != self._saver and peer not in self._dead:
                try:
                    side.send(doc, peer, tag)
                except SnapshotAbortedError:  # that rank died: it waits for nothing
                    self._dead.add(peer)

    def _receive(self, side: Any, tag: int, name: str) -> None:
        try:
            reason = side.receive(self._saver, tag).get("reason")
            failure = None if reason is None else f"saver rank {self._saver} failed to save {name}: {reason}"
        except SnapshotAbortedError as e:
            failure = f"saver rank {self._saver} did not tell whether {name} was saved: {e}"
        with self._cond:
            self._received += 1
            if failure is not None:
                self._failures.append(failure)
            self._cond.notify_all()

    def finish(self) -> None:
        """At ``finalize()``. The saver: return once every outcome was sent (its saves ended: the writer was
        finalized). Another rank: wait for every outcome; raise :class:`BackgroundAbortError` naming the saves
        that did not commit (each once)."""
        if self._rank == self._saver:
            for thread in self._threads:
                thread.join()
            return
        timeout = SETTINGS.commit_timeout
        with self._cond:
            if not self._cond.wait_for(lambda: self._received == self._expected, timeout):
                raise BackgroundAbortError(
                    f"gave up after {timeout:.0f} s waiting for saver rank {self._saver} to tell how its saves ended "
                    "(alive, but silent: PPE_SNAPSHOT_COMMIT_TIMEOUT)")
            failures, self._failures = self._failures, []
        if failures:
            raise BackgroundAbortError("; ".join(failures))
