"""How the ranks of a take tell each other that they are done, failed or died: through the process group.

A multi-rank take keeps its data and its commit point (the manifest, last) in storage; what the ranks say to
each other travels over a gloo group of the take's ranks, made once per set of ranks beside the training group
(:func:`side_group`), point to point in a star around rank 0. Each take exchanges exactly one *status* per rank
(rank r -> 0: "my part is published", or my error) and one *verdict* per rank (0 -> r: "committed" or
"aborted: why"), tagged with the take, so saves in flight at once never mix their messages:

* once the ranks agreed on the take, rank 0 waits for every other rank's status, and every other rank for
  rank 0's verdict, each receive in a thread of its own (:class:`TakeChannel`);
* a receive ends with an error as soon as the peer's process dies (the kernel closes its connections): rank 0
  learns of any rank's death, and every other rank of rank 0's, within a second;
* on the first failure (an error status or a dead peer) rank 0 sends every live rank ``aborted`` at once; a
  rank that learns of a failure stops its own writes at the next block (:meth:`TakeChannel.failure`).

Cost: one gloo group per set of ranks (made at the start of their first multi-rank take; a rank dead before it
is made is waited for up to ``PPE_SNAPSHOT_COMMIT_TIMEOUT``), and per take one thread per peer on
rank 0 and one on every other rank, two messages of :data:`MESSAGE_BYTES` per rank. A rank that is alive but
slow is waited for (up to ``PPE_SNAPSHOT_COMMIT_TIMEOUT`` once the waiting rank's own part is done).
"""
from __future__ import annotations

import json
import re
import threading
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ppe_snapshot.errors import SnapshotAbortedError
from ppe_snapshot.settings import SETTINGS

#: The size of one status or verdict (a JSON document, zero-padded); longer error texts are cut.
MESSAGE_BYTES = 4096
#: How long a receive may wait in its thread: the waiting caller applies the commit timeout itself.
_RECEIVE_WAIT = timedelta(days=30)
#: Tags of :func:`exchange` on a side group start here (a take's channel uses tags below 2**28 + 1).
_EXCHANGE_TAGS = 1 << 29


class SideGroup:
    """A gloo group of a process group's ranks (the same processes in the same order) and its exchanges so far."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self._exchanges = 0

    def next_tag(self) -> int:
        """The tag of the next :func:`exchange` or :meth:`send` (every rank allots tags in the same order)."""
        self._exchanges += 1
        return _EXCHANGE_TAGS + self._exchanges % _EXCHANGE_TAGS

    def send(self, doc: dict[str, Any], peer: int, tag: int) -> None:
        """Send ``doc`` (a JSON object of at most :data:`MESSAGE_BYTES`; a longer ``"reason"`` is cut) to ``peer``,
        which receives it with :meth:`receive` and the same ``tag``. Returns once ``peer`` asked for it and it was
        handed to the connection (``peer`` may not have read it yet); raises
        :class:`~ppe_snapshot.errors.SnapshotAbortedError` naming ``peer`` when it died."""
        try:
            self.group.send([_encode(doc)], peer, tag).wait()
        except RuntimeError as e:
            raise SnapshotAbortedError(peer_lost(peer, e)) from e

    def receive(self, peer: int, tag: int) -> dict[str, Any]:
        """The document ``peer`` sends with :meth:`send` and ``tag``; raises
        :class:`~ppe_snapshot.errors.SnapshotAbortedError` naming ``peer`` as soon as its process dies."""
        message = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
        try:
            self.group.recv([message], peer, tag).wait(_RECEIVE_WAIT)
        except RuntimeError as e:
            raise SnapshotAbortedError(peer_lost(peer, e)) from e
        return _decode(message)


_groups: dict[tuple[int, ...], tuple[Any, SideGroup]] = {}
_groups_lock = threading.Lock()


def side_group(pg: Any) -> SideGroup:
    """The gloo group of ``pg``'s ranks that takes speak over; made (a collective of those ranks, waiting at most
    ``PPE_SNAPSHOT_COMMIT_TIMEOUT`` for all of them) the first time, and again after the default group was
    destroyed and initialized again."""
    world = dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(pg if pg is not None else world))
    with _groups_lock:
        known = _groups.get(ranks)
        if known is not None and known[0] is world:
            return known[1]
        group = dist.new_group(list(ranks), backend="gloo", timeout=timedelta(seconds=SETTINGS.commit_timeout),
                               use_local_synchronization=True)
        _groups[ranks] = (world, SideGroup(group))
        return _groups[ranks][1]


def _encode(doc: dict[str, Any]) -> torch.Tensor:
    data = json.dumps(doc).encode()
    while len(data) > MESSAGE_BYTES:  # only an error text can be that long
        doc = {**doc, "reason": doc["reason"][: len(doc["reason"]) // 2] + " [...]"}
        data = json.dumps(doc).encode()
    message = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
    message[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return message


def _decode(message: torch.Tensor) -> dict[str, Any]:
    return json.loads(bytes(message.numpy()).rstrip(b"\0"))


def connection_error(error: BaseException) -> str:
    """The gist of a gloo error: ``"Connection closed by peer [127.0.0.1]:41234"``, without source location and
    advice."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". ", 1)[0].rstrip(".")


def peer_lost(rank: int, error: BaseException, where: str = "") -> str:
    """Why a peer is taken for lost: it died or its connection closed (``where``: during what)."""
    return f"rank {rank} died or lost its connection{where} ({connection_error(error)})"


