"""A/B: the sync take (durable) with two checkouts of ppe-snapshot, interleaved.

    python benchmarks/ab_take.py --a /path/to/base/checkout --b /path/to/changed/checkout \
        [--rounds 3] [--scale 1.0] [--many 100000]

Each round runs one fresh process per checkout, the order alternating. A process times three
``Snapshot.take`` of the ~1 GiB model + Adam state of ``bench_engine.large_state`` (the large-tensor path),
then three of 64 MiB in ``--many`` float32 tensors and three of ``--many`` 0-d tensors (the per-tensor path);
each metric is the median of its three takes. The report gives the median over the rounds and B/A.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import ab_main  # noqa: E402

CHILD = r"""
import json, os, shutil, statistics, sys, time
checkout, root, benchmarks, scale, many = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
sys.path.insert(0, checkout)
sys.path.insert(1, benchmarks)  # the benchmarks of this run, for the states
import torch
import ppe_snapshot as ps
from bench_engine import large_state
assert ps.__file__.startswith(checkout), ps.__file__


def takes(app, name):
    times = []
    for i in range(3):
        path = os.path.join(root, f"{name}{i}")
        start = time.perf_counter()
        ps.Snapshot.take(path, app)
        times.append(time.perf_counter() - start)
        shutil.rmtree(path)
    return statistics.median(times)


out = {}
model, optim = large_state(scale)
out["1 GiB model + Adam"] = takes({"model": model, "optim": optim}, "large")
del model, optim
torch.manual_seed(0)
out[f"64 MiB in {many} float32"] = takes({"m": ps.StateDict({f"t{i}": torch.randn(16 * 2**20 // many)
                                                           for i in range(many)})}, "many")
out[f"{many} 0-d"] = takes({"m": ps.StateDict({f"t{i}": torch.tensor(float(i)) for i in range(many)})}, "zero")
print(json.dumps(out))
"""


if __name__ == "__main__":
    ab_main(__doc__, CHILD)
