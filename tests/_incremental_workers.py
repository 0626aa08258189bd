"""Functions run by the ``dist_run`` pool workers in tests/test_incremental.py (two ranks of a gloo group)."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from ppe_snapshot import Snapshot, StateDict

#: The sharded tensor both ranks hold a half of (256 KiB); it never changes between the two takes.
FROZEN = torch.arange(256 * 256, dtype=torch.float32).reshape(256, 256)
BLOCK = 4096


def own_values(rank: int, step: int) -> torch.Tensor:
    """A per-rank tensor (16 KiB) whose first block changes with ``step``."""
    values = torch.arange(4096, dtype=torch.float32) + 10_000 * rank
    values[:16] = step
    return values


def incremental_takes(root: str) -> dict[str, Any]:
    """A plain take (in blocks of ``BLOCK``), then two incremental ones, each after changing one block of each
    rank's own tensor; both ranks restore the last. Returns what this rank wrote to its data file in each
    incremental take and what it restored."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # per-rank state under its own key: beside sharded tensors, values count as replicated (SPMD state)
    shared, own = StateDict(frozen=distribute_tensor(FROZEN, mesh, [Shard(0)]), step=1), StateDict(own=None)
    own["own"] = own_values(rank, 1)
    Snapshot.take(f"{root}/s1", {"m": shared, "rank": own}, block_bytes=BLOCK)
    for step in (2, 3):
        own["own"], shared["step"] = own_values(rank, step), step
        Snapshot.take(f"{root}/s{step}", {"m": shared, "rank": own}, base=f"{root}/s{step - 1}", block_bytes=BLOCK)
    target = StateDict(frozen=distribute_tensor(torch.zeros(256, 256), mesh, [Shard(0)]), step=0)
    own_target = StateDict(own=torch.zeros(4096))
    Snapshot(f"{root}/s3").restore({"m": target, "rank": own_target})
    return {"written": [os.path.getsize(f"{root}/s{step}/data/rank{rank}.bin") for step in (2, 3)],
            "frozen": target["frozen"].full_tensor(),
            "own": own_target["own"], "step": target["step"]}


def dcp_incremental_saves(root: str) -> dict[str, Any]:
    """Three ``dcp.save`` of a sharded frozen tensor and a sharded adapter through SnapshotStorageWriter, each
    save after the first with the one before as its base and one block of each rank's shard of the adapter
    changed; then ``dcp.load`` of the last into fresh sharded targets. Returns this rank's data file size in the
    last save and the tensors loaded (whole)."""
    import torch.distributed.checkpoint as dcp

    from ppe_snapshot.dcp import SnapshotStorageReader, SnapshotStorageWriter

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    adapter = torch.zeros(2 * 4096)  # each rank's shard: 4096 floats, 16 KiB
    state = {"frozen": distribute_tensor(FROZEN, mesh, [Shard(0)]),
             "adapter": distribute_tensor(adapter, mesh, [Shard(0)])}
    dcp.save(state, storage_writer=SnapshotStorageWriter(f"{root}/d1"))
    for step in (2, 3):
        state["adapter"].to_local()[:16] = step  # the first block of this rank's shard
        dcp.save(state, storage_writer=SnapshotStorageWriter(f"{root}/d{step}", base=f"{root}/d{step - 1}",
                                                             block_bytes=BLOCK))
    target = {name: distribute_tensor(torch.zeros_like(value.full_tensor()), mesh, [Shard(0)])
              for name, value in state.items()}
    dcp.load(target, storage_reader=SnapshotStorageReader(f"{root}/d3"))
    written = sum(os.path.getsize(f"{root}/d3/data/{name}") for name in os.listdir(f"{root}/d3/data")
                  if name.startswith(f"rank{rank}"))
    return {"written": written, **{name: value.full_tensor() for name, value in target.items()}}
