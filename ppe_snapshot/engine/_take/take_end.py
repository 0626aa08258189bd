"""How a multi-rank take ends: statuses over the rank channel, then rank 0's commit from the parts in storage.

Every rank writes its data and publishes its part in storage (as before), then :func:`conclude` runs where the
rank's :class:`~ppe_snapshot.engine._ranks.rank_channel.TakeChannel` lives (the training process: a ProcessWriter's
worker writes, its parent concludes). Rank 0 waits for every status and commits; the others wait for its
verdict. A failure anywhere aborts the take on every rank: each raises :class:`SnapshotAbortedError` naming the
rank and its error (the rank that failed raises its own error), writes the abort marker under ``.parts/`` (so
listings do not count the take as in progress), and stops its own writes at the next block (:class:`Watched`).
"""
from __future__ import annotations

from typing import Any, Callable, NoReturn, Sequence

from ppe_snapshot.engine import _versions as versions
from ppe_snapshot.engine._format import load_json, MANIFEST_NAME
from ppe_snapshot.engine._ranks import TakeChannel
from ppe_snapshot.engine._take.writers import forget_quietly
from ppe_snapshot.errors import SnapshotAbortedError, SnapshotError
from ppe_snapshot.settings import SETTINGS
from ppe_snapshot.storage import BlobWriter, Storage

#: Aborted takes whose marker could not be written yet (their storage failed): retried at the next take.
_unmarked: list[tuple[Storage, str, str]] = []


class Cancelled(SnapshotAbortedError):
    """A rank's write stopped because the take failed elsewhere (the channel says why)."""


def mark_aborted(storage: Storage, take_id: str, reason: str) -> None:
    """Write the take's abort marker (any surviving rank may); when storage fails, try again at the next take."""
    try:
        versions.abort(storage, take_id, reason)
    except Exception:  # noqa: BLE001 - the storage itself is failing
        _unmarked.append((storage, take_id, reason))


def retry_marks() -> None:
    """Write the abort markers that could not be written before (a new take starts: storage may be back)."""
    pending, _unmarked[:] = list(_unmarked), []
    for storage, take_id, reason in pending:
        mark_aborted(storage, take_id, reason)


class _WatchedWriter(BlobWriter):
    def __init__(self, writer: BlobWriter, failure: Callable[[], str | None]) -> None:
        self._writer, self._failure = writer, failure

    def _check(self) -> None:
        reason = self._failure()
        if reason is not None:
            raise Cancelled(f"this rank stopped writing: {reason}")

    def write(self, buffers: Sequence[memoryview]) -> None:
        block = SETTINGS.abort_block_bytes
        if len(buffers) != 1 or buffers[0].nbytes <= block:  # most calls: a batch of small payloads
            self._check()
            self._writer.write(buffers)
            return
        view = memoryview(buffers[0])
        view = view if view.format == "B" and view.ndim == 1 else view.cast("B")
        for start in range(0, view.nbytes, block):  # a staged image or a large tensor: block by block
            self._check()
            self._writer.write([view[start:start + block]])

    def close(self) -> int:
        self._check()
        return self._writer.close()

    def abort(self) -> None:
        self._writer.abort()


class Watched:
    """``storage`` whose writers stop with :class:`Cancelled` once ``failure()`` names a failure (checked before
    every write call, and every ``PPE_SNAPSHOT_ABORT_BLOCK_MB`` within a large one); everything else is
    ``storage``'s."""

    def __init__(self, storage: Storage, failure: Callable[[], str | None]) -> None:
        self._storage, self._failure = storage, failure

    def open_writer(self, rel: str, size: int | None = None) -> BlobWriter:
        return _WatchedWriter(self._storage.open_writer(rel, size), self._failure)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)


def _error_text(rank: int, error: BaseException) -> str:
    return f"rank {rank}: {error!r}"


def _committed_before(storage: Storage, take_id: str) -> bool:
    """Whether the manifest of take ``take_id`` is in storage (rank 0 died after writing it)."""
    try:
        doc = load_json(storage.read_bytes(MANIFEST_NAME))
    except (ValueError, OSError):
        return False
    return type(doc) is dict and doc.get("take_id") == take_id


def abandon(channel: TakeChannel, storage: Storage, take_id: str, error: BaseException) -> NoReturn:
    """This rank failed (``error``): tell the others, mark the take aborted, and raise (``error`` itself, or the
    failure elsewhere that stopped this rank's writes)."""
    elsewhere = channel.failure()
    cancelled = isinstance(error, Cancelled) and elsewhere is not None
    reason = elsewhere if cancelled else _error_text(channel.rank, error)
    if channel.rank == 0:
        channel.abort(reason)
    else:
        channel.report(reason)
    mark_aborted(storage, take_id, reason)
    if cancelled:
        raise SnapshotAbortedError(f"snapshot {storage.url} was not committed: {elsewhere}") from error
    raise error


def conclude(job: Any, channel: TakeChannel, error: BaseException | None) -> None:
    """End ``job`` (a multi-rank :class:`~ppe_snapshot.engine._take.TakeJob` whose part was published, unless
    ``error`` says why not): rank 0 commits or aborts; every rank returns once committed, or raises."""
    storage, take_id, rank = job.storage, job.take_id, job.rank
    if error is not None:
        abandon(channel, storage, take_id, error)
    if rank == 0:
        _commit(job, channel)
        return
    channel.report(None)
    try:
        verdict = channel.verdict(SETTINGS.commit_timeout)
    except TimeoutError as e:
        raise SnapshotError(f"snapshot {storage.url}: {e}") from None
    if verdict["committed"] or (verdict["committed"] is None and _committed_before(storage, take_id)):
        if not job.moved_after_commit:  # (else rank 0 may have moved it: what is here now is not this take)
            forget_quietly(storage, take_id, rank)  # each rank its own records: no rank removes thousands
        return
    mark_aborted(storage, take_id, verdict["reason"])
    raise SnapshotAbortedError(f"snapshot {storage.url} was not committed: {verdict['reason']}")


def _commit(job: Any, channel: TakeChannel) -> None:
    """Rank 0: once every rank's part is published, check and commit them; abort on any failure."""
    storage, take_id = job.storage, job.take_id
    try:
        failure = channel.gather(SETTINGS.commit_timeout)
    except TimeoutError as e:
        failure = f"rank 0 stopped waiting: {e}"
    if failure is not None:
        _give_up(channel, storage, take_id, failure)
        raise SnapshotAbortedError(f"snapshot {storage.url} was not committed: {failure}")
    try:
        _write_manifest(job)
    except BaseException as e:
        _give_up(channel, storage, take_id, f"rank 0 could not commit: {e!r}")
        raise
    channel.decide(committed=True)
    versions.clean_parts(storage, take_id, job.world_size, job.version)
    forget_quietly(storage, take_id, 0)


def _give_up(channel: TakeChannel, storage: Storage, take_id: str, reason: str) -> None:
    """Rank 0: tell every live rank the take is aborted, and mark it so in storage."""
    channel.abort(reason)
    mark_aborted(storage, take_id, reason)


def _write_manifest(job: Any) -> None:
    """Rank 0: merge every rank's published part and write the manifest (every status was ``ok``)."""
    versions.merge_and_commit(job.storage, job.take_id, job.world_size, job.metadata, SETTINGS.commit_timeout,
                              job.version)
