"""Rank functions for tests/test_local_tier_transfer.py (run by the shared gloo worker pool, ``dist_run``)."""
from __future__ import annotations

import os
import shutil
import threading
from typing import Any

import torch
import torch.distributed as dist

from ppe_snapshot.engine import LOCAL, Snapshot, StateDict
from ppe_snapshot.errors import SnapshotAbortedError
from ppe_snapshot.local_tier import LocalSaves, Ranks, recover
from ppe_snapshot.local_tier.peer_reads import open_peer_files, serve_copy
from ppe_snapshot.local_tier.saves import RESTORE_TAGS
from ppe_snapshot.local_tier.transfer import receive_doc, send_doc

TAG = RESTORE_TAGS


def state(rank: int) -> dict[str, torch.Tensor]:
    """A part's state: a large tensor (read in several messages and hashed pieces), a small one, an empty one."""
    g = torch.Generator().manual_seed(rank)
    return {"big": torch.randn((5 << 20) + 5, generator=g), "small": torch.arange(rank, rank + 7),
            "empty": torch.empty(0)}


def blank(rank: int) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state(rank).items()}


def same(got: dict[str, torch.Tensor], rank: int) -> bool:
    return all(torch.equal(got[k], v) for k, v in state(rank).items())


def read_from_peer(root: str, holds: bool) -> dict[str, Any]:
    """Rank 1 serves its copy (``holds``; else it has none) of rank 0's part, under ``root`` (a directory: sent
    from its pages mapped; a ``memory://`` URL: read into buffers); rank 0 restores from it."""
    rank, group = dist.get_rank(), dist.new_group(backend="gloo")
    path = f"{root}/copy"
    if rank == 1:
        if holds:
            Snapshot.take(path, {"s": StateDict(state(0))}, pg=LOCAL)
        serve_copy(group, 0, TAG, path if holds else None)
        return {}
    files = open_peer_files(group, 1, TAG)
    if files is None:
        return {"none": True}
    target = blank(0)
    try:
        Snapshot(files, pg=LOCAL).restore({"s": StateDict(target)})
    finally:
        files.end()
    return {"none": False, "same": same(target, 0), "url": files.url, "sent with the header": sorted(files.inline)}


def crafted_request(root: str) -> dict[str, Any]:
    """Rank 0 asks rank 1 for bytes outside its copy's files: refused, and the serving ends."""
    rank, group = dist.get_rank(), dist.new_group(backend="gloo")
    path = os.path.join(root, "copy")
    if rank == 1:
        Snapshot.take(path, {"s": StateDict(state(0))}, pg=LOCAL)
        serve_copy(group, 0, TAG, path)
        return {}
    files = open_peer_files(group, 1, TAG)
    name = next(iter(files.sizes))
    files.sizes["../outside"] = 10  # what a confused reader could ask for
    try:
        files.read_into("../outside", 0, memoryview(bytearray(10)))
    except SnapshotAbortedError as e:
        refused = str(e)
    try:
        files.read_into(name, 0, memoryview(bytearray(1)))
    except SnapshotAbortedError as e:
        ended = str(e)
    return {"refused": refused, "ended": ended}


def crafted_header(header: dict) -> dict[str, Any]:
    """Rank 1 sends rank 0 a copy's header that names a file outside the copy: rank 0 refuses it and tells rank 1
    to stop serving (so that it is not left waiting for requests)."""
    rank, group = dist.get_rank(), dist.new_group(backend="gloo")
    if rank == 1:
        for work in send_doc(group, header, 0, TAG):
            work.wait()
        return {"told": receive_doc(group, 0, TAG)}
    try:
        open_peer_files(group, 1, TAG)
    except SnapshotAbortedError as e:
        return {"error": str(e)}
    return {}


def node_lost(root: str) -> dict[str, Any]:
    """Two ranks on two nodes, each the other's partner: local step 4 saved and agreed; rank 1's directory wiped;
    both resume: rank 1 from rank 0's copy, read over the group."""
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
    ranks = Ranks(rank, 2, group, partner=1 - rank, wards=(1 - rank,))
    directory = os.path.join(root, f"node{rank}")
    saves = LocalSaves(directory, ranks, keep=1)
    saves.save(4, {"s": StateDict(state(rank))}, {})
    saves.finish()
    dist.barrier(group)
    if rank == 1:
        shutil.rmtree(directory)
    dist.barrier(group)
    saves = LocalSaves(directory, ranks, keep=1)
    target = blank(rank)
    sources: list[str] = []

    def restore(part: Any) -> None:
        sources.append(type(part).__name__)
        Snapshot(part, pg=LOCAL).restore({"s": StateDict(target)})
    result = recover(saves, None, restore)
    saves.finish()
    if not hasattr(result, "step"):
        return {"fallback": result.reason}
    return {"step": result.step, "source": result.source, "path": result.path, "restored_from": sources,
            "same": same(target, rank), "threads": [t.name for t in threading.enumerate()]}
