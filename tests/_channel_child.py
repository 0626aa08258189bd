"""One of two ranks of a take's channel (``TakeChannel``) over a real gloo group, run as a script.

``python tests/_channel_child.py RANK PORT DIR``: rank 0 aborts the take, as when a third rank died, and exits at
once without teardown (``DIR/rank0.exited`` marks it); rank 1 waits for that verdict and for rank 0's exit, then
reports its own part done and writes the verdict it is given to ``DIR/verdict.json``.
"""
from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch.distributed as dist  # noqa: E402

from ppe_snapshot.engine import side_group  # noqa: E402
from ppe_snapshot.engine._ranks import TakeChannel  # noqa: E402

#: Why rank 0 aborts the take.
REASON = "rank 2 died or lost its connection during the take (killed)"


def _wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what}")
        time.sleep(0.01)


def main(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    channel = TakeChannel(side_group(None).group, rank, 2, "0123456789abcdef")
    exited = os.path.join(out, "rank0.exited")
    if rank == 0:
        channel.abort(REASON)
        open(exited, "w").close()
        os._exit(0)
    _wait_for(lambda: channel.failure() is not None, "rank 0's verdict")
    _wait_for(lambda: os.path.exists(exited), "rank 0's exit")
    time.sleep(0.5)  # its connections closed
    channel.report(None)
    with open(os.path.join(out, "verdict.json"), "w") as f:
        json.dump(channel.verdict(10.0), f)
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
