"""Agreements through one rank over a gloo side group (``rank_channel.side_group``): every rank's document to
``root``, which decides and answers all (:func:`exchange`), and the largest of one number per rank
(:func:`agree_max`); point to point, so that a rank that died is named on every other."""
from __future__ import annotations

import json
import struct
from typing import Any, Callable

import torch
import torch.distributed as dist

from ppe_snapshot.engine._ranks.rank_channel import MESSAGE_BYTES, peer_lost
from ppe_snapshot.errors import SnapshotAbortedError

#: The longest document :func:`exchange` accepts from a peer.
_MAX_DOCUMENT = 64 << 20


def _receive_all(group: Any, buffers: dict[int, torch.Tensor], tag: int) -> str | None:
    """Rank 0: receive into ``buffers[peer]`` from every peer at once. Why the first lost peer was lost (None:
    none was); the lost peers' buffers are removed."""
    lost, works = None, {}
    for peer, buffer in list(buffers.items()):
        try:
            works[peer] = group.recv([buffer], peer, tag)
        except RuntimeError as e:
            lost = lost or peer_lost(peer, e)
            del buffers[peer]
    for peer, work in works.items():
        try:
            work.wait()
        except RuntimeError as e:
            lost = lost or peer_lost(peer, e)
            del buffers[peer]
    return lost


def _send_all(group: Any, messages: dict[int, torch.Tensor], tag: int) -> None:
    """Rank 0: send ``messages[peer]`` to every peer at once (a peer that died meanwhile no longer waits)."""
    works = []
    for peer, message in messages.items():
        try:
            works.append(group.send([message], peer, tag))
        except RuntimeError:
            pass
    for work in works:
        try:
            work.wait()
        except RuntimeError:
            pass


#: A document of :func:`exchange` travels as one message of :data:`MESSAGE_BYTES` (its length, then its first bytes,
#: zero-padded) and, only where it is longer, a second with the rest: most exchanges cost one message each way
#: (two, a length then the document, cost a second wake-up of the receiver each way).
_LENGTH = struct.Struct("<q")
_FIRST = MESSAGE_BYTES - _LENGTH.size


def _messages(doc: Any) -> list[torch.Tensor]:
    """``doc`` as :func:`exchange` sends it: the first message, and the rest where it is longer."""
    data = json.dumps(doc).encode()
    first = bytearray(MESSAGE_BYTES)
    _LENGTH.pack_into(first, 0, len(data))
    first[_LENGTH.size:_LENGTH.size + min(len(data), _FIRST)] = data[:_FIRST]
    messages = [torch.frombuffer(first, dtype=torch.uint8)]
    if len(data) > _FIRST:
        messages.append(torch.frombuffer(bytearray(data[_FIRST:]), dtype=torch.uint8))
    return messages


def _first_message() -> torch.Tensor:
    return torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)


def _length(first: torch.Tensor) -> int:
    return _LENGTH.unpack_from(first.numpy())[0]


def _rest(length: int) -> torch.Tensor | None:
    """Where the rest of a document of ``length`` bytes is received (None: it fit its first message)."""
    return torch.empty(length - _FIRST, dtype=torch.uint8) if length > _FIRST else None


def _document(first: torch.Tensor, rest: torch.Tensor | None) -> Any:
    data = bytes(first.numpy()[_LENGTH.size:_LENGTH.size + min(_length(first), _FIRST)])
    return json.loads(data if rest is None else data + bytes(rest.numpy()))


def _received(group: Any, buffer: torch.Tensor, peer: int, tag: int) -> torch.Tensor:
    """``buffer``, received from ``peer``; :class:`~ppe_snapshot.errors.SnapshotAbortedError` naming it when it
    died."""
    try:
        group.recv([buffer], peer, tag).wait()
    except RuntimeError as e:
        raise SnapshotAbortedError(peer_lost(peer, e)) from e
    return buffer


def _bad_length(peer: int, length: int) -> str | None:
    return None if 0 < length <= _MAX_DOCUMENT else f"rank {peer} sent a document of {length} bytes"


def exchange(group: Any, doc: Any, tag: int, decide: Callable[[list[Any]], Any], *, root: int = 0) -> Any:
    """What rank ``root`` decides (``decide`` of every rank's ``doc``, in rank order) from what each rank of the
    gloo ``group`` gives (every rank calls it with the same ``tag`` and ``root``). Documents are JSON values:
    nothing a peer sends is unpickled.

    Point to point through ``root``, so that a rank whose process died is named: raises
    :class:`~ppe_snapshot.errors.SnapshotAbortedError` on every surviving rank (``root`` hears every live rank
    first); unlike a collective, no survivor is left waiting for a peer of the dead rank.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if world_size == 1:
        return decide([doc])
    if rank != root:
        try:
            for work in [group.send([message], root, tag) for message in _messages(doc)]:
                work.wait()
        except RuntimeError as e:
            raise SnapshotAbortedError(peer_lost(root, e)) from e
        first = _received(group, _first_message(), root, tag)
        length = _length(first)
        bad = _bad_length(root, length)
        if bad is not None:
            raise SnapshotAbortedError(bad)
        rest = _rest(length)
        decided = _document(first, None if rest is None else _received(group, rest, root, tag))
        if decided.get("lost"):
            raise SnapshotAbortedError(decided["lost"])
        return decided["decided"]
    firsts = {peer: _first_message() for peer in range(world_size) if peer != root}
    lost = _receive_all(group, firsts, tag)
    rests: dict[int, torch.Tensor] = {}
    for peer, first in firsts.items():
        length = _length(first)
        bad = _bad_length(peer, length)
        lost = lost or bad
        rest = None if bad is not None else _rest(length)
        if rest is not None:
            rests[peer] = rest
    lost = _receive_all(group, rests, tag) or lost
    answer = {"lost": lost} if lost else {
        "decided": decide([doc if r == root else _document(firsts[r], rests.get(r)) for r in range(world_size)])}
    for message in _messages(answer):
        _send_all(group, dict.fromkeys(firsts, message), tag)
    if lost:
        raise SnapshotAbortedError(lost)
    return answer["decided"]


def agree_max(group: Any, value: int, tag: int) -> int:
    """The largest ``value`` given by the ranks of the gloo ``group``: an :func:`exchange` of one number each way,
    naming a rank that died in a :class:`~ppe_snapshot.errors.SnapshotAbortedError`."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if world_size == 1:
        return value
    if rank != 0:
        answer = torch.zeros(2, dtype=torch.int64)
        try:
            group.send([torch.tensor([value], dtype=torch.int64)], 0, tag).wait()
            group.recv([answer], 0, tag).wait()
        except RuntimeError as e:
            raise SnapshotAbortedError(peer_lost(0, e)) from e
        if answer[1]:
            raise SnapshotAbortedError(f"rank {int(answer[1]) - 1} died or lost its connection")
        return int(answer[0])
    values = {peer: torch.zeros(1, dtype=torch.int64) for peer in range(1, world_size)}
    lost = _receive_all(group, values, tag)
    first_lost = min(set(range(1, world_size)) - set(values), default=-1)
    answer = torch.tensor([max([value, *(int(v) for v in values.values())]), first_lost + 1], dtype=torch.int64)
    _send_all(group, dict.fromkeys(values, answer), tag)
    if lost:
        raise SnapshotAbortedError(lost)
    return int(answer[0])
