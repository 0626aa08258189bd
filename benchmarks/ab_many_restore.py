"""A/B: the warm restore of many small tensors (issue 35's 10,000-tensor figure) with two checkouts of
ppe-snapshot, interleaved: what a change to the restore's walk costs, on a machine without a GPU.

    python benchmarks/ab_many_restore.py --a /path/to/base/checkout --b /path/to/changed/checkout \
        [--rounds 9] [--count 10000]

Each round runs one fresh process per checkout, the order alternating. A process saves ``--count`` flat fp32
tensors of 64 MiB in all and restores them in place (``Snapshot(path).restore``) four ways, each the median of
21 restores after 3 warm-ups, in us per tensor:

- **host**: as is, CPU targets read straight into;
- **host, walk only**: the reads dropped (the walk, its hand-offs, the final checks);
- **slabs**: the CPU targets routed through the device slabs, as a GPU's are (``bulk.in_host_memory`` patched);
- **slabs, walk only**: the same with the reads and the slabs' copies dropped.

The walk through the slabs is the part of a GPU restore that this machine can measure: on an H200 it took most of
the restore (issue 35's notes in RESULTS.md). The patched names are the engine's internals as of issue 35's
sessions; a checkout without them fails loudly.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import run_ab  # noqa: E402

CHILD = r"""
import json, os, statistics, sys, time
checkout, root, count = sys.argv[1], sys.argv[2], int(sys.argv[4])
sys.path.insert(0, checkout)
import torch
import ppe_snapshot as ps
import ppe_snapshot.engine._restore.bulk as bulk
from ppe_snapshot.engine._files import ReadBatch
from ppe_snapshot.engine._restore.device_slabs import DeviceSlabs
assert ps.__file__.startswith(checkout), ps.__file__

state = {f"t{i}": torch.full(((16 << 20) // count,), float(i)) for i in range(count)}
path = os.path.join(root, "s")
ps.Snapshot.take(path, {"m": ps.StateDict(state)})
submit, copy, in_host_memory = ReadBatch.submit, DeviceSlabs.copy, bulk.in_host_memory


def per_tensor(walk_only, slabs):
    ReadBatch.submit = (lambda self, storage, fn, *a, workers=None: None) if walk_only else submit
    DeviceSlabs.copy = (lambda self: None) if walk_only else copy
    bulk.in_host_memory = (lambda target: False) if slabs else in_host_memory
    try:
        times = []
        for _ in range(24):
            start = time.perf_counter()
            ps.Snapshot(path).restore({"m": ps.StateDict(state)})
            times.append(time.perf_counter() - start)
        return statistics.median(times[3:]) / count * 1e6
    finally:
        ReadBatch.submit, DeviceSlabs.copy, bulk.in_host_memory = submit, copy, in_host_memory


out = {"host": per_tensor(False, False), "host, walk only": per_tensor(True, False),
       "slabs": per_tensor(False, True), "slabs, walk only": per_tensor(True, True)}
for t in state.values():
    t.fill_(-1.0)
ps.Snapshot(path).restore({"m": ps.StateDict(state)})
assert all(float(t[0]) == i for i, t in enumerate(state.values())), "the restore lost a value"
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="checkout A (e.g. a worktree of the base commit)")
    parser.add_argument("--b", required=True, help="checkout B")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--count", type=int, default=10_000)
    args = parser.parse_args()
    args.a, args.b = os.path.abspath(args.a), os.path.abspath(args.b)
    run_ab(CHILD, args, [str(args.count)], unit=" us")


if __name__ == "__main__":
    main()
