"""Rank functions for tests/test_local_tier_transfer.py (run by the shared gloo worker pool, ``dist_run``)."""
from __future__ import annotations

import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from ppe_snapshot.engine import LOCAL, Snapshot, StateDict
from ppe_snapshot.local_tier import LocalSaves, Ranks, recover, transfer
from ppe_snapshot.local_tier.saves import RESTORE_TAGS
from ppe_snapshot.storage import MemoryFiles


def state(rank: int) -> dict[str, torch.Tensor]:
    """A part's state: a large tensor (read in hashed pieces), a small one, an empty one."""
    g = torch.Generator().manual_seed(rank)
    return {"big": torch.randn((3 << 18) + 5, generator=g), "small": torch.arange(rank, rank + 7),
            "empty": torch.empty(0)}


def blank(rank: int) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state(rank).items()}


def part_in_memory(root: str, fits: bool) -> dict[str, Any]:
    """Rank 1 sends its part (an engine snapshot of one rank) to rank 0, which receives it into memory (``fits``:
    the host has the memory, else it goes into the directory named) and restores it."""
    rank, group = dist.get_rank(), dist.new_group(backend="gloo")
    source, dest = os.path.join(root, "part"), os.path.join(root, "received")
    if rank == 1:
        Snapshot.take(source, {"s": StateDict(state(1))}, pg=LOCAL)
        transfer.move(group, RESTORE_TAGS, (0, source), [])
        return {}
    incoming = transfer.Incoming(1, dest, in_memory=True)
    fits_in_memory = transfer._fits_in_memory
    if not fits:
        transfer._fits_in_memory = lambda nbytes: False  # as on a host short of memory
    try:
        problem = transfer.move(group, RESTORE_TAGS, None, [incoming])[1]
    finally:
        transfer._fits_in_memory = fits_in_memory
    target = blank(1)
    received = incoming.received
    Snapshot(received if received is not None else dest, pg=LOCAL).restore({"s": StateDict(target)})
    return {"problem": problem, "in_memory": isinstance(received, MemoryFiles),
            "written": os.path.exists(dest), "same": all(torch.equal(target[k], v) for k, v in state(1).items()),
            "files": sorted(received.files) if received is not None else None}


def node_lost(root: str) -> dict[str, Any]:
    """Two ranks on two nodes, each the other's partner: local step 4 saved and agreed; rank 1's directory wiped;
    both resume: rank 1 from rank 0's copy, received into memory; its part is written back into its directory."""
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
    written = saves.part_path(4)
    again = blank(rank)
    Snapshot(written, pg=LOCAL).restore({"s": StateDict(again)})
    return {"step": result.step, "source": result.source, "restored_from": sources,
            "same": all(torch.equal(target[k], v) for k, v in state(rank).items()),
            "marked": os.path.exists(f"{written}.complete"),
            "written_same": all(torch.equal(again[k], v) for k, v in state(rank).items())}
