"""The names inside a local tier directory, and what a rank holds there.

::

    <directory>/step_<iteration>/rank<r>/             rank r's part of the step: an engine snapshot of one rank
    <directory>/step_<iteration>/rank<r>.complete     written once every rank agreed the step is complete
    <directory>/step_<iteration>/copy-rank<w>/        the partner copy of rank w's part, held by w's partner
    <directory>/step_<iteration>/copy-rank<w>.complete
    <directory>/.spare-rank<r>.bin, .spare-copy-rank<w>.bin   the data file of a retired part or copy

A retired part's data file is kept as its slot's spare, and the next part or copy of that slot is written over it
(:func:`reuse_spare`): its memory pages (tmpfs) are written again in place instead of freed and allocated afresh
(fresh pages made a partner copy's writes 4-6x slower here from the 4th step on; benchmarks/RESULTS.md, issue 34).
The memory bound is unchanged: the spare stands for the step in flight.

A part or copy counts only with its ``.complete`` marker (a small JSON document: the step, the world size, whose
part it is; an own part's adds its files as they were, ``storage.record_files``), written after the ranks agreed
that every part and every partner copy of the step is complete and verified; anything without one is a step in
flight or the leftover of one that failed.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ppe_snapshot.storage import Tree

_STEP = re.compile(r"step_(\d+)")
MARKER = ".complete"
#: The data file of a part (a one-rank engine snapshot: rank 0's data file).
_DATA = "data/rank0.bin"


def step_dir(step: int) -> str:
    return f"step_{step}"


def own_part(step: int, rank: int) -> str:
    """Rank ``rank``'s part of ``step``, relative to the tier directory."""
    return f"{step_dir(step)}/rank{rank}"


def copy_of(step: int, ward: int) -> str:
    """The partner copy of rank ``ward``'s part of ``step``, relative to the tier directory."""
    return f"{step_dir(step)}/copy-rank{ward}"


@dataclass
class Held:
    """The complete parts and partner copies one rank holds in a tier directory, by step: each marker's document."""
    own: dict[int, dict[str, Any]] = field(default_factory=dict)
    copies: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)  # ward -> step -> marker

    def summary(self, world_size: int) -> dict[str, Any]:
        """What the other ranks need to choose a step (JSON: keys are strings): the steps of this world size."""
        return {"own": sorted(s for s, m in self.own.items() if m.get("world_size") == world_size),
                "copies": {str(w): sorted(s for s, m in steps.items() if m.get("world_size") == world_size)
                           for w, steps in self.copies.items()}}


def steps(tree: Tree) -> list[int]:
    """The steps present in the tier directory (complete or not), oldest first."""
    found = []
    for entry in tree.list(tree.root):
        match = _STEP.fullmatch(entry["name"].rstrip("/").rpartition("/")[2])
        if match and entry.get("type") == "directory":
            found.append(int(match.group(1)))
    return sorted(found)


_PART = re.compile(r"(rank|copy-rank)(\d+)")


def inventory(tree: Tree) -> list[dict[str, Any]]:
    """What a tier directory holds, step by step (for ``ppe-snapshot ls``): per step its parts and partner copies
    (rank -> whether marked complete), their bytes, and whether the step is complete here (every part and copy
    present is marked)."""
    rows = []
    for step in steps(tree):
        parts: dict[int, bool] = {}
        copies: dict[int, bool] = {}
        size = 0
        for entry in tree.list(f"{tree.root}/{step_dir(step)}"):
            match = _PART.fullmatch(entry["name"].rstrip("/").rpartition("/")[2])
            if match is None or entry.get("type") != "directory":
                continue
            rank = int(match.group(2))
            name = (own_part if match.group(1) == "rank" else copy_of)(step, rank)
            (parts if match.group(1) == "rank" else copies)[rank] = read_marker(tree, name) is not None
            size += tree.size(entry["name"])
        rows.append({"step": step, "ranks": parts, "copies": copies, "bytes": size,
                     "complete": bool(parts or copies) and all([*parts.values(), *copies.values()])})
    return rows


