"""The take pipeline: flatten -> plan -> (stage) -> write -> commit."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from ppe_snapshot.engine import _versions as versions
from ppe_snapshot.engine._files import FileLayout, Written, lay_out, payload_chunks, write_from_sources
from ppe_snapshot.engine._format import (
    Chunk, Entry, EntryColumns, PickleEntry, Raw, ShapeColumns, TensorEntry, can_store_raw, data_file, dtype_key,
    new_take_id, raw_storage_problem,
)
from ppe_snapshot.engine._ranks import SideGroup, TakeChannel, exchange, group_rank, side_group
from ppe_snapshot.engine._state import (
    Payload, PlainTensors, RankPlan, ShardPlan, flatten, is_shard_key, mark_replicated, plan_rank,
    replicated_patterns, sharded_entries, sharded_state_patterns, take_states,
)
from ppe_snapshot.engine._take.incremental import (
    IncrementalWrite, block_size, check_base, check_version, open_base, write_incremental,
)
from ppe_snapshot.engine._take.staging import (
    Deferred, StagedImage, copy_deferred, new_staging_buffer, stage, write_staged,
)
from ppe_snapshot.engine._take.take_end import Watched, abandon, conclude, retry_marks
from ppe_snapshot.engine._take.writers import forget_quietly, record_writer
from ppe_snapshot.engine._util import gc_paused
from ppe_snapshot.errors import SnapshotAbortedError, SnapshotExistsError, UnsupportedValueError
from ppe_snapshot.storage import Storage, open_storage, snapshot_location

#: ``(logical path, tensor, tracing) -> tensor to store``: the seed's ``_custom_tensor_prepare_func``.
TensorPrepare = Callable[[str, torch.Tensor, bool], torch.Tensor]


def _entry(kind: str, dtype: Any, shape: Any, replicated: bool, chunks: list[Chunk]) -> Entry:
    if kind == Raw.PICKLED:
        return PickleEntry(chunks, replicated)
    kind, name = dtype_key(dtype)
    return TensorEntry(name, list(shape), chunks, kind, replicated)


@dataclass
class TakeJob:
    """One rank's share of a take, from planning to commit: made by :func:`prepare_take`, then
    :meth:`stage` (optional: copy the state so the caller may go on), then :meth:`write_and_commit`
    (may run in a thread or another process: the job pickles)."""
    storage: Storage
    take_id: str
    rank: int
    world_size: int
    layout: FileLayout
    entries: dict[str, Entry]
    metadata: dict[str, Any]
    #: The format version to write (rank 0's setting, agreed by every rank).
    version: int
    staged: torch.Tensor | None = None
    sharded: dict[str, ShardPlan] = field(default_factory=dict)
    #: The shared state this rank expects (paths, replicated containers), see ``_versions.expected_shared``.
    shared: versions.Shared = field(default_factory=lambda: ([], {}))
    #: Several ranks: how they tell each other they are done or failed (lives in the process that prepared
    #: the job: not pickled, see :meth:`write_part` / :meth:`conclude`).
    channel: TakeChannel | None = None
    #: Where :meth:`write_part` runs in another process: tells it the take failed elsewhere (its parent's channel).
    stopped: Callable[[], str | None] | None = None
    #: An incremental take: the snapshot (beside this one) whose unchanged blocks it references, and the
    #: ``storage_options`` to read it.
    base: str | None = None
    base_options: dict[str, Any] | None = None
    #: The block size: every take writes its payloads in chunks of at most this size, the blocks the next
    #: incremental take compares (None: the settings').
    block_bytes: int | None = None
    #: An incremental take, once written: what it wrote and referenced.
    incremental: IncrementalWrite | None = None
    #: The process that prepared the job (and concludes it): recorded beside the one that writes it, where that
    #: is another (a ProcessWriter's worker), see ``writers.py``.
    preparer: int = field(default_factory=os.getpid)
    #: The payloads :meth:`stage` left to copy from another take's staged image, copied before the write.
    deferred: Deferred = field(default_factory=list)
    #: Rank 0 moves the committed take to another name (it replaces a snapshot there): the other ranks, which may
    #: learn of the commit after the move, then leave the directory alone; rank 0 removes their writer records.
    moved_after_commit: bool = False

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "channel": None}

    @property
    def written_bytes(self) -> int:
        """The size of this rank's data file: all of its payloads, or, once an incremental take is written,
        the blocks that changed (with their alignment)."""
        return self.layout.size if self.incremental is None else self.incremental.files[self.layout.file]

    @gc_paused()  # a state of many tensors makes as many objects here: no collection walks them meanwhile
    def stage(self, buffer: torch.Tensor | None = None, image: StagedImage | None = None,
              keep_image: bool = False) -> StagedImage | None:
        """Copy this rank's payloads into ``buffer`` (at least ``layout.size`` bytes; it may hold an older image),
        or into a new buffer; the job owns it (the caller may mutate the payloads after).

        The tensors that ``image`` (another take's of this step) holds are copied from there when the job is
        written instead; the caller keeps ``image``'s buffer unchanged until then. ``keep_image``: returns where
        this job's tensors lie in ``buffer``, for another take to do the same."""
        try:
            if buffer is not None and not isinstance(buffer, torch.Tensor):
                raise TypeError(f"stage() takes the staging buffer itself (a contiguous CPU uint8 tensor of at least "
                                f"layout.size = {self.layout.size} bytes) or None for a new one, got "
                                f"{type(buffer).__name__}")
            reused = buffer is not None
            if buffer is None:
                buffer = new_staging_buffer(self.layout.size, self.layout.on_cuda())
            self.deferred = stage(self.layout, buffer, reused=reused, image=image)
            kept = StagedImage(self.layout, buffer) if keep_image else None
        except BaseException as e:
            self.conclude(e)
            raise
        self.staged = buffer
        self.layout.let_go()  # the job must not keep the live state alive
        return kept

    def release_staging(self) -> None:
        """Let go of the staging buffer, e.g. before the job is sent to a process that maps the same buffer."""
        self.staged = None

    def use_staged(self, buffer: torch.Tensor) -> None:
        """Write from ``buffer``, which holds this job's staged file image (another process's :meth:`stage`)."""
        self.staged = buffer

    def write_and_commit(self) -> None:
        """Write this rank's data and commit (several ranks: :meth:`write_part`, then :meth:`conclude`)."""
        if self.world_size == 1:
            try:
                versions.commit(self.storage, versions.merge([self._written()], self.take_id, self.metadata),
                                self.version)
            finally:  # committed, or failed here: either way no process writes it any more
                forget_quietly(self.storage, self.take_id, 0)
            return
        try:
            self.write_part()
        except BaseException as e:
            self.conclude(e)
            raise
        self.conclude(None)

    def write_part(self) -> None:
        """Several ranks: write this rank's data and publish its part in storage (in any process)."""
        part = self._written()
        versions.publish(self.storage, self.take_id, part, self.shared, self.version)

    def conclude(self, error: BaseException | None) -> None:
        """Several ranks, in the process that prepared the job, once :meth:`write_part` ended (``error``: why it
        failed): commit (rank 0) or learn the verdict; raises unless the take committed. One rank: nothing."""
        if self.channel is not None:
            conclude(self, self.channel, error)

    def when_failed(self, callback: Callable[[], None]) -> None:
        """Several ranks: call ``callback`` once this rank knows the take failed elsewhere (from another thread)."""
        if self.channel is not None:
            self.channel.when_failed(callback)

    def failure(self) -> str | None:
        """Why the take cannot commit, once this rank knows of a failure elsewhere; None so far."""
        if self.channel is not None:
            return self.channel.failure()
        return self.stopped() if self.stopped is not None else None

    def _written(self) -> versions.RankPart:
        """Write this rank's data; its part. The staging buffer is let go of either way."""
        try:
            return self._part(self._write())
        finally:
            self.staged, self.deferred = None, []

    def _write(self) -> Written:
        base = None
        if self.layout.paths and self.base is not None:  # a missing base is refused before anything is written
            base = open_base(self.base, self.storage.url, self.rank, self.sharded, self.base_options)
        # before the first byte: a listing tells this take in progress from the leftover of a dead one
        record_writer(self.storage, self.take_id, self.rank, self.world_size, self.preparer)
        if not self.layout.paths:
            return []
        storage: Any = self.storage if self.world_size == 1 else Watched(self.storage, self.failure)
        if self.deferred:
            copy_deferred(self.staged, self.deferred)
            self.deferred = []
        if base is not None:
            with gc_paused():
                self.incremental = write_incremental(storage, self.layout, self.staged, base, self.block_bytes)
            return list(self.incremental.chunks)
        block_bytes = block_size(self.block_bytes)
        if self.staged is not None:
            return write_staged(storage, self.layout, self.staged, block_bytes)
        with gc_paused():  # from the live tensors: the caller waits for this take anyway
            return write_from_sources(storage, self.layout, block_bytes)

    @gc_paused()
    def _part(self, written: Written) -> versions.RankPart:
        """This rank's entries, now that its data is written: its tensors and arrays stored in one chunk as
        columns (no object per tensor), every other entry as an object."""
        layout, raw = self.layout, {Raw.TENSOR, Raw.NDARRAY}
        files = self.incremental.files if self.incremental is not None else {layout.file: layout.size}
        part = versions.RankPart(self.rank, files=files if layout.paths else {})
        paths, payloads = layout.paths, layout.payloads
        shards = {path for path in paths if is_shard_key(path)} if self.sharded else set()
        if self.sharded:
            part.sharded = sharded_entries(self.sharded, {paths[i]: payload_chunks(layout, i, written[i])
                                                          for i in range(len(paths)) if paths[i] in shards})
        # per row: dtype (None for pickled bytes), shape, replicated; the plain tensors' first, as columns
        dtypes = layout.dtypes + [p.data.dtype if p.kind in raw else None for p in payloads]
        shapes = layout.tensor_shapes() + ShapeColumns.of([p.data.shape if p.kind in raw else () for p in payloads])
        replicated = [False] * len(layout.dtypes) + [p.replicated for p in payloads]
        own = part.entries = EntryColumns(file=layout.file)
        if not shards and set(map(type, written)) <= {int} and not any(replicated) \
                and all(p.kind in raw for p in payloads):  # most takes: every payload is a row, as laid out
            own.add_tensors(paths, dtypes, shapes, layout.offsets, layout.sizes, written)
        else:
            kinds = list(layout.kinds())
            rows = [i for i, (path, kind, w, r) in enumerate(zip(paths, kinds, written, replicated))
                    if type(w) is int and kind in raw and not r and path not in shards]
            own.add_tensors([paths[i] for i in rows], [dtypes[i] for i in rows], shapes.take(rows),
                            [layout.offsets[i] for i in rows], [layout.sizes[i] for i in rows],
                            [written[i] for i in rows])
            in_rows = set(rows)
            for i, path in enumerate(paths):
                if i not in in_rows and path not in shards:
                    table = part.replicated if replicated[i] else own.objects
                    chunks = payload_chunks(layout, i, written[i])
                    table[path] = _entry(kinds[i], dtypes[i], shapes.shape(i), replicated[i], chunks)
        for path, entry in self.entries.items():
            (part.replicated if entry.replicated else own.objects)[path] = entry
        return part


@dataclass
class _Agreement:
    """What every rank learns from the others before writing."""
    path: str
    take_id: str
    #: The ``replicated`` globs given by every rank (a glob given by some ranks only counts for none).
    replicated: list[str]
    #: The format version rank 0 writes.
    version: int


def _agree(path: str, storage: Storage | None, rank: int, world_size: int, side: SideGroup | None,
           replicated: list[str], version: int | None, local_error: BaseException | None) -> _Agreement:
    """Every rank learns rank 0's path and take id, the common globs, and whether any rank cannot take part.

    Rank 0 checks that no snapshot exists at the path (``storage``: None where this rank failed before opening
    it). A rank whose flatten failed still joins this exchange, so the others raise instead of waiting;
    so does every survivor when a rank died (the exchange names it).
    """
    proposal: dict[str, Any] = {"path": path, "take_id": new_take_id(), "replicated": replicated,
                                "error": repr(local_error) if local_error else None,
                                "version": version}
    if rank == 0 and storage is not None:  # (opened: no local error)
        try:
            versions.refuse_overwrite(storage)
        except SnapshotExistsError as e:  # raised on every rank, after the exchange
            proposal["exists"] = str(e)
    if side is None:
        agreed = _decide([proposal])
    else:
        try:
            agreed = exchange(side.group, proposal, side.next_tag(), _decide)
        except SnapshotAbortedError as e:
            raise SnapshotAbortedError(f"snapshot {path} not taken: the ranks could not agree on the take, {e}"
                                       ) from e
    if local_error is not None:
        raise local_error
    if agreed["exists"]:
        raise SnapshotExistsError(agreed["exists"])
    if agreed["failed"]:
        raise SnapshotAbortedError(f"snapshot {path} not taken: {'; '.join(agreed['failed'])}")
    return _Agreement(agreed["path"], agreed["take_id"], agreed["replicated"], agreed["version"])


def _decide(proposals: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0: the agreement, from every rank's proposal (rank 0's path, take id and version; the globs every
    rank gave; which ranks failed)."""
    first = proposals[0]
    return {"path": first["path"], "take_id": first["take_id"], "version": first["version"],
            "exists": first.get("exists"),
            "failed": [f"rank {r}: {p['error']}" for r, p in enumerate(proposals) if p["error"]],
            "replicated": [g for g in first["replicated"] if all(g in p["replicated"] for p in proposals)]}


def _globs(replicated: Iterable[str] | None) -> list[str]:
    if replicated is None:
        return []
    globs = [] if isinstance(replicated, str) else list(replicated)
    if isinstance(replicated, str) or not all(isinstance(g, str) for g in globs):
        raise TypeError(f"replicated must be a list of glob strings, got {replicated!r}")
    return globs


def _flatten_all(app_state: dict[str, Any], allow_pickle: bool, tensor_prepare: TensorPrepare | None = None
                 ) -> tuple[dict[str, Any], PlainTensors]:
    """The flatten items of every app state key, and its plain tensors (none when ``tensor_prepare`` is given:
    it may replace any tensor, so each is an item)."""
    if not isinstance(app_state, dict):
        raise TypeError(f"app_state must be a dict of stateful objects, got {type(app_state).__name__}")
    for key in app_state:
        if not isinstance(key, str) or not key:
            raise TypeError(f"app_state keys must be non-empty strings, got {key!r}")
    items, plain = {}, PlainTensors()
    for key, state in take_states(app_state).items():
        items.update(flatten(key, state, allow_pickle, plain if tensor_prepare is None else None))
    if tensor_prepare is not None:
        _apply_tensor_prepare(items, tensor_prepare)
    return items, plain


def _apply_tensor_prepare(items: dict[str, Any], tensor_prepare: TensorPrepare) -> None:
    """Replace each plain tensor by what ``tensor_prepare(path, tensor, False)`` returns (e.g. a cast)."""
    for path, item in items.items():
        if isinstance(item, Payload) and item.kind == Raw.TENSOR:
            prepared = tensor_prepare(path, item.data, False)
            if not isinstance(prepared, torch.Tensor) or not can_store_raw(prepared):
                problem = (f"returned a {type(prepared).__name__}" if not isinstance(prepared, torch.Tensor)
                           else f"returned a tensor that {raw_storage_problem(prepared)}")
                raise UnsupportedValueError(f"{path}: _custom_tensor_prepare_func {problem}; it must return a "
                                            "dense strided tensor")
            items[path] = Payload(Raw.TENSOR, prepared.detach())


def _plan(app_state: dict[str, Any], items: dict[str, Any], plain: PlainTensors, replicated: list[str], rank: int,
          world_size: int) -> RankPlan:
    mark_replicated(items, replicated_patterns(app_state, replicated) + sharded_state_patterns(items), plain)
    return plan_rank(items, rank, world_size, plain)


def _check_metadata(metadata: Any) -> None:
    """Refuse metadata the manifest cannot hold before anything is written."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict, got {type(metadata).__name__}")
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata must hold only JSON values (dicts, lists, str, numbers, bools, None): {e}"
                        ) from None


