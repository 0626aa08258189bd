"""``exchange`` over a real gloo group: documents that fit the first message, fill it exactly, pass it by a byte,
or are many times longer, each way; every rank gets root's decision, the same."""
from __future__ import annotations

import torch.distributed as dist

from ppe_snapshot.engine import exchange, side_group
from ppe_snapshot.engine._ranks.rank_channel import MESSAGE_BYTES

#: JSON strings of these many characters encode to this many bytes plus their two quotes; the first message holds
#: 8 bytes of length and ``MESSAGE_BYTES - 8`` of the document.
_SIZES = [3, MESSAGE_BYTES - 8 - 2, MESSAGE_BYTES - 8 - 1, 100_000]


def _text(rank: int) -> str:
    return "".join(chr(ord("a") + (rank + i) % 26) for i in range(_SIZES[rank]))


def exchange_documents() -> list:
    group = side_group(None).group
    rank = dist.get_rank()
    everyone = exchange(group, _text(rank), 1, lambda docs: docs)  # the answer is long: 100 KiB and more
    lengths = exchange(group, {"rank": rank}, 2, lambda docs: [len(d) for d in everyone] + [d["rank"] for d in docs])
    return [everyone, lengths]


def test_documents_of_every_length_reach_root_and_its_answer_every_rank(dist_run):
    results = dist_run(exchange_documents, 4)
    expected = [_text(rank) for rank in range(4)]
    assert all(everyone == expected for everyone, _ in results)
    assert all(lengths == _SIZES + [0, 1, 2, 3] for _, lengths in results)
