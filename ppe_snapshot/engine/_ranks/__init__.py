"""The ranks of a take: ``LOCAL`` and a group's rank, and how ranks speak (the side group, a take's channel,
``exchange``, ``agree_max``).

The face of this subpackage: what the rest of the engine uses of it (modules here import each other directly).
"""
from ppe_snapshot.engine._ranks.agreements import agree_max, exchange
from ppe_snapshot.engine._ranks.rank_channel import SideGroup, TakeChannel, side_group
from ppe_snapshot.engine._ranks.ranks import LOCAL, group_rank

__all__ = [
    "agree_max", "exchange", "group_rank", "LOCAL", "side_group", "SideGroup", "TakeChannel",
]
