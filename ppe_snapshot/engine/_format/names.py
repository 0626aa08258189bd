"""Facts of the on-disk format, in one place: file names, take ids, entry kinds.

Everything here is a name or a string written to disk; changing one breaks
reading old snapshots. ``docs/format.md`` describes the layout and what a
reader does with each kind.
"""
from __future__ import annotations

import re
import uuid
from typing import Final, NamedTuple

#: The newest format version: the one this code reads up to (what differs between versions: ``_versions/``).
FORMAT_VERSION: Final = 3
#: The version takes write unless ``PPE_SNAPSHOT_FORMAT_VERSION`` says otherwise, or the take is incremental.
DEFAULT_VERSION: Final = 2
#: The version of an incremental snapshot: version 2 whose index files may name data files of sibling snapshots
#: (``../<snapshot>/data/rank<r>.bin``), listed in the manifest's ``references``.
INCREMENTAL_VERSION: Final = 3
#: The manifest, written last: its presence commits the snapshot.
MANIFEST_NAME: Final = "manifest.json"
#: Marks a snapshot directory whose manifest was removed (by retention) while incremental snapshots beside it still
#: read its data files: it is no snapshot, its data files stay until no snapshot references them.
RETIRED_NAME: Final = "retired.json"
#: Format version 2: the shared index (replicated entries, the table of sharded tensors), written by the committing
#: rank, and each rank's index (its entries and the shards it wrote), written by that rank; both before the manifest.
INDEX_DIR: Final = "index"
SHARED_INDEX: Final = f"{INDEX_DIR}/shared.idx"


def rank_index(rank: int) -> str:
    """The index file of rank ``rank`` (format version 2)."""
    return f"{INDEX_DIR}/rank{rank}.idx"


#: Where the ranks of a take being committed publish their parts (and rank 0 an abort marker).
PARTS_DIR: Final = ".parts"


def data_file(rank: int) -> str:
    """The data file rank ``rank`` writes."""
    return f"data/rank{rank}.bin"


_DATA_FILE = re.compile(r"data/rank(\d+)\.bin")


def data_file_rank(name: str) -> int | None:
    """The rank whose :func:`data_file` is ``name``; None for any other name."""
    match = _DATA_FILE.fullmatch(name)
    return int(match.group(1)) if match else None


def new_take_id() -> str:
    """A fresh take id (16 hex digits): names a take's parts and is recorded in its manifest."""
    return uuid.uuid4().hex[:16]


def part_name(take_id: str, rank: int) -> str:
    """The part a rank publishes once its data is durable."""
    return f"{PARTS_DIR}/{take_id}.rank{rank}.json"


def detail_name(take_id: str, rank: int) -> str:
    """What a rank's part of a version-2 take leaves out (its table of sharded tensors, the shared paths it
    expects), published just before the part."""
    return f"{PARTS_DIR}/{take_id}.rank{rank}.detail.json"


def abort_name(take_id: str) -> str:
    """The marker rank 0 writes instead of the manifest when a take fails."""
    return f"{PARTS_DIR}/{take_id}.abort"


class InProgress(NamedTuple):
    """What a file name under ``.parts/`` says: the take it belongs to and whether it marks an abort."""
    take_id: str
    aborted: bool


def parse_parts_name(name: str) -> InProgress | None:
    """The meaning of a file name (its base name) found under ``.parts/``; None for anything else."""
    take_id, dot, rest = name.partition(".")
    if not take_id or not dot:
        return None
    if rest == "abort":
        return InProgress(take_id, True)
    if rest.startswith("rank") and rest.endswith(".json"):
        return InProgress(take_id, False)
    return None


def takes_in_progress(names: list[str]) -> set[str]:
    """The take ids with a published part and no abort marker among the ``.parts/`` file names ``names``."""
    parsed = [p for p in map(parse_parts_name, names) if p is not None]
    aborted = {p.take_id for p in parsed if p.aborted}
    return {p.take_id for p in parsed if not p.aborted and p.take_id not in aborted}


class EntryType:
    """Entry type tags of the manifest (``"type"`` of each entry)."""
    TENSOR: Final = "tensor"
    SHARDED: Final = "sharded"
    OBJECT: Final = "object"
    PICKLE: Final = "pickle"
    BYTES: Final = "bytes"
    CONTAINER: Final = "container"


class Raw:
    """What a data file holds for one leaf: the ``kind`` of a payload, and of a tensor entry (tensor / ndarray)."""
    TENSOR: Final = "tensor"
    NDARRAY: Final = "ndarray"
    #: ``pickle.dumps`` of a value (only with ``allow_pickle``); stored as a ``pickle`` entry.
    PICKLED: Final = "pickle"
    #: Opaque bytes stored as they are (DCP's ``BYTE_IO`` items); stored as a ``bytes`` entry, never unpickled.
    BYTES: Final = "bytes"


class Container:
    """``kind`` of a container entry."""
    DICT: Final = "dict"
    ORDERED_DICT: Final = "OrderedDict"
    LIST: Final = "list"
    TUPLE: Final = "tuple"
    #: The kinds whose children are named by keys (the others by index).
    KEYED: Final = (DICT, ORDERED_DICT)


__all__ = ["Container", "DEFAULT_VERSION", "EntryType", "FORMAT_VERSION", "INCREMENTAL_VERSION", "INDEX_DIR",
           "InProgress", "MANIFEST_NAME", "PARTS_DIR", "RETIRED_NAME", "SHARED_INDEX", "Raw",
           "abort_name", "data_file", "data_file_rank", "detail_name", "new_take_id", "parse_parts_name", "part_name",
           "rank_index", "takes_in_progress"]
