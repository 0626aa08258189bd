"""The snapshot engine: flatten app state, plan, stage, write, commit; restore in place.

The floors above (``writing/``, ``dcp/``, ``run_dir/``, ``retention``, ``cli``, the extension) import this
package, and :mod:`ppe_snapshot.engine.codec` for the format's pieces; everything else here is private. Inside,
one ``_``-prefixed subpackage per concern, each entered through its ``__init__`` (its face), bottom up:
``_util`` and ``_ranks``, ``_format`` (the bytes on disk and their checks), ``_state`` (app state <-> entries),
``_files`` (data files), ``_versions`` (the format versions: the record every read path asks), ``_restore`` and
``_take``; ``_snapshot`` (the facade) on top. docs/architecture.md gives each module's job and the recipe for
adding a format version.

Taking and restoring
    :class:`Snapshot` (``take``, ``async_take``, ``restore``, ``read_object``, ``verify``, ``get_manifest``),
    :class:`PendingSnapshot`. In stages, for writers that run the write elsewhere:
    ``job = prepare_take(path, app_state, *, pg=..., ...)`` plans this rank's share (every rank of ``pg``
    calls it) and returns a :class:`TakeJob`; ``job.stage(provider)`` copies the state into a staging buffer
    (``new_staging_buffer(size, pin)``; ``new_shared_buffer(nbytes)`` for another process to map;
    ``staging_estimate(state)``: the bytes an image of a state dict takes, and whether it is on a GPU);
    ``job.write_and_commit()`` writes and commits (in a thread, or in another process: the job pickles; there
    ``release_staging()`` / ``use_staged(buffer)`` hand the staged image over). ``job.stage(buffer,
    keep_image=True)`` returns a :class:`StagedImage`, which a second take of the same step (``image=``, or
    ``Snapshot.async_take(..., staged_from=)``) copies its tensors from in the background. ``align(n)``: ``n`` rounded up
    to the alignment of payloads in a data file. ``LOCAL`` as ``pg`` takes or restores in this process alone;
    ``group_rank(pg)`` is (rank, world size). ``gc_paused()`` pauses Python's cyclic collector around a take
    the caller waits for (as ``Snapshot.take`` does).
Between ranks, naming a rank that died
    ``side_group(pg)`` (the gloo group beside ``pg`` that takes use; its ``send`` / ``receive`` carry one small
    document from one rank to another), ``exchange(group, doc, tag, decide,
    root=)`` (every rank's document through one rank), ``agree_max(group, value, tag)``.
State objects
    :class:`Stateful`, :class:`StateDict`, :class:`RNGState`, :class:`OptimizerState`.
A snapshot in storage
    ``MANIFEST_NAME`` (its presence commits a snapshot), ``INDEX_DIR`` (version 2's index files), ``PARTS_DIR``
    and ``judge_writers(names, read)`` (given the file names under it: whether a take there is in progress and
    whether the processes writing it live),
    ``read_manifest(storage)`` (the manifest of any format
    version; ``SnapshotNotFoundError`` when none is committed; ``manifest.lookup(rank, path)`` gives an entry),
    ``upgrade_snapshot(source, dest)`` (a version-1 or incremental snapshot rewritten as a self-contained
    version 2). Incremental snapshots: ``RETIRED_NAME`` marks a removed snapshot's directory kept for the data
    files others reference; ``check_base(base, path)`` raises unless ``base`` may be the base of an incremental
    take at ``path`` (another snapshot in the same directory).
"""
from ppe_snapshot.engine._files import align
from ppe_snapshot.engine._format import INDEX_DIR, MANIFEST_NAME, PARTS_DIR, RETIRED_NAME
from ppe_snapshot.engine._ranks import LOCAL, agree_max, exchange, group_rank, side_group
from ppe_snapshot.engine._snapshot import PendingSnapshot, Snapshot
from ppe_snapshot.engine._state import OptimizerState, RNGState, Stateful, StateDict
from ppe_snapshot.engine._take import (
    StagedImage, TakeJob, check_base, judge_writers, new_staging_buffer, prepare_take, staging_estimate,
)
from ppe_snapshot.engine._util import ReadyAhead, gc_paused, new_shared_buffer
from ppe_snapshot.engine._versions import read_manifest, upgrade as upgrade_snapshot

__all__ = [
    # taking and restoring
    "LOCAL", "PendingSnapshot", "ReadyAhead", "Snapshot", "StagedImage", "TakeJob", "align", "gc_paused", "group_rank",
    "new_shared_buffer",
    "new_staging_buffer", "prepare_take", "staging_estimate",
    # between ranks
    "agree_max", "exchange", "side_group",
    # state objects
    "OptimizerState", "RNGState", "StateDict", "Stateful",
    # a snapshot in storage
    "INDEX_DIR", "MANIFEST_NAME", "PARTS_DIR", "RETIRED_NAME", "check_base", "judge_writers", "read_manifest",
    "upgrade_snapshot",
]
