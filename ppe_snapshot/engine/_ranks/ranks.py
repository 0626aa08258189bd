"""Which process this is: ``LOCAL`` and the rank / world size in a process group."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist


class LocalGroup:
    """Pass ``pg=LOCAL`` for a snapshot taken or restored by this process alone,
    even when torch.distributed is initialized (one saver rank, any reader)."""

    def __repr__(self) -> str:
        return "LOCAL"


LOCAL = LocalGroup()


def group_rank(pg: Any = None) -> tuple[int, int]:
    """(rank, world size) in ``pg`` (None: the default group); (0, 1) for ``LOCAL`` or without torch.distributed."""
    if pg is not LOCAL and dist.is_available() and dist.is_initialized():
        return dist.get_rank(pg), dist.get_world_size(pg)
    return 0, 1
