"""A/B: a take of 1 GiB by 3 gloo ranks (sync and async) with two checkouts of ppe-snapshot, interleaved.

    python benchmarks/ab_take_ranks.py --a /path/to/base/checkout --b /path/to/changed/checkout [--rounds 5]

Each round runs one fresh process per checkout (the order alternating), which spawns 3 ranks, each holding a
third of 1 GiB (``--scale``) in float32 tensors of 64 MiB. Each rank times three ``Snapshot.take`` and three
``Snapshot.async_take`` (the call, and until ``wait()`` returns), all ranks starting together after a barrier;
a take's time is its slowest rank's, each metric the median of its three takes. The report gives the median over
the rounds and B/A (issue 21: the rank channel costs nothing measurable when nothing fails).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import run_ab  # noqa: E402

CHILD = r"""
import json, os, shutil, socket, statistics, sys, time
checkout, root, benchmarks, scale = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
sys.path.insert(0, checkout)
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 3


def slowest(seconds):
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def rank_main(rank, port, queue):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    import ppe_snapshot as ps
    assert ps.__file__.startswith(checkout), ps.__file__
    per_rank = int(scale * (1 << 30)) // WORLD
    count = max(1, per_rank // (64 << 20))
    state = {"m": ps.StateDict({f"t{i}": torch.randn(per_rank // count // 4) for i in range(count)})}
    out = {"take": [], "async_take call": [], "async_take committed": []}
    for i in range(3):
        path = os.path.join(root, f"sync{i}")
        dist.barrier()
        start = time.perf_counter()
        ps.Snapshot.take(path, state)
        out["take"].append(slowest(time.perf_counter() - start))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)
    for i in range(3):
        path = os.path.join(root, f"async{i}")
        dist.barrier()
        start = time.perf_counter()
        pending = ps.Snapshot.async_take(path, state)
        out["async_take call"].append(slowest(time.perf_counter() - start))
        pending.wait()
        out["async_take committed"].append(slowest(time.perf_counter() - start))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)
    if rank == 0:
        queue.put({k: statistics.median(v) for k, v in out.items()})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    result = queue.get(timeout=900)
    for p in procs:
        p.join()
    print(json.dumps(result))
"""


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="checkout A (e.g. a worktree of the base commit)")
    parser.add_argument("--b", required=True, help="checkout B")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scale", type=float, default=1.0, help="GiB in total over the 3 ranks")
    args = parser.parse_args()
    run_ab(CHILD, args, [str(args.scale)])