class TakeChannel:
    """The statuses and verdicts of one multi-rank take, seen from one rank (see the module docstring).

    ``rank`` and ``world_size`` are in the take's group; ``group`` is its :func:`side_group`, whose ranks are
    the same processes in the same order.
    """

    def __init__(self, group: Any, rank: int, world_size: int, take_id: str) -> None:
        self._group, self.rank, self._world_size = group, rank, world_size
        self._tag = int(take_id[:7], 16) + 1  # gloo tags are 32-bit; a take's own tag keeps takes apart
        self._cond = threading.Condition()
        self._failure: str | None = None  # the first failure this rank heard of (None: none yet)
        self._statuses: dict[int, str | None] = {}  # rank 0: every status received (None: ok)
        self._dead: set[int] = set()
        self._told: set[int] = set()  # rank 0: the ranks sent a verdict
        self._verdict: dict[str, Any] | None = None  # other ranks: rank 0's verdict, or its death
        self._send_lock = threading.Lock()
        self._on_failure: list[Callable[[], None]] = []
        self._pending_callbacks: list[Callable[[], None]] = []
        peers = range(1, world_size) if rank == 0 else [0]
        for peer in peers:
            threading.Thread(target=self._receive, args=(peer,), name="ppe-snapshot-rank-channel",
                             daemon=True).start()

    # -- what every rank asks ----------------------------------------------------------
    def failure(self) -> str | None:
        """Why the take cannot commit, once this rank knows of a failure elsewhere; None so far."""
        return self._failure

    def when_failed(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from a receiving thread, or now) once this rank knows the take failed."""
        with self._cond:
            if self._failure is None:
                self._on_failure.append(callback)
                return
        callback()

    def _fail(self, reason: str) -> None:
        """Record the first failure (call holding ``_cond``); its callbacks run once ``_cond`` is released."""
        if self._failure is None:
            self._failure = reason
            self._pending_callbacks, self._on_failure = self._on_failure, []
        self._cond.notify_all()

    def _run_callbacks(self) -> None:
        with self._cond:
            callbacks, self._pending_callbacks = self._pending_callbacks, []
        for callback in callbacks:
            callback()

    # -- the receiving threads --------------------------------------------------------
    def _receive(self, peer: int) -> None:
        message = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
        try:
            self._group.recv([message], peer, self._tag).wait(_RECEIVE_WAIT)
            doc = _decode(message)
        except Exception as e:  # noqa: BLE001 - the peer died (its connection closed) or the group is gone
            self._lost(peer, e)
            return
        if self.rank == 0:
            self._status(peer, doc.get("reason"))
        else:
            with self._cond:
                self._verdict = doc
                if not doc.get("committed"):
                    self._fail(doc.get("reason") or "rank 0 aborted the take")
                self._cond.notify_all()
            self._run_callbacks()

    def _lost(self, peer: int, error: BaseException) -> None:
        reason = peer_lost(peer, error, " during the take")
        with self._cond:
            self._dead.add(peer)
            if self.rank != 0 and self._verdict is None:  # a verdict received before rank 0 exited stands
                self._verdict = {"committed": None, "reason": reason}
                self._fail(reason)
            self._cond.notify_all()
        self._run_callbacks()
        if self.rank == 0:
            self.abort(reason)

    def _status(self, peer: int, error: str | None) -> None:
        with self._cond:
            self._statuses[peer] = error
            self._cond.notify_all()
        if error is not None:
            self.abort(error)

    # -- rank 0 ------------------------------------------------------------------------
    def gather(self, timeout: float) -> str | None:
        """Rank 0, its own part published: wait until every rank reported. The failure, or None when all are done.

        Raises ``TimeoutError`` after ``timeout`` seconds without every status.
        """
        with self._cond:
            done = self._cond.wait_for(lambda: self._failure is not None
                                       or len(self._statuses) == self._world_size - 1, timeout)
            if not done:
                missing = sorted(set(range(1, self._world_size)) - set(self._statuses))
                raise TimeoutError(f"gave up after {timeout:.0f} s waiting for ranks {missing} (alive, but their "
                                   "parts were not published: PPE_SNAPSHOT_COMMIT_TIMEOUT)")
            return self._failure

    def abort(self, reason: str) -> None:
        """Rank 0: the take cannot commit; tell every live rank now (the first reason wins)."""
        with self._cond:
            self._fail(reason)
        self._run_callbacks()
        self.decide(committed=False)

    def decide(self, committed: bool) -> None:
        """Rank 0: send every live rank not told yet the verdict (``aborted`` with the failure unless ``committed``)."""
        verdict = _encode({"committed": committed, "reason": None if committed else self._failure})
        with self._send_lock:
            with self._cond:
                peers = [p for p in range(1, self._world_size) if p not in self._told and p not in self._dead]
                self._told.update(peers)
            for peer in peers:
                self._send(verdict, peer)

    # -- the other ranks ----------------------------------------------------------------
    def report(self, error: str | None) -> None:
        """Tell rank 0 this rank's part is published (``error`` None) or why it is not."""
        if 0 in self._dead:
            return
        with self._send_lock:
            self._send(_encode({"reason": error}), 0)

    def verdict(self, timeout: float) -> dict[str, Any]:
        """Rank 0's verdict: ``{"committed": True}``, ``{"committed": False, "reason": ...}``, or
        ``{"committed": None, "reason": ...}`` when rank 0 died (the take may have committed just before).

        Raises ``TimeoutError`` after ``timeout`` seconds without one.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._verdict is not None, timeout):
                raise TimeoutError(f"gave up after {timeout:.0f} s waiting for rank 0 to commit (alive, but "
                                   "silent: PPE_SNAPSHOT_COMMIT_TIMEOUT)")
            return self._verdict

    def _send(self, message: torch.Tensor, peer: int) -> None:
        try:
            self._group.send([message], peer, self._tag).wait()
        except Exception as e:  # noqa: BLE001 - a dead peer: its receiving thread here reports it
            with self._cond:
                self._dead.add(peer)
            if self.rank != 0:
                self._lost(peer, e)
