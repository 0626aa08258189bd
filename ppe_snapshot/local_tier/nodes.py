"""Which node each rank runs on, and the partner of each rank: a rank of another node that holds its copy.

A node is named by ``PPE_SNAPSHOT_NODE`` where set (tests and benchmarks simulate several nodes on one machine
so, one value per simulated node), else by the host name and, under a launcher that sets ``LOCAL_RANK``
(torchrun), the first global rank of the node. Partners form a ring over the nodes: the ``i``-th rank of a node
is held by the ``i``-th rank (cyclically) of the next node, so a lost node's parts are all on the next one.
"""
from __future__ import annotations

import os
import socket

#: The environment variable naming this process's node (overrides the host name).
NODE_ENV = "PPE_SNAPSHOT_NODE"


def this_node(rank: int) -> str:
    """This process's node, as the module's docstring says."""
    named = os.environ.get(NODE_ENV)
    if named:
        return named
    local_rank = os.environ.get("LOCAL_RANK")
    host = socket.gethostname()
    return f"{host}:{rank - int(local_rank)}" if local_rank is not None and local_rank.isdigit() else host


def partners(nodes: list[str]) -> dict[int, int]:
    """Each rank's partner (rank -> the rank holding its copy), given each rank's node in rank order; empty when
    every rank is on one node."""
    members: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        members.setdefault(node, []).append(rank)
    order = list(members)
    if len(order) < 2:
        return {}
    chosen = {}
    for i, node in enumerate(order):
        following = members[order[(i + 1) % len(order)]]
        for j, rank in enumerate(members[node]):
            chosen[rank] = following[j % len(following)]
    return chosen


def wards(partner_of: dict[int, int], rank: int) -> list[int]:
    """The ranks whose copies ``rank`` holds."""
    return sorted(r for r, p in partner_of.items() if p == rank)