@gc_paused()
def prepare_take(path: str, app_state: dict[str, Any], *, pg: Any = None, replicated: Iterable[str] | None = None,
                 storage_options: dict[str, Any] | None = None, allow_pickle: bool = False,
                 metadata: dict[str, Any] | None = None, tensor_prepare: TensorPrepare | None = None,
                 base: str | None = None, block_bytes: int | None = None) -> TakeJob:
    """Flatten and plan this rank's share; agree with the other ranks of ``pg`` on path, take id and globs.

    Every rank of ``pg`` calls it (the agreement is an exchange through rank 0 on
    the take's side group, made by the first take on ``pg``'s ranks: a collective
    of theirs); ``pg=LOCAL`` for a take by this process alone. ``tensor_prepare(path, tensor, tracing)``
    may replace each plain tensor by the one to store (the seed's
    ``_custom_tensor_prepare_func``). Refuses to write over a committed snapshot. ``base``: an incremental
    take, referencing the blocks of snapshot ``base`` (beside ``path``) that did not change (see
    :mod:`~ppe_snapshot.engine._take.incremental`). ``block_bytes`` (default ``PPE_SNAPSHOT_BLOCK_KB``): every take
    writes its payloads in chunks of at most this size, which the next incremental take compares.
    """
    rank, world_size = group_rank(pg)
    side = side_group(pg) if world_size > 1 else None  # the first take on these ranks makes it: as early as can be
    items, plain, globs, version, error = {}, PlainTensors(), [], None, None
    storage: Storage | None = None
    try:
        path = snapshot_location(path)
        _check_metadata(metadata)
        version = versions.write_version()
        block_bytes = block_size(block_bytes)
        if base is not None:
            check_base(base, str(path))
            check_version(version, base)
        globs = _globs(replicated)
        items, plain = _flatten_all(app_state, allow_pickle, tensor_prepare)
    except Exception as e:  # every rank must still reach the agreement below
        error = e
    retry_marks()
    if error is None:
        try:
            storage = open_storage(path, storage_options)
        except Exception as e:  # (a file system not installed, say) as above
            error = e
    agreed = _agree(str(path), storage, rank, world_size, side, globs, version, error)
    assert storage is not None  # (the agreement raised this rank's error)
    if storage.url != agreed.path:
        storage = open_storage(agreed.path, storage_options)
    channel = TakeChannel(side.group, rank, world_size, agreed.take_id) if side is not None else None
    try:
        plan = _plan(app_state, items, plain, agreed.replicated, rank, world_size)
        layout = lay_out(data_file(rank), plan.payloads, plan.plain)
        shared = versions.expected_shared(items, world_size, agreed.version)
    except BaseException as e:  # the others are about to write: make them raise, not wait
        if channel is None:
            raise
        abandon(channel, storage, agreed.take_id, e)
    return TakeJob(storage, agreed.take_id, rank, world_size, layout, plan.entries, dict(metadata or {}),
                   agreed.version, sharded=plan.sharded, shared=shared, channel=channel,
                   base=None if base is None else str(base), base_options=storage_options, block_bytes=block_bytes)
