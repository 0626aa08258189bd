"""What each rank writes.

Per-rank state is written by its rank. Replicated state (glob patterns, and
every DistributedDataParallel module, inferred) is identical on all ranks,
so it is written once in total: each payload goes to the least-loaded rank,
largest first. Sharded tensors (DTensor, ShardedTensor) are written shard by
shard, each shard by one of the ranks holding it (see sharded.py). Every rank
computes the same assignment from its own copy, so no communication is needed.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Iterable

from torch.nn.parallel import DistributedDataParallel

from ppe_snapshot.engine._format import Raw
from ppe_snapshot.engine._state.flattening import FlatItem, Payload, PlainTensors, escape
from ppe_snapshot.engine._state.sharded import ShardedPayload, ShardPlan, plan_sharded


def replicated_patterns(app_state: dict[str, Any], replicated: Iterable[str] | None) -> list[str]:
    """The user's globs plus every DDP-wrapped module of the app state."""
    patterns = list(replicated or [])
    for key, obj in app_state.items():
        if isinstance(obj, DistributedDataParallel):
            patterns += [escape(key), f"{escape(key)}/*"]
    return patterns


def assign_replicated(payloads: list[tuple[str, Payload]], world_size: int) -> dict[str, int]:
    """Path -> rank that writes it, balancing bytes over ranks."""
    loads = [(0, r) for r in range(world_size)]
    owner: dict[str, int] = {}
    for path, payload in sorted(payloads, key=lambda item: (-item[1].nbytes, item[0])):
        load, rank = heapq.heappop(loads)
        owner[path] = rank
        heapq.heappush(loads, (load + payload.nbytes, rank))
    return owner


@dataclass
class RankPlan:
    """What one rank writes: its plain tensors and payloads to its data file, entries that need no bytes."""
    plain: PlainTensors = field(default_factory=PlainTensors)
    payloads: list[tuple[str, Payload]] = field(default_factory=list)
    entries: dict[str, FlatItem] = field(default_factory=dict)
    sharded: dict[str, ShardPlan] = field(default_factory=dict)


def plan_rank(items: dict[str, FlatItem], rank: int, world_size: int, plain: PlainTensors | None = None
              ) -> RankPlan:
    """This rank's share of ``items`` (and of ``plain``: never replicated, so all of them)."""
    plan = RankPlan(plain or PlainTensors())
    shared = [(p, i) for p, i in items.items() if i.replicated and type(i) is Payload]
    owner = assign_replicated(shared, world_size)
    add = plan.payloads.append
    for path, item in items.items():
        if type(item) is Payload:  # most items first
            if not item.replicated or owner[path] == rank:
                add((path, item))
        elif isinstance(item, ShardedPayload):  # each shard once in total, by a rank holding it
            plan.sharded[path], tensors = plan_sharded(path, item, dedupe=world_size > 1)
            plan.payloads += [(name, Payload(Raw.TENSOR, tensor)) for name, tensor in tensors]
        elif not item.replicated or rank == 0:
            plan.entries[path] = item
    return plan