def read_marker(tree: Tree, part: str) -> dict[str, Any] | None:
    """The marker of ``part`` (relative), or None when it has none or an unreadable one."""
    try:
        doc = json.loads(tree.read(f"{tree.root}/{part}{MARKER}"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("world_size"), int) else None


def write_marker(tree: Tree, part: str, doc: dict[str, Any]) -> None:
    data = json.dumps(doc).encode()
    tree.save_file(f"{tree.root}/{part}{MARKER}", lambda f: f.write(data))


def held(tree: Tree, rank: int, wards: list[int]) -> Held:
    """What ``rank`` holds complete: its own parts and its ``wards``' copies."""
    found = Held()
    for step in steps(tree):
        marker = read_marker(tree, own_part(step, rank))
        if marker is not None:
            found.own[step] = marker
        for ward in wards:
            marker = read_marker(tree, copy_of(step, ward))
            if marker is not None:
                found.copies.setdefault(ward, {})[step] = marker
    return found


def remove_part(tree: Tree, part: str) -> None:
    """Remove ``part`` (relative), its marker first, and its step directory once empty."""
    root = tree.root
    for path in (f"{root}/{part}{MARKER}", f"{root}/{part}"):
        if tree.exists(path):
            tree.remove(path)
    step = f"{root}/{part.partition('/')[0]}"
    if tree.exists(step) and not tree.list(step):
        try:
            tree.remove(step)
        except OSError:  # another rank of the node wrote into it meanwhile
            pass


def _spare(part: str) -> str:
    """The spare data file of ``part``'s slot (rank r's own parts, or the copies of rank w's), relative."""
    return f".spare-{part.rpartition('/')[2]}.bin"


def retire_part(tree: Tree, part: str) -> None:
    """Remove ``part`` (relative) as :func:`remove_part` does, its data file kept as its slot's spare (replacing
    an older one)."""
    root = tree.root
    if tree.exists(f"{root}/{part}{MARKER}"):
        tree.remove(f"{root}/{part}{MARKER}")
    data, spare = f"{root}/{part}/{_DATA}", f"{root}/{_spare(part)}"
    if tree.is_file(data):
        if tree.exists(spare):
            tree.remove(spare)
        tree.move(data, spare)
    remove_part(tree, part)


def reuse_spare(tree: Tree, part: str) -> None:
    """Put the spare data file of ``part``'s slot, if any, where ``part``'s data file is about to be written (the
    part has none yet): the write then goes over its pages."""
    root = tree.root
    spare, data = f"{root}/{_spare(part)}", f"{root}/{part}/{_DATA}"
    if tree.is_file(spare) and not tree.exists(data):
        tree.make_directory(data.rpartition("/")[0])
        tree.move(spare, data)


def prune_parts(tree: Tree, rank: int, wards: list[int], keep: int) -> None:
    """Keep ``rank``'s newest ``keep`` complete parts and copies of its ``wards``; retire the older ones
    (:func:`retire_part`) and the leftovers (no marker) of steps older than the newest complete one."""
    present = steps(tree)
    for name, part_of in [(rank, own_part)] + [(w, copy_of) for w in wards]:
        complete = [s for s in present if read_marker(tree, part_of(s, name)) is not None]
        kept = set(complete[-keep:])
        newest = complete[-1] if complete else None
        for step in present:
            if step in kept or (newest is not None and step > newest):
                continue
            if tree.exists(f"{tree.root}/{part_of(step, name)}") or step in complete:
                retire_part(tree, part_of(step, name))


def remove_unfinished(tree: Tree, rank: int, wards: list[int]) -> None:
    """Remove ``rank``'s parts and its wards' copies that have no marker (saves that never completed)."""
    for step in steps(tree):
        for part in [own_part(step, rank)] + [copy_of(step, w) for w in wards]:
            if tree.exists(f"{tree.root}/{part}") and read_marker(tree, part) is None:
                remove_part(tree, part)
